"""The verifier backends: one channel each, periodic health checks (standard grpc.health.v1) and stats polls.

A backend receives traffic while its last health check answered SERVING. A request whose verifier
call fails with UNAVAILABLE marks the backend down at once (`mark_failed`); the next successful check
brings it back. Each poll also reads Verifier.GetStats for the context length, the vocabulary size and
the engine's queue (used by least-loaded routing); a failed stats poll alone does not mark a backend down.
With `--verifier-dns` the set of backends follows DNS (gateway/discovery.py): pods that appear are added,
pods that leave are retired (their channel closes once the gateway's requests on them have finished).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import GatewayConfig
from gateway.discovery import DnsDiscovery, Resolver, resolve_addresses
from gateway.router import BackendLoad, Router
from shared.grpc_server import CHANNEL_OPTIONS
from shared.proto_gen.specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from shared.tls import aio_channel

log = logging.getLogger(__name__)

# Reconnect quickly after a verifier restarts (the gRPC default backs off up to 120 s).
BACKEND_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
# After a client-certificate rotation a backend gets a new channel; calls running on the old one may go on
# this long before the old channel is closed.
RENEWED_CHANNEL_GRACE_S = 3600.0


@dataclass
class Backend:
    load: BackendLoad
    channel: grpc.aio.Channel
    stub: verifier_pb2_grpc.VerifierStub
    health: health_pb2_grpc.HealthStub
    engine: common_pb2.EngineStats | None = None
    model: str = ""
    tls_signature: object = None  # the TLS files' stat when the channel was opened

    @property
    def address(self) -> str:
        return self.load.address


class BackendPool:
    """The verifiers: the fixed `--verifiers` list, or the pods `--verifier-dns` resolves to (kept current)."""

    def __init__(
        self,
        config: GatewayConfig,
        router: Router | None = None,
        resolve: Resolver | None = None,
        interceptors: Sequence[Any] = (),
    ) -> None:
        """`interceptors`: the tracing ones of shared/telemetry.py when tracing is on."""
        self.config = config
        self.interceptors = list(interceptors) or None
        self.tls = config.client_tls(config.tls_server_name)  # None: plaintext to the verifiers
        self._old_channels: dict[asyncio.Task[None], grpc.aio.Channel] = {}  # closing after a renewal
        static = () if config.verifier_dns else config.verifiers
        self.router = router or Router.for_addresses(static)
        self.backends: dict[str, Backend] = {address: self._connect(address) for address in static}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._recheck: asyncio.Task[None] | None = None
        # Backends that left the DNS answer while requests were still running on them: their channel stays
        # open until those finish (a draining verifier pod completes them), then it is closed.
        self._retiring: list[Backend] = []
        self.discovery: DnsDiscovery | None = None
        if config.verifier_dns:
            self.discovery = DnsDiscovery(
                config.verifier_dns, config.dns_refresh_interval_s, self.set_addresses, resolve or resolve_addresses
            )
        # Called with the number of healthy backends whenever a backend goes up or down.
        self.on_change: Callable[[int], None] | None = None

    def _connect(self, address: str) -> Backend:
        signature, channel = self._channel(address)
        return Backend(
            load=self.router.add(address),
            channel=channel,
            stub=verifier_pb2_grpc.VerifierStub(channel),
            health=health_pb2_grpc.HealthStub(channel),
            tls_signature=signature,
        )

    def _channel(self, address: str) -> tuple[object, grpc.aio.Channel]:
        """Reads the TLS files now: the channel's connections present the client certificate read here."""
        signature = self.tls.signature() if self.tls is not None else None
        return signature, aio_channel(address, self.tls, BACKEND_CHANNEL_OPTIONS, self.interceptors)

    def _renew_channel_if_rotated(self, backend: Backend) -> None:
        """A rotated client certificate (or CA) gets a new channel: gRPC channel credentials are fixed at
        creation. New calls use the new channel; running ones finish on the old one."""
        if self.tls is None or self.tls.signature() == backend.tls_signature:
            return
        try:
            signature, channel = self._channel(backend.address)
        except ValueError as err:  # a rotation half done: keep the old channel, try again next check
            log.warning("event=tls_reload_failed backend=%s error=%s", backend.address, err)
            return
        old = backend.channel
        backend.channel, backend.tls_signature = channel, signature
        backend.stub = verifier_pb2_grpc.VerifierStub(channel)
        backend.health = health_pb2_grpc.HealthStub(channel)
        log.info("event=tls_channel_renewed backend=%s", backend.address)
        task = asyncio.get_running_loop().create_task(old.close(RENEWED_CHANNEL_GRACE_S))
        self._old_channels[task] = old
        task.add_done_callback(lambda t: self._old_channels.pop(t, None))

    async def start(self) -> None:
        """One round of checks right away (so a fresh gateway routes at once), then periodic ones."""
        await asyncio.gather(*(self.check(b) for b in self.backends.values()))
        for backend in self.backends.values():
            self._start_loop(backend)
        if self.discovery is not None:
            await self.discovery.start()

    def _start_loop(self, backend: Backend) -> None:
        self._tasks[backend.address] = asyncio.create_task(self._loop(backend), name=f"health {backend.address}")

    async def set_addresses(self, addresses: Sequence[str]) -> None:
        """Makes the backends exactly `addresses`: new ones are checked at once, gone ones stop taking requests."""
        wanted = set(addresses)
        healthy_before = self.healthy_count()
        for address in [a for a in self.backends if a not in wanted]:
            backend = self.backends.pop(address)
            self.router.remove(address)
            await _cancel(self._tasks.pop(address, None))
            self._retiring.append(backend)
            log.info("event=backend_removed backend=%s active_requests=%d", address, backend.load.active_requests)
        if self.healthy_count() != healthy_before and self.on_change is not None:
            self.on_change(self.healthy_count())  # (an added backend reports itself when its check passes)
        added = [self._connect(a) for a in sorted(wanted - set(self.backends))]
        for backend in added:
            self.backends[backend.address] = backend
            log.info("event=backend_added backend=%s", backend.address)
        await asyncio.gather(*(self.check(b) for b in added))
        for backend in added:
            self._start_loop(backend)
        await self._close_idle_retired()

    async def _close_idle_retired(self) -> None:
        idle = [b for b in self._retiring if b.load.active_requests == 0]
        self._retiring = [b for b in self._retiring if b.load.active_requests > 0]
        await asyncio.gather(*(b.channel.close() for b in idle))

    async def close(self) -> None:
        if self.discovery is not None:
            await self.discovery.close()
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = {}
        await _cancel(self._recheck)
        old_channels = list(self._old_channels.values())
        for task in list(self._old_channels):
            await _cancel(task)
        channels = [*old_channels, *(b.channel for b in [*self.backends.values(), *self._retiring])]
        await asyncio.gather(*(channel.close() for channel in channels))

    def __getitem__(self, address: str) -> Backend:
        return self.backends[address]

    async def _loop(self, backend: Backend) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            self._renew_channel_if_rotated(backend)
            await self.check(backend)

    async def check(self, backend: Backend) -> None:
        timeout = self.config.health_check_timeout_s
        try:
            reply = await backend.health.Check(
                health_pb2.HealthCheckRequest(service=self.config.health_service), timeout=timeout
            )
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            reason = "" if serving else health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError as err:
            serving, reason = False, f"{err.code().name}: {err.details()}"
        except Exception as err:  # a health check must never kill its loop
            serving, reason = False, f"{type(err).__name__}: {err}"
        self._set_healthy(backend, serving, reason)
        if serving:
            await self._poll_stats(backend)

    async def _poll_stats(self, backend: Backend) -> None:
        try:
            stats = await backend.stub.GetStats(
                verifier_pb2.VerifierGetStatsRequest(), timeout=self.config.health_check_timeout_s
            )
        except grpc.aio.AioRpcError as err:
            log.debug("event=stats_poll_failed backend=%s code=%s", backend.address, err.code().name)
            return
        backend.engine = stats.stats
        backend.model = stats.model
        backend.load.engine_queue = stats.stats.running_requests + stats.stats.waiting_requests
        backend.load.max_model_len = stats.max_model_len or None
        backend.load.vocab_size = stats.vocab_size or None
        backend.load.eos_token_ids = frozenset(stats.eos_token_ids)

    async def recheck_unhealthy(self) -> None:
        """Checks every backend marked down right now (a request found none healthy). Concurrent callers
        share one round, so a burst of requests does not multiply the health checks."""
        if self._recheck is None or self._recheck.done():
            down = [b for b in self.backends.values() if not b.load.healthy]
            self._recheck = asyncio.create_task(self._check_all(down))
        await asyncio.shield(self._recheck)

    async def _check_all(self, backends: list[Backend]) -> None:
        await asyncio.gather(*(self.check(b) for b in backends))

    def healthy_count(self) -> int:
        return sum(b.load.healthy for b in self.backends.values())

    def mark_failed(self, address: str, reason: str) -> None:
        backend = self.backends.get(address)
        if backend is not None:  # None: it left the DNS answer while the request ran there
            self._set_healthy(backend, False, reason)

    def _set_healthy(self, backend: Backend, healthy: bool, reason: str = "") -> None:
        if backend.load.healthy != healthy:
            if healthy:
                log.info("event=backend_up backend=%s", backend.address)
            else:
                log.warning("event=backend_down backend=%s reason=%r", backend.address, reason)
        changed = backend.load.healthy != healthy
        backend.load.healthy = healthy
        if changed and self.on_change is not None:
            self.on_change(self.healthy_count())


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
