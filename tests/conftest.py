"""Session-wide test settings. Keep this file small: shared fixtures only."""

from __future__ import annotations

import os

# The machine is offline and has 2 cores shared with other jobs. Busy-waiting OpenMP threads make small
# ops many times slower when the cores are contended; set before torch loads its OpenMP runtime.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

torch.set_num_threads(2)

# Real-model fixtures (session-scoped: models load once, references are generated once per run).
from tests.real_models import draft, greedy_references, hf_target, prompts, target, tokenizer  # noqa: E402, F401


def pytest_collection_finish(session) -> None:
    """A session that will need the greedy references starts making them now (tests/real_models.py); the end-to-end
    stacks ask for them while they load, so every test under tests/e2e counts as needing them."""
    if session.config.option.collectonly:
        return
    if any(_needs_references(item) for item in session.items):
        from tests.real_models import start_references_in_background

        start_references_in_background()


def _needs_references(item) -> bool:
    return "greedy_references" in getattr(item, "fixturenames", ()) or "/e2e/" in item.nodeid


def pytest_sessionfinish(session) -> None:
    from tests.real_models import stop_background

    stop_background()
