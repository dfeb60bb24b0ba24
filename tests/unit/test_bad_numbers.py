"""No request's numbers can hurt another (issue 12): tiny temperatures decode greedily instead of turning
every probability into NaN, and a row whose logits go bad ends alone while the rest of its batch goes on
exactly as it would have."""

from __future__ import annotations

import pytest
import torch

from shared.errors import NumericalError, grpc_status_for
from shared.sampling import MIN_TEMPERATURE, SamplingParams, logits_to_probs, params_to_tensors
from tests.tiny import hf_greedy, tiny_target, tiny_target_hf  # noqa: F401 (fixtures)
from tests.unit.test_engine import engine_with, prompts
from verifier_service.sequence import FinishReason


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-8, MIN_TEMPERATURE / 2])
def test_a_tiny_temperature_is_greedy_not_nan(temperature):
    params = SamplingParams(temperature=temperature)
    params.validate()
    assert params.is_greedy and params.temperature == 0.0
    logits = torch.randn(3, 50) * 30
    probs = logits_to_probs(logits, **params_to_tensors([params] * 3))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and bool(torch.isfinite(probs).all())
    # Just above the floor the softmax is still finite (the floor is not arbitrary).
    sharp = SamplingParams(temperature=MIN_TEMPERATURE)
    assert not sharp.is_greedy
    assert bool(torch.isfinite(logits_to_probs(logits, **params_to_tensors([sharp] * 3))).all())


def test_tiny_temperature_rows_match_greedy_in_a_mixed_batch(target_hf, target):  # noqa: F811
    engine = engine_with(target, "same", k=3, max_num_seqs=4)
    ps = prompts(3, seed=4)
    for i, p in enumerate(ps):
        temperature = [1e-40, 0.0, 0.7][i]
        engine.add_request(f"r{i}", p, SamplingParams(temperature=temperature, seed=1, max_tokens=16, ignore_eos=True))
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.output_ids
    for i in (0, 1):
        assert outs[f"r{i}"] == hf_greedy(target_hf, ps[i], 16, eos=False)
    assert len(outs["r2"]) == 16


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("drafter", [None, "same"])
def test_a_row_with_bad_logits_ends_alone(target_hf, target, poison, drafter):  # noqa: F811
    engine = engine_with(target, drafter, k=3, max_num_seqs=4)
    ps = prompts(3, seed=5)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=20, ignore_eos=True))
    batches = []
    schedule, forward = engine.scheduler.schedule, engine.runner.forward

    def recording_schedule():
        batch = schedule()
        batches.append([s.seq.seq_id for s in batch])
        return batch

    def poisoned_forward(items):
        logits = list(forward(items))
        if engine.stats.steps == 3:  # a few tokens in: r1 has output to lose, the others keep going
            row = batches[-1].index("r1")
            logits[row] = logits[row].clone()
            logits[row][-1, 7] = poison
        return logits

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    engine.runner.forward = poisoned_forward  # type: ignore[method-assign]
    outs, failed = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.error is not None:
                failed[out.request_id] = out
            elif out.finished:
                outs[out.request_id] = out.output_ids
    assert set(failed) == {"r1"} and failed["r1"].finish_reason == FinishReason.ABORT
    assert "not finite" in (failed["r1"].error or "")
    for i in (0, 2):
        assert outs[f"r{i}"] == hf_greedy(target_hf, ps[i], 20, eos=False)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks  # the failed row's blocks are back
    code, message = grpc_status_for(NumericalError(failed["r1"].error))
    assert code.name == "INTERNAL" and message == failed["r1"].error
