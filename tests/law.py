"""The sampling-law check the engine tests share: the first two emitted tokens of many requests on one prompt,
counted, against the exact law computed from transformers' logits (chi-square, small expectations pooled)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from scipy.stats import chisquare

LAW_PROMPT = [5, 17, 33]


def two_token_law(target_hf, probs_of: Callable[[torch.Tensor], torch.Tensor], vocab: int):
    """(first, second): the laws of output tokens 1 and 2 after LAW_PROMPT; `probs_of` maps logits
    [rows, vocab] to the request's sampling probabilities (temperature, truncation)."""
    with torch.no_grad():
        first = probs_of(target_hf(torch.tensor([LAW_PROMPT])).logits[0, -1:].float())[0]
        ctx = torch.tensor([LAW_PROMPT + [t] for t in range(vocab)])
        second_given = probs_of(target_hf(ctx).logits[:, -1].float())  # [first, vocab]
    return first, first @ second_given


def first_two_token_counts(engine, n: int, params_for: Callable[[int], object], vocab: int) -> torch.Tensor:
    """Run n requests on LAW_PROMPT (request i with params_for(i)); [2, vocab] counts of output tokens 1 and 2."""
    for i in range(n):
        engine.add_request(f"s{i}", LAW_PROMPT, params_for(i))
    counts = torch.zeros(2, vocab)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                counts[0, out.output_ids[0]] += 1
                counts[1, out.output_ids[1]] += 1
    return counts


def law_pvalue(observed: torch.Tensor, law: torch.Tensor, n: int) -> float:
    """Chi-square p-value of observed counts against n draws from `law`; a token the law excludes must
    never appear."""
    assert float(observed[law == 0].sum()) == 0, "emitted a token the law gives probability 0"
    expected = law.double() * n
    keep = expected >= 5  # chi-square needs expected counts >= 5; pool the rest
    obs = torch.cat([observed[keep], observed[~keep].sum(0, keepdim=True)]).double()
    exp = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
    nonempty = exp > 0  # the pooled bucket is empty when truncation removed every small token
    assert float(obs[~nonempty].sum()) == 0
    obs, exp = obs[nonempty], exp[nonempty]
    exp = exp * obs.sum() / exp.sum()  # the fp32 law sums to 1 only within rounding
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


class WrongDraftLaw:
    """A drafter wrapper for negative controls: every draft is reported uniform over its listed ids, whatever
    distribution it was sampled from."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, requests):
        drafts = self.inner.propose(requests)
        for draft in drafts:
            if draft.probs is not None:
                listed = (draft.probs.probs > 0).float()
                draft.probs.probs.copy_(listed / listed.sum(-1, keepdim=True))
        return drafts
