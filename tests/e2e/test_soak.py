"""The soak (specdec_bench/soak.py) for 60 seconds on the failover stack (two verifiers): 8 clients mixing
greedy, seeded, stop-string, cancelled, short-deadline and invalid requests while verifier a and then the
proposer are SIGKILLed and restarted. Every check of the soak must pass (`make soak` runs it for 10 minutes
with 64 clients: docs/RELIABILITY.md)."""

from __future__ import annotations

import asyncio

import pytest

from specdec_bench.soak import SoakConfig, soak
from specdec_local.processes import Stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_sixty_second_soak_passes(failover_stack: Stack, tokenizer, tmp_path):
    # Half of each process's life counts as warm-up here (0.3 in the 10-minute run): a process lives 30 to 90 s
    # in this run, and its memory still settles in its first tens of seconds under load.
    config = SoakConfig(duration_s=60, clients=8, out=tmp_path, num_specs=12, max_tokens=24, warmup_fraction=0.5)
    report = asyncio.run(soak(failover_stack, tokenizer, config))
    report.write(tmp_path)
    print(report.markdown())
    assert report.passed, f"soak checks failed (report in {tmp_path}):\n{report.markdown()}"
    assert report.summary["requests"] > config.clients  # every client sent more than one request
