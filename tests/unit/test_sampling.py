"""Tests of SamplingParams and logits_to_probs: hand-made cases and transformers' warpers as reference."""

from __future__ import annotations

import math
from typing import cast

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from shared.sampling import SamplingParams, logits_to_probs, params_to_tensors

torch.set_num_threads(2)


def probs_for(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    return logits_to_probs(logits, **params_to_tensors(params))


def log_probs(values: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(v) for v in values]])


def test_greedy_rows_are_one_hot_of_first_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [-1.0, -2.0, -1.0, -5.0], [0.0, 0.0, 0.0, 7.0]])
    probs = probs_for(logits, [SamplingParams(temperature=0.0, top_k=2, top_p=0.5, min_p=0.3)] * 3)
    expected = torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    assert torch.equal(probs, expected)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_temperature_scaling_is_softmax_of_scaled_logits(temperature):
    logits = torch.randn(5, 33, generator=torch.Generator().manual_seed(0)) * 3
    probs = probs_for(logits, [SamplingParams(temperature=temperature)] * 5)
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, dim=-1))
    assert probs.dtype == torch.float32


def test_half_precision_logits_give_fp32_probs():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(1)).half()
    probs = probs_for(logits, [SamplingParams(temperature=1.0)] * 3)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(logits.float(), dim=-1))


@pytest.mark.parametrize("top_k", [1, 3, 7, 40, 100])
def test_top_k_keeps_exactly_the_k_largest(top_k):
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(top_k))
    probs = probs_for(logits, [SamplingParams(temperature=1.0, top_k=top_k)] * 4)
    kept = min(top_k, 40)
    assert (probs > 0).sum(-1).tolist() == [kept] * 4
    top = logits.topk(kept, dim=-1).indices
    assert (probs.gather(-1, top) > 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.4, [0]), (0.5, [0]), (0.75, [0, 1]), (0.85, [0, 1, 2]), (0.99, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])],
)
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, kept):
    # Sorted probabilities 0.5, 0.3, 0.15, 0.05 (shuffled in the vocabulary).
    order = [2, 0, 3, 1]  # token order[r] has rank r
    values = [0.0] * 4
    for rank, mass in enumerate([0.5, 0.3, 0.15, 0.05]):
        values[order[rank]] = mass
    probs = probs_for(log_probs(values), [SamplingParams(temperature=1.0, top_p=top_p)])[0]
    kept_tokens = sorted(order[r] for r in kept)
    assert torch.nonzero(probs).flatten().tolist() == kept_tokens
    expected = torch.zeros(4)
    expected[kept_tokens] = torch.tensor(values)[kept_tokens]
    torch.testing.assert_close(probs, expected / expected.sum())


@pytest.mark.parametrize(("min_p", "kept"), [(0.0, 4), (0.05, 4), (0.2, 3), (0.5, 2), (0.7, 1), (1.0, 1)])
def test_min_p_drops_tokens_below_min_p_times_the_top_probability(min_p, kept):
    values = [0.5, 0.3, 0.15, 0.05]
    probs = probs_for(log_probs(values), [SamplingParams(temperature=1.0, min_p=min_p)])[0]
    expected = torch.tensor(values[:kept] + [0.0] * (4 - kept))
    torch.testing.assert_close(probs, expected / expected.sum())


def test_top_k_then_top_p_then_min_p_compose():
    # top_k = 3 leaves 0.5, 0.3, 0.15 -> renormalised 0.526, 0.316, 0.158; top_p = 0.8 keeps the first
    # two (0.526 < 0.8 <= 0.842); min_p = 0.7 then needs >= 0.7 * top and keeps only the first.
    logits = log_probs([0.5, 0.3, 0.15, 0.05])
    two = probs_for(logits, [SamplingParams(temperature=1.0, top_k=3, top_p=0.8)])[0]
    torch.testing.assert_close(two, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    one = probs_for(logits, [SamplingParams(temperature=1.0, top_k=3, top_p=0.8, min_p=0.7)])[0]
    torch.testing.assert_close(one, torch.tensor([1.0, 0.0, 0.0, 0.0]))


MIXED_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.5, top_k=20, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=2.0, top_p=1.0),
    SamplingParams(temperature=1.0, top_k=1),
]


