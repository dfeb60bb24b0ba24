"""The suffix drafter inside the engine, tiny random-weight target: greedy output equals transformers' whatever
the drafts (own text, earlier answers), and sampled output follows the target's law (chi-square), with a
negative control that claims a wrong law for the same drafts and must fail."""

from __future__ import annotations

import random

import pytest
import torch

from proposer_service.suffix import GLOBAL, SuffixDrafter
from shared.drafting import SparseProbs
from shared.sampling import SamplingParams
from tests.law import first_two_token_counts, law_pvalue, two_token_law
from tests.tiny import hf_greedy, tiny_target, tiny_target_hf  # noqa: F401 (fixtures)
from tests.unit.test_engine import EOS, VOCAB
from tests.unit.test_engine import engine_with as engine_of
from verifier_service.engine import Engine


def engine_with(model, drafter, k: int, max_num_seqs: int = 4, **kw) -> Engine:
    return engine_of(model, drafter, k=k, max_num_seqs=max_num_seqs, max_model_len=160, **kw)


def run(
    engine: Engine, prompts: dict[str, list[int]], params: SamplingParams, tenant: str = ""
) -> dict[str, list[int]]:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params, tenant=tenant)
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.output_ids
    return outs


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    motif = [rng.randrange(1, EOS) for _ in range(6)]
    return [
        motif * 4,  # its own text repeats: drafted from the request's tree
        [rng.randrange(1, EOS) for _ in range(20)],
        [rng.randrange(1, EOS) for _ in range(5)] + motif * 2,
        [7, 7, 7, 7, 7],
    ]


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_output_equals_transformers_and_a_repeat_is_drafted_from_the_first_answer(target_hf, target, k):  # noqa: F811
    drafter = SuffixDrafter()
    engine = engine_with(target, drafter, k)
    ps = prompts(k)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    first = run(engine, {f"a{i}": p for i, p in enumerate(ps)}, params, tenant="acme")
    references = [hf_greedy(target_hf, p, 40, eos=False) for p in ps]
    assert [first[f"a{i}"] for i in range(len(ps))] == references
    assert engine.stats.drafted_tokens > 0
    drafted, accepted = engine.stats.drafted_tokens, engine.stats.accepted_tokens
    from_global = drafter.stats.draft_tokens[GLOBAL]
    # The same prompts again, other request ids (other sessions): their answers are in the global tree.
    again = run(engine, {f"b{i}": p for i, p in enumerate(ps)}, params, tenant="acme")
    assert [again[f"b{i}"] for i in range(len(ps))] == references
    # Most of the repeat is drafted from the first answers, and drafts are accepted far more than the first time
    # (not always: a prompt that repeats itself can out-score the earlier answer with its own text).
    assert drafter.stats.draft_tokens[GLOBAL] - from_global >= 0.8 * len(ps) * 40 * k / (k + 1)
    assert engine.stats.accepted_tokens - accepted >= 0.85 * (engine.stats.drafted_tokens - drafted)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and not drafter.requests


class _ClaimsAWrongLaw(SuffixDrafter):
    """The suffix drafter's drafts, claimed to come from a distribution that puts 0.1 on the drafted token and
    0.9 on another: the verifier then accepts the drafted token too often (min(1, target / 0.1)): a wrong law."""

    def propose(self, requests):
        drafts = super().propose(requests)
        for d in drafts:
            if d.token_ids:
                ids = torch.tensor([[t, (t + 1) % VOCAB] for t in d.token_ids])
                probs = torch.tensor([[0.1, 0.9]]).expand(len(d.token_ids), 2)
                object.__setattr__(d, "probs", SparseProbs(ids, probs))
        return drafts


def _law_pvalues(target_hf, target, drafter, n=3000):  # noqa: F811
    temperature = 1.5
    first, second = two_token_law(target_hf, lambda logits: torch.softmax(logits / temperature, -1), VOCAB)
    engine = engine_with(target, drafter, k=3, max_num_seqs=64, max_waiting=5000)
    params = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True)
    counts = first_two_token_counts(engine, n, lambda i: params, VOCAB)
    return [law_pvalue(counts[0], first, n), law_pvalue(counts[1], second, n)], engine


def test_sampled_output_law_matches_the_target_and_a_wrong_claimed_law_is_caught(target_hf, target):  # noqa: F811
    """Every request has the same prompt, so earlier answers in the global tree draft the first and second tokens
    of later ones (min_token_prob 0: always draft what was most frequent). One-hot drafts verified by rejection
    sampling keep the target's law exactly; the same drafts with a wrong claimed law must fail the test."""
    pvalues, engine = _law_pvalues(target_hf, target, SuffixDrafter(min_token_prob=0.0))
    assert min(pvalues) > 1e-4, pvalues
    assert 0 < engine.stats.accepted_tokens < engine.stats.drafted_tokens  # both paths were exercised
    lying, _ = _law_pvalues(target_hf, target, _ClaimsAWrongLaw(min_token_prob=0.0))
    assert min(lying) < 1e-6, lying


def branching_prompts(seed: int) -> list[list[int]]:
    """Prompts whose end was followed by several different tokens before: a tree on the first step already."""
    rng = random.Random(seed)
    motif = [rng.randrange(1, EOS) for _ in range(3)]
    ends = [[rng.randrange(1, EOS) for _ in range(3)] for _ in range(3)]
    return [motif + ends[i % 3] + motif + ends[(i + 1) % 3] + motif + ends[i % 3] + motif for i in range(4)]


@pytest.mark.parametrize("k", [3, 6])
def test_greedy_output_equals_transformers_with_suffix_token_trees(target_hf, target, k):  # noqa: F811
    """The verifier takes trees (max_tree_nodes > k): the drafter sends trees where the text branched, and the
    output is still the target's greedy output, first and repeated answers."""
    drafter = SuffixDrafter(min_token_prob=0.0)  # every continuation seen is worth a node
    engine = engine_with(target, drafter, k, max_tree_nodes=k + 4)
    ps = branching_prompts(k) + prompts(k)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    references = [hf_greedy(target_hf, p, 30, eos=False) for p in ps]
    for round_ in ("a", "b"):  # the second round drafts from the first's answers too
        outs = run(engine, {f"{round_}{i}": p for i, p in enumerate(ps)}, params, tenant="acme")
        assert [outs[f"{round_}{i}"] for i in range(len(ps))] == references
    assert drafter.stats.tree_drafts >= 10, drafter.stats
    assert engine.stats.accepted_tokens > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and not drafter.requests
