"""`specdec-gateway`: the public gRPC API (specdec.v1.Gateway) and the OpenAI-compatible HTTP API
(gateway/http_api.py, on --http-port) in front of one or more verifiers; both front ends run the same core.

    specdec-gateway --verifiers HOST:PORT[,HOST:PORT...] --tokenizer PATH_OR_ID --port N --http-port M

Every flag also reads SPECDEC_<NAME> (e.g. SPECDEC_VERIFIERS); see `specdec-gateway --help`.

Health (grpc.health.v1): the overall status "" is SERVING while the process serves (liveness); the
service "specdec.v1.Gateway" is SERVING only while at least one verifier is healthy (readiness: without
one, requests fail with UNAVAILABLE). On SIGTERM both go NOT_SERVING, running requests get
--drain-timeout-s to finish, the rest are cancelled (and with them their verifier calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2

from gateway.auth import ApiKeyAuth, KeyFile
from gateway.backends import BackendPool
from gateway.config import GatewayConfig, load_gateway_config
from gateway.core import GatewayCore
from gateway.http_api import make_app
from gateway.http_limits import ConnectionStats, HttpLimits, LimitsMiddleware, guarded_protocol
from gateway.prepare import RequestPreparer
from gateway.servicer import GatewayServicer
from shared.gc_tuning import freeze_startup_heap
from shared.grpc_server import (
    add_health_and_reflection,
    install_sigterm,
    new_server,
    set_serving,
    setup_logging,
)
from shared.malloc_tuning import tune_malloc
from shared.proto_gen.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from shared.telemetry import Telemetry, setup_telemetry
from shared.tls import ReloadingSSLContext, add_port, check_files_or_exit

log = logging.getLogger(__name__)

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


@dataclass
class RunningGateway:
    server: grpc.aio.Server
    servicer: GatewayServicer
    pool: BackendPool
    health: health.aio.HealthServicer
    port: int
    config: GatewayConfig
    readiness: _Readiness
    telemetry: Telemetry
    http: _HttpServer | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """The HTTP API's base URL on loopback (empty without one)."""
        return f"http://127.0.0.1:{self.http.port}" if self.http is not None else ""

    async def stop(self, grace: float | None = None) -> None:
        """Drain: NOT_SERVING, let running requests finish for `grace` seconds, then cancel the rest."""
        self.readiness.stopped = True
        await self.readiness.settle()
        await set_serving(self.health, [SERVICE_NAME], False)
        grace_s = self.config.drain_timeout_s if grace is None else grace
        if self.http is not None:
            await asyncio.gather(self.server.stop(grace_s), self.http.stop())
        else:
            await self.server.stop(grace_s)
        await self.pool.close()
        await asyncio.to_thread(self.telemetry.shutdown)  # flushes spans still batched for export


class _Readiness:
    """Mirrors "is any verifier healthy" into the health status of the Gateway service."""

    def __init__(self, health_servicer: health.aio.HealthServicer) -> None:
        self._health = health_servicer
        self._last: asyncio.Task[None] | None = None
        self.stopped = False

    def update(self, healthy_verifiers: int) -> None:
        if self.stopped:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING if healthy_verifiers else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        previous = self._last

        async def apply() -> None:
            if previous is not None:
                await previous  # keep the order of updates
            await self._health.set(SERVICE_NAME, status)

        self._last = asyncio.get_running_loop().create_task(apply())

    async def settle(self) -> None:
        if self._last is not None:
            await self._last