@pytest.mark.parametrize("scale", [1.0, 10.0])
def test_mixed_per_row_params_in_one_batch_equal_per_row_calls(scale):
    # Large logits put many tokens below fp32 resolution next to the top one: a batch-level code
    # path (truncation runs because some row truncates) must not change the untruncated rows.
    logits = torch.randn(len(MIXED_PARAMS), 2000, generator=torch.Generator().manual_seed(3)) * scale
    batched = probs_for(logits, MIXED_PARAMS)
    for i, params in enumerate(MIXED_PARAMS):
        alone = probs_for(logits[i : i + 1], [params])[0]
        assert torch.equal(batched[i] > 0, alone > 0), params
        torch.testing.assert_close(batched[i], alone, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(batched.sum(-1), torch.ones(len(MIXED_PARAMS)))


def test_untruncated_rows_keep_their_whole_support_in_a_truncating_batch():
    logits = torch.randn(2, 32000, generator=torch.Generator().manual_seed(4)) * 5
    probs = probs_for(logits, [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0)])
    plain = torch.softmax(logits[1], dim=-1)
    assert torch.equal(probs[1] > 0, plain > 0)
    torch.testing.assert_close(probs[1], plain)


def transformers_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The reference: transformers' warpers in its own order (temperature, top-k, top-p, min-p)."""
    scores = logits.clone()
    input_ids = cast(torch.LongTensor, torch.zeros(logits.shape[0], 1, dtype=torch.int64))
    scores = TemperatureLogitsWarper(params.temperature)(input_ids, scores)
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(input_ids, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(input_ids, scores)
    if params.min_p > 0.0:
        scores = MinPLogitsWarper(params.min_p)(input_ids, scores)
    return torch.softmax(scores, dim=-1)


REFERENCE_PARAMS = [
    SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
    for t in (0.6, 1.0, 1.5)
    for k in (0, 1, 10)
    for p in (1.0, 0.9, 0.5)
    for m in (0.0, 0.05, 0.3)
]


@pytest.mark.parametrize("vocab", [50, 1000])
def test_matches_transformers_logits_warpers(vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = 16
    logits = torch.randn(len(REFERENCE_PARAMS) * rows, vocab, generator=gen) * 2
    batched = probs_for(logits, [p for p in REFERENCE_PARAMS for _ in range(rows)])
    for i, params in enumerate(REFERENCE_PARAMS):
        block = slice(i * rows, (i + 1) * rows)
        expected = transformers_probs(logits[block], params)
        assert torch.equal(batched[block] > 0, expected > 0), params
        torch.testing.assert_close(batched[block], expected, rtol=1e-5, atol=1e-7)


def test_rows_are_distributions():
    logits = torch.randn(len(REFERENCE_PARAMS), 300, generator=torch.Generator().manual_seed(5)) * 4
    probs = probs_for(logits, REFERENCE_PARAMS)
    assert (probs >= 0).all()
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(REFERENCE_PARAMS)))


def test_params_to_tensors_layout():
    tensors = params_to_tensors([SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1), SamplingParams()])
    assert tensors["temperature"].tolist() == pytest.approx([0.5, 0.0])
    assert tensors["top_k"].tolist() == [3, 0]
    assert tensors["top_k"].dtype == torch.int64
    assert tensors["top_p"].tolist() == pytest.approx([0.9, 1.0])
    assert tensors["min_p"].tolist() == pytest.approx([0.1, 0.0])


def test_is_greedy():
    assert SamplingParams().is_greedy
    assert not SamplingParams(temperature=0.8).is_greedy


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(min_p=-0.1), "min_p"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(max_tokens=0), "max_tokens"),
    ],
)
def test_validate_rejects_bad_parameters(params, message):
    with pytest.raises(ValueError, match=message):
        params.validate()


def test_validate_checks_stop_ids_against_the_vocabulary():
    SamplingParams(stop_token_ids=(0, 9)).validate(vocab_size=10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(3, 10)).validate(vocab_size=10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(-1,)).validate(vocab_size=10)


def test_validate_accepts_good_parameters():
    SamplingParams().validate(vocab_size=100)
    SamplingParams(temperature=0.7, top_k=50, top_p=0.95, min_p=0.05, seed=3, max_tokens=1).validate()
