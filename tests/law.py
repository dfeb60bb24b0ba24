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


def token_laws(
    target_hf, probs_of: Callable[[torch.Tensor], torch.Tensor], vocab: int, num: int, prompt: list[int]
) -> list[torch.Tensor]:
    """The laws of output tokens 1..num after `prompt`, each marginal over the tokens before it (vocab^(num-1)
    contexts: for a small vocabulary)."""
    laws, paths = [], torch.ones(1)  # paths: the probability of every context of the current length
    contexts = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(num):
            next_probs = torch.cat([probs_of(target_hf(c).logits[:, -1].float()) for c in contexts.split(4096)])
            joint = paths[:, None] * next_probs  # [contexts, vocab]
            laws.append(joint.sum(0))
            paths = joint.reshape(-1)
            extend = torch.arange(vocab).repeat(len(contexts))[:, None]  # every context, then every next token
            contexts = torch.cat([contexts.repeat_interleave(vocab, 0), extend], 1)
    return laws


def first_two_token_counts(
    engine, n: int, params_for: Callable[[int], object], vocab: int, num: int = 2, prompt: list[int] = LAW_PROMPT
) -> torch.Tensor:
    """Run n requests on `prompt` (request i with params_for(i)); [num, vocab] counts of output tokens 1..num."""
    for i in range(n):
        engine.add_request(f"s{i}", prompt, params_for(i))
    counts = torch.zeros(num, vocab)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                for position in range(num):
                    counts[position, out.output_ids[position]] += 1
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
