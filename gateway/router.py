"""Choosing a verifier for a request. Pure Python, no grpc.

- With a session id: rendezvous (highest-random-weight) hashing of the session id over the healthy
  verifiers. Every (session, verifier) pair gets a stable pseudo-random score and the session goes to
  the verifier with the highest score. When a verifier leaves, only its own sessions move (each to
  its second choice); when one joins, it takes only the sessions it now scores highest on. So a
  session's KV blocks and prefix cache stay on one verifier while the set of verifiers is stable.
- Without a session id: the least-loaded healthy verifier: fewest requests this gateway has in
  flight on it, then the smallest engine queue (running + waiting) from its last stats poll; ties
  rotate so equal backends share the work.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from shared.errors import UnavailableError


def rendezvous_score(key: str, address: str) -> int:
    """Stable 64-bit score of (key, address); the same on every gateway replica and every run."""
    digest = hashlib.blake2b(f"{address}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_pick(key: str, addresses: Iterable[str]) -> str | None:
    """The address with the highest score for `key` (ties, practically impossible, go to the smaller address)."""
    best: tuple[int, str] | None = None
    for address in addresses:
        score = rendezvous_score(key, address)
        if best is None or score > best[0] or (score == best[0] and address < best[1]):
            best = (score, address)
    return best[1] if best else None


def rendezvous_order(key: str, addresses: Iterable[str]) -> list[str]:
    """All addresses, best first: the order a session falls back through when verifiers fail."""
    return sorted(addresses, key=lambda a: (-rendezvous_score(key, a), a))


@dataclass
class BackendLoad:
    """The router's view of one verifier."""

    address: str
    healthy: bool = False
    active_requests: int = 0  # this gateway's requests in flight on it
    engine_queue: int = 0  # running + waiting from the last stats poll
    max_model_len: int | None = None  # from Verifier.GetStats, once polled
    vocab_size: int | None = None
    eos_token_ids: frozenset[int] = frozenset()  # every id the verifier stops on, once polled


@dataclass
class Router:
    backends: dict[str, BackendLoad] = field(default_factory=dict)
    _turn: int = 0

    @classmethod
    def for_addresses(cls, addresses: Sequence[str]) -> Router:
        return cls({a: BackendLoad(a) for a in addresses})

    def add(self, address: str) -> BackendLoad:
        """A new verifier (e.g. a pod that DNS now lists); unhealthy until its first health check."""
        return self.backends.setdefault(address, BackendLoad(address))

    def remove(self, address: str) -> None:
        """A verifier that left: only the sessions whose first choice it was move (rendezvous hashing)."""
        self.backends.pop(address, None)

    def healthy(self, exclude: Iterable[str] = ()) -> list[BackendLoad]:
        excluded = set(exclude)
        return [b for b in self.backends.values() if b.healthy and b.address not in excluded]

    def pick(self, session_id: str = "", exclude: Iterable[str] = ()) -> BackendLoad:
        """The verifier for a request; raises UnavailableError when none is healthy.

        `exclude`: verifiers that already failed this request (a resumed session goes to its next
        rendezvous choice, which is where it would go anyway once the failed one is marked down).
        """
        candidates = self.healthy(exclude)
        if not candidates:
            total = len(self.backends)
            raise UnavailableError(
                f"no healthy verifier: 0 of {total} configured verifier{'s' if total != 1 else ''} "
                "pass health checks; retry later"
            )
        if session_id:
            address = rendezvous_pick(session_id, (b.address for b in candidates))
            return self.backends[address] if address else candidates[0]
        least = min((b.active_requests, b.engine_queue) for b in candidates)
        tied = [b for b in candidates if (b.active_requests, b.engine_queue) == least]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def context_limit(self) -> int | None:
        """Smallest known context length over the healthy verifiers (None before any stats poll)."""
        known = [b.max_model_len for b in self.healthy() if b.max_model_len]
        return min(known) if known else None

    def eos_token_ids(self) -> frozenset[int]:
        """Every end-of-sequence id any verifier reported (they serve one model; a failed one counts too)."""
        return frozenset().union(*(b.eos_token_ids for b in self.backends.values()))

    def vocab_limit(self) -> int | None:
        known = [b.vocab_size for b in self.healthy() if b.vocab_size]
        return min(known) if known else None
