"""The verifier's warm-up batch leaves nothing behind and changes no output."""

from __future__ import annotations

from shared.sampling import SamplingParams
from tests.tiny import hf_greedy, tiny_target, tiny_target_hf, tiny_weak_draft  # noqa: F401 (fixtures)
from tests.unit.test_engine import engine_with, prompts, run


def test_warm_up_leaves_no_request_no_block_no_count_and_the_same_output(target_hf, target, weak_draft):  # noqa: F811
    engine = engine_with(target, weak_draft, k=3, max_num_seqs=4, max_num_batched_tokens=64)
    engine.warm_up()
    assert not engine.seqs and not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert engine.stats.steps == 0 and engine.stats.drafted_tokens == 0
    assert engine.scheduler.prefix_cache.query_tokens == 0
    ps = prompts(4, seed=21)
    outs = run(engine, ps, SamplingParams(max_tokens=16, ignore_eos=True))
    for i, p in enumerate(ps):
        assert outs[f"r{i}"] == hf_greedy(target_hf, p, 16, eos=False)
    assert engine.stats.drafted_tokens > 0


def test_warm_up_fills_every_slot_with_a_full_prefill(target, weak_draft):  # noqa: F811
    engine = engine_with(target, weak_draft, k=2, max_num_seqs=4, max_num_batched_tokens=64)
    batches = []
    step = engine.step
    engine.step = lambda: (batches.append(len(engine.scheduler.running)), step())[1]
    engine.warm_up()
    assert max(batches) == 4
