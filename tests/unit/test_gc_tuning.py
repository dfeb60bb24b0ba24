"""shared/gc_tuning.py: the start-up heap is frozen out of the collector's walks, later garbage is still collected."""

from __future__ import annotations

import gc
import weakref

import pytest

from shared.gc_tuning import freeze_startup_heap


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # the test process's heap goes back to the collector


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref:
    a, b = Node(), Node()
    a.other, b.other = b, a  # only the cyclic collector frees these
    return weakref.ref(a)


def test_objects_tracked_at_start_up_are_frozen_and_left_alone(unfrozen):
    kept = cycle()  # a cycle that is garbage already: the collection before freezing frees it
    frozen = freeze_startup_heap()
    assert frozen == gc.get_freeze_count() > 1_000 and kept() is None
    survivor = Node()
    survivor.other = survivor
    gc.collect()
    assert gc.get_freeze_count() == frozen  # a collection neither walks nor thaws the frozen objects


def test_cycles_made_after_freezing_are_still_collected(unfrozen):
    freeze_startup_heap()
    later = cycle()
    assert later() is not None
    gc.collect()
    assert later() is None


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("SPECDEC_GC_FREEZE", "0")
    before = gc.get_freeze_count()
    assert freeze_startup_heap() == 0 and gc.get_freeze_count() == before
