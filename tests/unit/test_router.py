"""Routing: rendezvous hashing of session ids, least-loaded choice, no healthy verifier."""

from __future__ import annotations

import collections

import pytest

from gateway.router import BackendLoad, Router, rendezvous_order, rendezvous_pick, rendezvous_score
from shared.errors import UnavailableError

ADDRESSES = ["10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.3:50052"]
SESSIONS = [f"session-{i}" for i in range(3000)]


def router(*healthy: bool) -> Router:
    r = Router.for_addresses(ADDRESSES)
    for b, h in zip(r.backends.values(), healthy or (True,) * len(ADDRESSES), strict=True):
        b.healthy = h
    return r


def test_scores_are_stable_and_depend_on_both_key_and_address():
    assert rendezvous_score("s", "a:1") == rendezvous_score("s", "a:1")
    assert rendezvous_score("s", "a:1") != rendezvous_score("s", "a:2")
    assert rendezvous_score("s", "a:1") != rendezvous_score("t", "a:1")
    # Pinned value: the mapping must not change between releases (or gateway replicas would disagree).
    assert rendezvous_score("session-0", "10.0.0.1:50052") == 16963649362505829177
    assert rendezvous_pick("x", []) is None


def test_sessions_spread_evenly_over_backends():
    counts = collections.Counter(rendezvous_pick(s, ADDRESSES) for s in SESSIONS)
    assert set(counts) == set(ADDRESSES)
    assert all(800 < n < 1200 for n in counts.values()), counts


def test_removing_a_backend_moves_only_its_sessions_to_their_second_choice():
    before = {s: rendezvous_pick(s, ADDRESSES) for s in SESSIONS}
    gone = ADDRESSES[1]
    remaining = [a for a in ADDRESSES if a != gone]
    after = {s: rendezvous_pick(s, remaining) for s in SESSIONS}
    for s in SESSIONS:
        if before[s] != gone:
            assert after[s] == before[s]
        else:
            assert after[s] == rendezvous_order(s, ADDRESSES)[1]


def test_adding_a_backend_only_takes_sessions_onto_the_new_one():
    before = {s: rendezvous_pick(s, ADDRESSES) for s in SESSIONS}
    new = "10.0.0.4:50052"
    after = {s: rendezvous_pick(s, [*ADDRESSES, new]) for s in SESSIONS}
    moved = [s for s in SESSIONS if after[s] != before[s]]
    assert all(after[s] == new for s in moved)
    assert 500 < len(moved) < 1000  # about a quarter


def test_router_routes_sessions_over_healthy_backends_only():
    r = router(True, True, True)
    picks = {s: r.pick(s).address for s in SESSIONS[:200]}
    assert all(picks[s] == rendezvous_pick(s, ADDRESSES) for s in picks)
    r.backends[ADDRESSES[0]].healthy = False
    for s, address in picks.items():
        now = r.pick(s).address
        assert now == (address if address != ADDRESSES[0] else rendezvous_order(s, ADDRESSES)[1])
    # A request that failed on its verifier excludes it, and falls through the session's order.
    s = SESSIONS[0]
    order = [a for a in rendezvous_order(s, ADDRESSES) if a != ADDRESSES[0]]
    assert r.pick(s, exclude=[order[0]]).address == order[1]


def test_least_loaded_without_session():
    r = router(True, True, True)
    loads = dict(zip(ADDRESSES, (3, 1, 2), strict=True))
    for address, n in loads.items():
        r.backends[address].active_requests = n
    assert r.pick().address == ADDRESSES[1]
    # Equal gateway load: the engine queue from the stats poll decides.
    r.backends[ADDRESSES[2]].active_requests = 1
    r.backends[ADDRESSES[1]].engine_queue = 5
    assert r.pick().address == ADDRESSES[2]
    # Complete ties rotate over the tied backends.
    r = router(True, True, False)
    assert {r.pick().address for _ in range(4)} == set(ADDRESSES[:2])


def test_no_healthy_backend_is_unavailable():
    with pytest.raises(UnavailableError, match="no healthy verifier: 0 of 3"):
        router(False, False, False).pick("s")
    with pytest.raises(UnavailableError):
        router(True, False, False).pick(exclude=[ADDRESSES[0]])


def test_limits_come_from_healthy_backends():
    r = Router({"a:1": BackendLoad("a:1", True, max_model_len=2048, vocab_size=49152), "b:1": BackendLoad("b:1")})
    assert r.context_limit() == 2048 and r.vocab_limit() == 49152
    r.backends["a:1"].healthy = False
    assert r.context_limit() is None and r.vocab_limit() is None
