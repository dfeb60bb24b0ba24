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
