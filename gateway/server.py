"""`specdec-gateway`: the public gRPC API (specdec.v1.Gateway) in front of one or more verifiers.

    specdec-gateway --verifiers HOST:PORT[,HOST:PORT...] --tokenizer PATH_OR_ID --port N

Every flag also reads SPECDEC_<NAME> (e.g. SPECDEC_VERIFIERS); see `specdec-gateway --help`.
The gateway reports SERVING on grpc.health.v1 once it listens (whether verifiers are healthy is its
routing's business: requests then fail with UNAVAILABLE), and drains on SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health

from gateway.backends import BackendPool
from gateway.config import GatewayConfig, load_gateway_config
from gateway.frontend import Frontend
from gateway.servicer import GatewayServicer
from shared.grpc_server import (
    add_health_and_reflection,
    install_sigterm,
    new_server,
    set_serving,
    setup_logging,
)
from shared.proto_gen.specdec.v1 import gateway_pb2, gateway_pb2_grpc

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

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self, grace: float | None = None) -> None:
        """Drain: NOT_SERVING, let running requests finish for `grace` seconds, then cancel the rest."""
        await set_serving(self.health, [SERVICE_NAME], False)
        await self.server.stop(self.config.drain_timeout_s if grace is None else grace)
        await self.pool.close()


async def start_gateway(config: GatewayConfig, tokenizer: Any = None) -> RunningGateway:
    """Builds and starts a gateway (tests pass an already loaded tokenizer, and port 0)."""
    if tokenizer is None:
        from shared.model.loader import load_tokenizer

        name = config.tokenizer_name()
        log.info("event=loading_tokenizer tokenizer=%s", name)
        tokenizer = await asyncio.to_thread(load_tokenizer, name)
    pool = BackendPool(config)
    servicer = GatewayServicer(Frontend(tokenizer, config), pool)
    server = new_server()
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
    health_servicer = add_health_and_reflection(server, [SERVICE_NAME])
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise OSError(f"could not listen on {config.host}:{config.port}")
    await pool.start()
    await server.start()
    await set_serving(health_servicer, [SERVICE_NAME], True)
    healthy = sum(b.load.healthy for b in pool.backends.values())
    log.info(
        "event=serving port=%d verifiers=%s healthy_verifiers=%d",
        port,
        ",".join(config.verifiers),
        healthy,
    )
    return RunningGateway(server, servicer, pool, health_servicer, port, config)


async def serve(config: GatewayConfig) -> None:
    stop = asyncio.Event()
    install_sigterm(stop)
    gateway = await start_gateway(config)
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
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
