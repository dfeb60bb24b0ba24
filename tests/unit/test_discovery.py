"""Verifier discovery by DNS (gateway/discovery.py + BackendPool.set_addresses).

The verifiers are real grpc.aio servers on 127.0.0.1 that serve only grpc.health.v1 (the pool needs no
more). The resolver is a fake where the test plays a headless Service whose pods come and go; one test
resolves `localhost` for real.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from gateway.backends import BackendPool
from gateway.config import GatewayConfig, load_gateway_config
from gateway.discovery import resolve_addresses
from gateway.router import rendezvous_order
from shared.grpc_server import add_health_and_reflection, new_server, set_serving

pytestmark = pytest.mark.timeout(60)

SESSIONS = [f"session-{i}" for i in range(300)]
NAME = "specdec-verifier-headless"


class HealthOnlyVerifier:
    def __init__(self) -> None:
        self.server = new_server()
        self.health = add_health_and_reflection(self.server, [])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    async def start(self) -> HealthOnlyVerifier:
        await self.server.start()
        await set_serving(self.health, [], True)
        return self


class FakeDns:
    """The records of one name; `fail` makes the next lookups fail like an unreachable DNS server."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.fail = False
        self.lookups: list[tuple[str, int]] = []

    def __call__(self, host: str, port: int) -> list[str]:
        self.lookups.append((host, port))
        if self.fail:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return list(self.addresses)


def dns_config(port: int = 50052, **overrides: Any) -> GatewayConfig:
    # A long refresh interval: the tests trigger each refresh themselves.
    return GatewayConfig(verifier_dns=f"{NAME}:{port}", dns_refresh_interval_s=3600, **overrides)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def started(n: int) -> list[HealthOnlyVerifier]:
    return [await HealthOnlyVerifier().start() for _ in range(n)]


def routes(pool: BackendPool) -> dict[str, str]:
    return {s: pool.router.pick(s).address for s in SESSIONS}


def test_pods_coming_and_going_move_only_their_own_sessions():
    async def scenario() -> None:
        a, b, c = await started(3)
        dns = FakeDns(a.address, b.address)
        pool = BackendPool(dns_config(), resolve=dns)
        changes: list[int] = []
        pool.on_change = changes.append
        await pool.start()
        try:
            assert dns.lookups == [(NAME, 50052)]
            assert set(pool.backends) == {a.address, b.address}  # --verifiers (default) is not used
            assert pool.healthy_count() == 2
            before = routes(pool)
            assert set(before.values()) == {a.address, b.address}

            # Scale up: the new pod takes only sessions onto itself; it is health-checked at once.
            dns.addresses = [a.address, b.address, c.address]
            assert await pool.discovery.refresh()
            assert pool.healthy_count() == 3 and changes[-1] == 3
            grown = routes(pool)
            moved = [s for s in SESSIONS if grown[s] != before[s]]
            assert moved and all(grown[s] == c.address for s in moved)

            # A pod leaves (rollout, scale down, node drain): sessions on the surviving pods keep their
            # verifier; the departed pod's sessions go to their next rendezvous choice.
            dns.addresses = [a.address, c.address]
            await pool.discovery.refresh()
            assert set(pool.backends) == {a.address, c.address} and changes[-1] == 2
            after = routes(pool)
            for s in SESSIONS:
                if grown[s] != b.address:
                    assert after[s] == grown[s]
                else:
                    assert after[s] == rendezvous_order(s, [a.address, b.address, c.address])[1]
            assert any(grown[s] == b.address for s in SESSIONS)
        finally:
            await pool.close()
            for v in (a, b, c):
                await v.server.stop(0)

    run(scenario())


def test_a_dns_failure_keeps_the_known_verifiers_and_no_records_removes_them():
    async def scenario() -> None:
        (a,) = await started(1)
        dns = FakeDns(a.address)
        pool = BackendPool(dns_config(), resolve=dns)
        changes: list[int] = []
        pool.on_change = changes.append
        await pool.start()
        try:
            dns.fail = True
            assert not await pool.discovery.refresh()
            assert set(pool.backends) == {a.address} and pool.healthy_count() == 1
            dns.fail, dns.addresses = False, []  # the headless Service has no ready pod
            assert await pool.discovery.refresh()
            assert pool.backends == {} and changes == [1, 0]
            with pytest.raises(Exception, match="no healthy verifier: 0 of 0"):
                pool.router.pick("s")
            pool.mark_failed(a.address, "a request saw it fail after it left")  # ignored, no KeyError
        finally:
            await pool.close()
            await a.server.stop(0)

    run(scenario())


def test_a_removed_verifier_keeps_its_channel_until_its_requests_finish():
    async def scenario() -> None:
        a, b = await started(2)
        dns = FakeDns(a.address, b.address)
        pool = BackendPool(dns_config(), resolve=dns)
        await pool.start()
        try:
            leaving = pool[b.address]
            leaving.load.active_requests = 1  # a request streams from b while b's pod drains
            dns.addresses = [a.address]
            await pool.discovery.refresh()
            assert b.address not in pool.backends and b.address not in pool.router.backends
            check = health_pb2.HealthCheckRequest()
            reply = await leaving.health.Check(check, timeout=5)  # the channel still works
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            leaving.load.active_requests = 0  # the request finished
            await pool.discovery.refresh()
            with pytest.raises((grpc.aio.UsageError, RuntimeError, ValueError)):
                await leaving.health.Check(check, timeout=5)  # closed now
        finally:
            await pool.close()
            for v in (a, b):
                await v.server.stop(0)

    run(scenario())


def test_resolving_localhost_for_real():
    async def scenario() -> None:
        (v,) = await started(1)
        config = load_gateway_config(["--verifier-dns", f"localhost:{v.port}", "--dns-refresh-interval-s", "3600"])
        pool = BackendPool(config)  # the real resolver
        await pool.start()
        try:
            # localhost may also resolve to ::1, where nothing listens: that backend stays unhealthy.
            assert v.address in pool.backends
            assert pool.backends[v.address].load.healthy
            assert pool.router.pick("any-session").address == v.address
        finally:
            await pool.close()
            await v.server.stop(0)

    assert "127.0.0.1:50052" in resolve_addresses("localhost", 50052)
    assert resolve_addresses("127.0.0.1", 1) == ["127.0.0.1:1"]
    assert resolve_addresses("::1", 7) == ["[::1]:7"]
    run(scenario())


def test_verifier_dns_config(monkeypatch):
    monkeypatch.setenv("SPECDEC_VERIFIER_DNS", "verifiers.ns.svc.cluster.local:50052")
    assert load_gateway_config([]).verifier_dns == "verifiers.ns.svc.cluster.local:50052"
    for bad in ("verifiers", "verifiers:", ":50052", "verifiers:http", "verifiers:70000"):
        with pytest.raises(ValueError, match="not NAME:PORT"):
            GatewayConfig(verifier_dns=bad)
    with pytest.raises(ValueError, match="dns_refresh_interval_s"):
        GatewayConfig(verifier_dns="v:1", dns_refresh_interval_s=0)
