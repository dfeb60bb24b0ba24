"""Verifier discovery by DNS: a Kubernetes headless Service has one A/AAAA record per ready verifier pod.

`--verifier-dns NAME:PORT` makes the gateway re-resolve NAME every `--dns-refresh-interval-s` and hand the
addresses to the BackendPool, which adds the new pods and retires the ones that left. Routing needs no
change: rendezvous hashing over the current set moves only the sessions of a pod that left, and a new pod
takes only the sessions it now scores highest on, so sessions on surviving pods keep their verifier.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

# Resolver errors that mean "the name has no records" (a headless Service without ready pods), as opposed
# to a DNS failure, after which the gateway keeps the verifiers it knows.
_NO_RECORDS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}

Resolver = Callable[[str, int], list[str]]


def split_target(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    return host, int(port)


def resolve_addresses(host: str, port: int) -> list[str]:
    """Sorted unique HOST:PORT addresses of `host` (IPv6 in brackets); [] when the name has no records.
    Raises OSError on a resolver failure."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        if err.errno in _NO_RECORDS:
            return []
        raise
    addresses = set()
    for family, _type, _proto, _name, sockaddr in infos:
        ip = str(sockaddr[0])
        addresses.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(addresses)


class DnsDiscovery:
    """Re-resolves `target` periodically and passes the address set to `apply` (BackendPool.set_addresses)."""

    def __init__(
        self,
        target: str,
        interval_s: float,
        apply: Callable[[list[str]], Awaitable[None]],
        resolve: Resolver = resolve_addresses,
    ) -> None:
        self.host, self.port = split_target(target)
        self.interval_s = interval_s
        self._apply = apply
        self._resolve = resolve
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> bool:
        """One resolution; False (and the known set kept) when the resolver failed."""
        try:
            addresses = await asyncio.to_thread(self._resolve, self.host, self.port)
        except OSError as err:
            log.warning("event=dns_failed name=%s error=%r (keeping the known verifiers)", self.host, str(err))
            return False
        await self._apply(addresses)
        return True

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name=f"dns {self.host}")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.refresh()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