HEALTH_HEADROOM_RPCS = 256


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside the gateway's event loop: the gateway owns SIGTERM (drain both front ends), not uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _HttpServer:
    """The OpenAI-compatible API (gateway/http_api.py) served by uvicorn on an already bound socket."""

    def __init__(self, core: GatewayCore, config: GatewayConfig) -> None:
        self.limits = HttpLimits(
            max_body_bytes=config.max_request_bytes,
            max_requests=config.max_concurrent_rpcs,
            max_connections=config.http_max_connections,
            read_timeout_s=config.http_read_timeout_s,
            keep_alive_s=config.http_keep_alive_s,
            write_timeout_s=config.http_write_timeout_s,
        )
        self.app = LimitsMiddleware(make_app(core, config.model_name(), config.http_sse_keepalive_s), self.limits)
        self.connection_stats = ConnectionStats()
        self.tls: ReloadingSSLContext | None = None
        uv_config = uvicorn.Config(
            self.app,
            http=guarded_protocol(self.limits, self.connection_stats, self._on_accept),
            timeout_keep_alive=max(1, round(config.http_keep_alive_s)),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=max(1, int(config.drain_timeout_s)),
            ssl_certfile=config.tls_cert_file or None,
            ssl_keyfile=config.tls_key_file or None,
            # the public port's client-certificate rule holds for both front ends
            ssl_ca_certs=(config.tls_ca_file or None) if config.require_client_cert else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if config.require_client_cert else ssl.CERT_NONE,
        )
        uv_config.load()
        if uv_config.ssl is not None:  # the certificate rotates as on the gRPC port (shared/tls.py)
            self.tls = ReloadingSSLContext(uv_config.ssl, config.tls_cert_file, config.tls_key_file, config.tls_ca_file)
        self.sock = socket.create_server((config.host, config.http_port), reuse_port=False)
        self.port = self.sock.getsockname()[1]
        self.server = _EmbeddedUvicorn(uv_config)
        self.task: asyncio.Task[None] | None = None

    def _on_accept(self) -> None:
        if self.tls is not None:
            self.tls.maybe_reload()

    async def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises why it could not start
                raise OSError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task
        self.sock.close()


async def start_gateway(
    config: GatewayConfig, tokenizer: Any = None, telemetry: Telemetry | None = None
) -> RunningGateway:
    """Builds and starts a gateway (tests pass an already loaded tokenizer, and port 0). `telemetry`:
    default from the OTEL_* environment and --metrics-port (shared/telemetry.py)."""
    auth = _auth(config)  # a bad key file stops the start before the slow part
    if tokenizer is None:
        from shared.model.loader import load_tokenizer

        name = config.tokenizer_name()
        log.info("event=loading_tokenizer tokenizer=%s", name)
        tokenizer = await asyncio.to_thread(load_tokenizer, name)
    if telemetry is None:
        telemetry = setup_telemetry("specdec-gateway", metrics_port=config.metrics_port, metrics_host=config.host)
    pool = BackendPool(config, interceptors=telemetry.client_interceptors())
    servicer = GatewayServicer(RequestPreparer(tokenizer, config), pool, telemetry, auth=auth)
    # The core caps generation at max_concurrent_rpcs; the server's own cap leaves room above it for health
    # checks and stats, so a client holding every generation slot cannot make the liveness probe fail.
    server = new_server(
        telemetry.server_interceptors(), config.max_request_bytes, config.max_concurrent_rpcs + HEALTH_HEADROOM_RPCS
    )
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
    health_servicer = add_health_and_reflection(server, [SERVICE_NAME], reflection_on=config.enable_reflection)
    port = add_port(server, config.host, config.port, config, "gateway")
    if port == 0:
        telemetry.shutdown()
        raise OSError(f"could not listen on {config.host}:{config.port}")
    readiness = _Readiness(health_servicer)
    pool.on_change = readiness.update
    http = _HttpServer(servicer.core, config) if config.http_port else None
    await pool.start()
    await server.start()
    if http is not None:
        await http.start()
    await set_serving(health_servicer, [], True)
    readiness.update(pool.healthy_count())
    await readiness.settle()
    healthy = sum(b.load.healthy for b in pool.backends.values())
    log.info(
        "event=serving port=%d http_port=%s verifiers=%s healthy_verifiers=%d",
        port,
        http.port if http is not None else "off",
        f"dns:{config.verifier_dns}" if config.verifier_dns else ",".join(config.verifiers),
        healthy,
    )
    return RunningGateway(server, servicer, pool, health_servicer, port, config, readiness, telemetry, http)


def _auth(config: GatewayConfig) -> ApiKeyAuth | None:
    """API keys on the Gateway service only: grpc.health.v1 and reflection stay open (probes carry no key)."""
    if not config.api_keys_file:
        return None
    return ApiKeyAuth(
        KeyFile(config.api_keys_file), config.api_key_max_concurrent_streams, config.api_key_max_tokens_per_minute
    )


async def serve(config: GatewayConfig) -> None:
    stop = asyncio.Event()
    install_sigterm(stop)
    gateway = await start_gateway(config)
    freeze_startup_heap()  # shared/gc_tuning.py
    await stop.wait()
    log.info(
        "event=draining timeout_s=%.1f active_requests=%d",
        config.drain_timeout_s,
        gateway.servicer.counters.active_requests,
    )
    await gateway.stop()
    log.info("event=stopped")


def main(argv: Sequence[str] | None = None) -> None:
    config = load_gateway_config(argv)
    setup_logging(config.log_level)
    check_files_or_exit(config, "gateway")
    tune_malloc()
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
