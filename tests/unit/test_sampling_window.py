"""logits_to_probs (partial top-k window, full sort only as a fallback, per-row routing) equals a plain
full-sort reference, property-based: every combination of temperature, top-k, top-p and min-p, ties, and
nuclei wider than the window (the window is shrunk so small vocabularies cross it)."""

from __future__ import annotations

from unittest import mock

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shared.sampling
from shared.sampling import SamplingParams, logits_to_probs, params_to_tensors

torch.set_num_threads(1)


def full_sort_reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:  # [vocab] -> [vocab]
    """One row, the whole vocabulary sorted, each rule applied token by token in sorted order."""
    vocab = logits.shape[0]
    if params.temperature == 0:
        return torch.zeros(vocab).scatter_(0, logits.argmax().view(1), 1.0)
    scaled = logits.float() / torch.tensor(params.temperature, dtype=torch.float32)
    if params.top_k == 0 and params.top_p == 1 and params.min_p == 0:
        return torch.softmax(scaled, dim=-1)
    values, order = scaled.sort(descending=True)  # [vocab]
    kth = values[min(params.top_k, vocab) - 1] if 0 < params.top_k < vocab else torch.tensor(float("-inf"))
    if 0 < params.top_k < vocab:  # top-k survivors, normalised by their sorted running sum
        unnormalised = torch.exp(values - values[0]).masked_fill(values < kth, 0.0)
        probs = unnormalised / unnormalised.cumsum(0)[-1]
    else:  # no top-k: the whole row's softmax
        probs = torch.softmax(scaled, dim=-1)[order]
    running = (probs.cumsum(0) - probs).cummax(0).values  # mass strictly before each sorted slot
    # The parameters as the engine holds them (and as the wire carries them): float32. 0.9999999999999999 is
    # 1.0 there, top-p off, while as a Python float it would still cut a token of mass 2.5e-8.
    top_p = float(torch.tensor(params.top_p, dtype=torch.float32))
    cutoff = values[0]
    group_mass = running[0]
    for i in range(vocab):
        if i > 0 and values[i] != values[i - 1]:
            group_mass = running[i]  # ties: the mass before the group's first member
        removed = bool(values[i] < kth)
        removed |= top_p < 1 and bool(group_mass >= top_p)
        removed |= bool(probs[i] < params.min_p * probs[0])
        if removed and i > 0:
            break
        cutoff = values[i]
    return torch.softmax(scaled.masked_fill(scaled < cutoff, float("-inf")), dim=-1)


TIE_VALUES = [-4.0, -1.0, 0.0, 0.25, 1.0, 3.0]
logit_value = st.one_of(st.sampled_from(TIE_VALUES), st.floats(-12, 12, allow_nan=False, width=32))
params_strategy = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.just(1.0), st.floats(0.05, 3.0)),
    top_k=st.one_of(st.just(0), st.integers(1, 40)),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0, exclude_min=False)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
)


@st.composite
def batches(draw):
    vocab = draw(st.integers(2, 48))
    rows = draw(st.integers(1, 5))
    logits = [draw(st.lists(logit_value, min_size=vocab, max_size=vocab)) for _ in range(rows)]
    params = [draw(params_strategy) for _ in range(rows)]
    window = draw(st.integers(2, 12))
    return torch.tensor(logits, dtype=torch.float32), params, window


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_windowed_logits_to_probs_equals_the_full_sort_reference(batch):
    logits, params, window = batch
    with mock.patch.object(shared.sampling, "TRUNCATION_WINDOW", window):
        probs = logits_to_probs(logits, **params_to_tensors(params))
    for row, row_params, got in zip(logits, params, probs, strict=True):
        want = full_sort_reference(row, row_params)
        assert torch.equal(got > 0, want > 0), (row.tolist(), row_params, window)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


def test_a_top_p_that_is_1_in_float32_keeps_every_token():
    """Found by the property test: top_p = 0.9999999999999999 is 1.0 as the engine holds it (float32, as on
    the wire), so nothing is cut, not even a token of mass 2.5e-8."""
    logits = torch.tensor([[-4.0] * 29 + [10.5, -7.0]])
    params = [SamplingParams(temperature=1.0, top_p=0.9999999999999999)]
    probs = logits_to_probs(logits, **params_to_tensors(params))
    assert bool((probs > 0).all())
    torch.testing.assert_close(probs[0], full_sort_reference(logits[0], params[0]), rtol=1e-6, atol=1e-9)


def test_a_nucleus_wider_than_the_window_falls_back_to_the_whole_row():
    # Flat logits: top_p = 0.9 of 1,000 near-equal tokens keeps ~900, far past a 256-token window.
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)) * 0.01
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.7, top_k=5), SamplingParams()]
    probs = logits_to_probs(logits, **params_to_tensors(params))
    kept = (probs > 0).sum(-1).tolist()
    assert 850 < kept[0] < 950 and kept[1] == 5 and kept[2] == 1
    for row, row_params, got in zip(logits, params, probs, strict=True):
        torch.testing.assert_close(got, full_sort_reference(row, row_params), rtol=1e-6, atol=1e-9)


def test_ties_at_the_top_k_boundary_are_kept_together():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    probs = logits_to_probs(logits, **params_to_tensors([SamplingParams(temperature=1.0, top_k=2)]))[0]
    assert (probs > 0).tolist() == [True, False, True, True, True, False]


def test_top_k_ties_past_the_window_reopen_the_row():
    # top_k = 2 keeps all 25 tokens tied at the 2nd value; the 3-wide window holds only 2 of them, so its
    # top-p mass would be wrong: the row must be decided over a wider window (everything is kept here).
    logits = torch.tensor([[-4.0] * 25 + [-1.0]])
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.5)
    probs = logits_to_probs(logits, **params_to_tensors([params]))[0]
    assert bool((probs > 0).all())
    torch.testing.assert_close(probs, full_sort_reference(logits[0], params), rtol=1e-6, atol=1e-9)
