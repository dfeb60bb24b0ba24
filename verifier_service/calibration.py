"""The verifier's own scoring times, measured before it serves: the speculation policy (spec_policy.py) starts
from them instead of guessing, and keeps updating them from every decode step.

For each batch size (powers of two, and max_num_seqs) and number of draft tokens in all, from none to MAX_DRAFT
per sequence (at most the engine's k; where trees may be drafted, a whole tree a sequence up to batch TREE_BATCH),
the target scores them after a CONTEXT-token history, as a decode step does, spread evenly over the sequences;
the fastest of PASSES passes over all the shapes goes to the policy. The totals lie half a batch apart (every row
up to batch 2): the scoring time can rise in steps of a block of rows (bf16 products with AMX run 16 rows at a
time, shared/model/parallel.py: at batch 8 35-39 ms up to 16 rows, 59-67 ms from 18), and the policy sees where
a step ends only where it measured. It takes 4-6 seconds for the default target at max_num_seqs 8 on two CPU
cores (32 shapes; 16 before, when it measured 0, 1, 2 and 4 drafts a sequence), about half a second more where
trees of up to 8 nodes may be drafted (the verifier's warm-up 6.6 s against 6.1, fp32, 2026-12-06), on blocks
borrowed from the free KV cache and returned at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from shared.model.runner import ForwardItem

CONTEXT = 128  # tokens of history per sequence: a short chat turn
MAX_DRAFT = 4  # draft tokens per sequence measured at most; beyond, the policy extends the last measured slope
# Where trees may be drafted, batches up to this size are measured up to a whole tree a sequence: the slope the
# policy extends beyond its measured sizes is a line through its live times, and at one client (fp32 target,
# trees <= 8 nodes, 2026-12-06) plain steps timed in one of the host's fast minutes and chains in a slow one made
# it 1.0-1.6 ms a token, so a tree of 8 was expected to score in 33.4 ms against 24.9 for a chain of 4 (it took
# about 25-27), and in one gateway run the policy drafted 1 tree in 204 plans.
TREE_BATCH = 2
# Timed forwards per shape, one in each pass over all the shapes, and the fastest counts: a busy moment (the other
# services loading beside the warm-up on a shared host) slows the shapes timed in it, and timed back to back
# (their median) it put a false step in the shape the policy extends to live levels. At one client (fp32 target)
# three calibrations in one process put 9 rows at 1.32, 1.22 and 1.86 times one row this way, and in the verifier
# of one `step_phases` run a tree step was expected at 42-46 ms against 28 for a chain of 4: no tree was drafted
# in four runs, where a tree every step ran 10% faster. Two passes, the fastest: 1.27, 1.43 and 1.24.
PASSES = 2


def calibrate(engine) -> None:
    config, blocks, runner = engine.config, engine.blocks, engine.runner
    max_draft = min(MAX_DRAFT, config.num_speculative_tokens)
    if max_draft < 1:
        return  # nothing to compare: the engine never drafts
    max_tree = config.max_tree_nodes if config.num_speculative_tokens > 1 else 0
    most = max(max_draft, max_tree)
    context = min(CONTEXT, config.max_model_len - most - 1)
    batches = sorted({min(2**i, config.max_num_seqs) for i in range(config.max_num_seqs.bit_length() + 1)})
    seqs = [f"calibration-{i}" for i in range(batches[-1])]
    needed = context + most + 1
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
        fastest: dict[tuple[int, int], float] = {}
        for _ in range(PASSES):
            for batch, drafted, items in _shapes(batches, tables, history, context, most, max_draft):
                start = time.perf_counter()
                runner.forward(items)
                seconds = time.perf_counter() - start
                fastest[batch, drafted] = min(seconds, fastest.get((batch, drafted), seconds))
        for (batch, drafted), seconds in fastest.items():
            engine.scheduler.policy.record_calibration(batch, batch + drafted, seconds)
    finally:
        for seq in seqs:
            blocks.free(seq)


def _shapes(
    batches: list[int], tables: list, history: list[int], context: int, most: int, max_draft: int
) -> Iterator[tuple[int, int, list[ForwardItem]]]:
    """(batch, draft tokens in all, the step's items) for every shape measured, smallest first."""
    for batch in batches:
        per_seq_most = most if batch <= TREE_BATCH else max_draft
        for drafted in range(0, batch * per_seq_most + 1, max(1, batch // 2)):
            per_seq = [drafted // batch + (i < drafted % batch) for i in range(batch)]
            items = [
                ForwardItem(table, context, history[: k + 1], k + 1)
                for table, k in zip(tables[:batch], per_seq, strict=True)
            ]
            yield batch, drafted, items
