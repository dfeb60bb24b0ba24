"""Whether two processes compete for cores (shared/placement.py): same machine and overlapping CPU sets."""

from __future__ import annotations

import pytest

from shared import placement


@pytest.fixture
def here(monkeypatch):
    monkeypatch.setattr(placement, "host_id", lambda: "boot-1")
    monkeypatch.setattr(placement, "cpu_set", lambda: frozenset({0, 1}))


@pytest.mark.usefixtures("here")
@pytest.mark.parametrize(
    ("host", "cpus", "shared"),
    [
        ("boot-1", [1], True),  # this machine, one core in common
        ("boot-1", [0, 1, 2, 3], True),
        ("boot-1", [], True),  # this machine, cores not stated: they may be ours
        ("boot-1", [2, 3], False),  # pinned apart (taskset, cpusets)
        ("boot-2", [0, 1], False),  # another machine
        ("", [0, 1], False),  # a peer that does not say: as before the check, elsewhere
    ],
)
def test_shares_cores(host, cpus, shared):
    assert placement.shares_cores(host, cpus) is shared


def test_unknown_own_cores_on_the_same_machine_count_as_shared(monkeypatch):
    monkeypatch.setattr(placement, "host_id", lambda: "boot-1")
    monkeypatch.setattr(placement, "cpu_set", lambda: frozenset())
    assert placement.shares_cores("boot-1", [5])


def test_this_process_knows_its_machine_and_cores():
    assert placement.host_id() and placement.host_id() == placement.host_id()
    assert placement.shares_cores(placement.host_id(), sorted(placement.cpu_set()))
