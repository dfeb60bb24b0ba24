"""Production sampling settings through the engine: greedy ignores top-p / top-k, and sampling with top-p or
top-k through speculative decoding (sampled, truncated drafts) follows transformers' truncated law."""

from __future__ import annotations

import pytest
import torch

from shared.sampling import SamplingParams
from tests.tiny import hf_greedy
from tests.unit.test_engine import VOCAB, engine_with, prompts, run, target, target_hf, weak_draft  # noqa: F401
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
    from scipy.stats import chisquare

    prompt = [5, 17, 33]
    params = SamplingParams(temperature=1.5, max_tokens=4, ignore_eos=True, **truncation)
    with torch.no_grad():
        first = transformers_probs(target_hf(torch.tensor([prompt])).logits[0, -1:].float(), params)[0]
        ctx = torch.tensor([prompt + [t] for t in range(VOCAB)])
        second_given = transformers_probs(target_hf(ctx).logits[:, -1].float(), params)  # [first, vocab]
    second = first @ second_given
    engine = engine_with(target, weak_draft, k=3, max_num_seqs=64, max_waiting=5000, max_model_len=16)
    engine.drafter.top_n = 8
    n = 3000
    for i in range(n):
        engine.add_request(f"s{i}", prompt, params)
    counts = torch.zeros(2, VOCAB)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                counts[0, out.output_ids[0]] += 1
                counts[1, out.output_ids[1]] += 1
    for observed, law in ((counts[0], first), (counts[1], second)):
        assert float(observed[law == 0].sum()) == 0, "emitted a token the truncation removes"
        expected = law.double() * n
        keep = expected >= 5
        obs = torch.cat([observed[keep], observed[~keep].sum(0, keepdim=True)]).double()
        exp = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
        nonempty = exp > 0  # the pooled bucket is empty when truncation removed every small token
        assert float(obs[~nonempty].sum()) == 0
        obs, exp = obs[nonempty], exp[nonempty]
        exp = exp * obs.sum() / exp.sum()
        assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-4
    # The truncation really removed tokens, and drafts were both accepted and rejected.
    assert int((first == 0).sum()) > 0
    assert 0 < engine.stats.accepted_tokens < engine.stats.drafted_tokens
