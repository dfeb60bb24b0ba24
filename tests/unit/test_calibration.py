"""Warm-up calibration (verifier_service/calibration.py): the policy starts from the verifier's own scoring times
at every batch size and draft length, and the blocks it borrowed are all returned."""

from __future__ import annotations

import time

import pytest

from shared.model.build import CacheConfig
from specdec_local.builder import build_engine
from tests.tiny import ours, tiny_hf_model
from verifier_service import calibration
from verifier_service.engine import EngineConfig


def test_warm_up_measures_scoring_times_per_batch_size_and_number_of_draft_tokens():
    target = ours(tiny_hf_model(seed=1))
    config = EngineConfig(num_speculative_tokens=4, max_num_seqs=6, max_model_len=256)
    engine = build_engine(target, "ngram", config, CacheConfig(block_size=8))
    engine.warm_up()
    scoring = engine.scheduler.policy.scoring
    for batch in (1, 2, 4, 6):  # every total of draft tokens up to 4 a sequence, half a batch apart
        assert set(scoring.calibrated[batch]) == set(range(batch, 5 * batch + 1, max(1, batch // 2)))
        assert scoring.has_slope(batch) and scoring.estimate(batch, batch) > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert engine.stats.steps == 0  # the counters start from zero after the warm-up


def test_where_trees_may_be_drafted_small_batches_are_measured_up_to_a_whole_tree():
    """Beyond its measured sizes the policy extends a slope fitted to live times, which a host's fast and slow
    minutes can make several times too steep: a tree's size is measured where trees are drafted most."""
    target = ours(tiny_hf_model(seed=1))
    config = EngineConfig(num_speculative_tokens=4, max_tree_nodes=8, max_num_seqs=4, max_model_len=256)
    engine = build_engine(target, "ngram", config, CacheConfig(block_size=8))
    engine.warm_up()
    scoring = engine.scheduler.policy.scoring
    assert set(scoring.calibrated[1]) == set(range(1, 10))  # up to a tree of 8 beside the sequence's own token
    assert set(scoring.calibrated[2]) == set(range(2, 19))
    assert set(scoring.calibrated[4]) == set(range(4, 21, 2))  # larger batches: up to 4 drafts a sequence, as before
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize("passes", [1, 2])
def test_a_busy_moment_during_the_warm_up_does_not_set_the_shape(monkeypatch, passes):
    """Each shape is timed once in each pass over all of them and the fastest counts: a busy moment slows the shapes
    timed in it, and a false step in the shape kept trees from being drafted at one client. With one pass (the
    negative control) the slowed shapes keep the busy moment's time."""
    monkeypatch.setattr(calibration, "PASSES", passes)
    target = ours(tiny_hf_model(seed=1))
    config = EngineConfig(num_speculative_tokens=4, max_tree_nodes=8, max_num_seqs=2, max_model_len=256)
    engine = build_engine(target, "ngram", config, CacheConfig(block_size=8))
    forward, calls = engine.runner.forward, []

    def busy_at_first(items):
        calls.append(len(items))
        if config.max_num_seqs < len(calls) <= config.max_num_seqs + 5:  # batch 1, 0-4 drafts, in the first pass
            time.sleep(0.05)
        return forward(items)

    engine.runner.forward = busy_at_first
    calibration.calibrate(engine)
    slowed = [engine.scheduler.policy.scoring.calibrated[1][q] for q in range(1, 6)]
    if passes == 1:
        assert min(slowed) >= 0.05, slowed
    else:
        assert max(slowed) < 0.05, slowed
