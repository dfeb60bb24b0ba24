"""The verifier's own scoring times, measured before it serves: the speculation policy (spec_policy.py) starts
from them instead of guessing, and keeps updating them from every decode step.

For each batch size (powers of two, and max_num_seqs) and draft length (0, 1, 2, 4 up to the engine's k) the
target scores that many tokens per sequence after a CONTEXT-token history, as a decode step does; the median of
a few repetitions goes to the policy. It takes about two seconds for the default target on two CPU cores, on
blocks borrowed from the free KV cache and returned at once.
"""

from __future__ import annotations

import statistics
import time

from shared.model.runner import ForwardItem

CONTEXT = 128  # tokens of history per sequence: a short chat turn
DRAFTS = (0, 1, 2, 4)
REPS = 3  # timed forwards per shape; the first of them warms the shape and is dropped


def calibrate(engine) -> None:
    config, blocks, runner = engine.config, engine.blocks, engine.runner
    drafts = [k for k in DRAFTS if k <= config.num_speculative_tokens]
    if len(drafts) < 2:
        return  # nothing to compare: the engine never drafts
    context = min(CONTEXT, config.max_model_len - max(drafts) - 1)
    batches = sorted({min(2**i, config.max_num_seqs) for i in range(config.max_num_seqs.bit_length() + 1)})
    seqs = [f"calibration-{i}" for i in range(batches[-1])]
    needed = context + max(drafts) + 1
    if any(not blocks.can_reserve(seq, needed * len(seqs)) for seq in seqs[:1]):
        return  # a cache too small to spare: learn online only
    tables = []
    for seq in seqs:
        blocks.reserve(seq, needed)
        tables.append(blocks.block_table(seq))
    try:
        history = [1 + i % (runner.vocab_size - 1) for i in range(context)]
        for table in tables:  # one sequence at a time: no large prefill buffer
            runner.forward([ForwardItem(table, 0, history, 0)])
        for batch in batches:
            for k in drafts:
                items = [ForwardItem(table, context, history[: k + 1], k + 1) for table in tables[:batch]]
                seconds = []
                for _ in range(REPS):
                    start = time.perf_counter()
                    runner.forward(items)
                    seconds.append(time.perf_counter() - start)
                engine.scheduler.policy.record_calibration(batch, batch * (k + 1), statistics.median(seconds[1:]))
    finally:
        for seq in seqs:
            blocks.free(seq)
