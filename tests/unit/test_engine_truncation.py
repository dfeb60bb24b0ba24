"""Production sampling settings through the engine: greedy ignores top-p / top-k, and sampling with top-p or
top-k through speculative decoding (sampled, truncated drafts) follows transformers' truncated law."""

from __future__ import annotations

import pytest

from shared.sampling import SamplingParams
from tests.law import first_two_token_counts, law_pvalue, two_token_law
from tests.tiny import hf_greedy, tiny_target, tiny_target_hf, tiny_weak_draft  # noqa: F401 (fixtures)
from tests.unit.test_engine import VOCAB, engine_with, prompts, run
from tests.unit.test_sampling import transformers_probs


def test_greedy_ignores_top_p_and_top_k(target_hf, target, weak_draft):  # noqa: F811
    engine = engine_with(target, weak_draft, k=3, max_num_seqs=4)
    ps = prompts(4, seed=7)
    outs = run(engine, ps, SamplingParams(top_p=0.9, top_k=40, max_tokens=20, ignore_eos=True))
    for i, p in enumerate(ps):
        assert outs[f"r{i}"] == hf_greedy(target_hf, p, 20, eos=False), f"prompt {i}"


@pytest.mark.parametrize("truncation", [{"top_p": 0.9}, {"top_k": 20}])
def test_sampled_law_with_top_p_or_top_k(target_hf, target, weak_draft, truncation):  # noqa: F811
    """The first two emitted tokens' marginals against the exact law built with transformers' warpers; the
    second token comes from a speculative step with sampled drafts from the draft's top 8 tokens."""
    params = SamplingParams(temperature=1.5, max_tokens=4, ignore_eos=True, **truncation)
    first, second = two_token_law(target_hf, lambda logits: transformers_probs(logits, params), VOCAB)
    engine = engine_with(target, weak_draft, k=3, max_num_seqs=64, max_waiting=5000, max_model_len=16)
    engine.drafter.top_n = 8
    n = 3000
    counts = first_two_token_counts(engine, n, lambda i: params, VOCAB)
    for observed, law in ((counts[0], first), (counts[1], second)):
        assert law_pvalue(observed, law, n) > 1e-4  # and no token the truncation removes
    # The truncation really removed tokens, and drafts were both accepted and rejected.
    assert int((first == 0).sum()) > 0
    assert 0 < engine.stats.accepted_tokens < engine.stats.drafted_tokens
