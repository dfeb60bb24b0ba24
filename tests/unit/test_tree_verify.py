"""Verification of token trees (verifier_service/tree_verify.py): hand-made greedy and seeded walks, the
randomness protocol, and seeded chi-square tests of the output law: the first two emitted tokens of a sampled
row follow the target's joint law with deterministic (top-k) siblings and with siblings drawn from a sparse draft
distribution, and two broken variants (a rejected sibling that does not update the residual) fail the same test."""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from shared.drafting import Draft, SparseProbs
from shared.sampling import SamplingParams
from shared.seeded import seeded_tokens
from verifier_service import tree_verify
from verifier_service.tree_verify import verify_tree

VOCAB = 5
SAMPLES = 20_000
ALPHA = 1e-4
SAMPLED = SamplingParams(temperature=1.0)


def one_hot(token: int) -> list[float]:
    return [1.0 if t == token else 0.0 for t in range(VOCAB)]


def rows(*distributions: list[float]) -> torch.Tensor:
    return torch.tensor(distributions, dtype=torch.float32)


def test_greedy_walks_down_the_argmax_and_emits_the_argmax_where_no_child_holds_it():
    # root argmax 2 -> node 1 (token 2); its argmax 4 -> node 3 (token 4); its argmax 0: no child holds it
    draft = Draft("s", 3, [1, 2, 3, 4, 0], parents=[-1, -1, 0, 1, 3])
    probs = rows(one_hot(2), one_hot(1), one_hot(4), one_hot(3), one_hot(0), one_hot(0))
    verdict = verify_tree(probs.log(), probs, draft, SamplingParams(), torch.Generator(), 0)
    assert (verdict.tokens, verdict.path) == ([2, 4, 0, 0], [1, 3, 4])
    # a root whose argmax no child holds: one token, no path
    probs[0] = torch.tensor(one_hot(3))
    verdict = verify_tree(probs.log(), probs, draft, SamplingParams(), torch.Generator(), 0)
    assert (verdict.tokens, verdict.path) == ([3], [])


def test_seeded_walks_down_the_seeded_tokens():
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(4, VOCAB, generator=gen), -1)  # root and 3 nodes
    seed, first = 77, 5
    root_token = int(seeded_tokens(probs[:1], seed, [first])[0])
    other = (root_token + 1) % VOCAB
    draft = Draft("s", 3, [other, root_token, 0], parents=[-1, -1, 1])  # node 1 holds the seeded token
    verdict = verify_tree(
        probs.log(), probs, draft, SamplingParams(temperature=1.0, seed=seed), torch.Generator(), first
    )
    second = int(seeded_tokens(probs[2:3], seed, [first + 1])[0])
    assert verdict.tokens[:2] == [root_token, second] and verdict.path[0] == 1
    assert verdict.path == ([1, 2] if second == 0 else [1])


def test_a_sampled_row_draws_exactly_one_uniform_per_node_plus_one():
    probs = torch.softmax(torch.randn(4, VOCAB), -1)
    draft = Draft("s", 3, [0, 1, 2], parents=[-1, -1, 0])
    gen, twin = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    verify_tree(probs.log(), probs, draft, SAMPLED, gen, 0)
    torch.rand(4, generator=twin, dtype=torch.float64)
    assert torch.equal(gen.get_state(), twin.get_state())


# ---- the output law ----------------------------------------------------------------------------


def toy_target(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first [vocab], second [vocab, vocab]): the target's next-token law at the root and after each token."""
    gen = torch.Generator().manual_seed(seed)
    first = torch.softmax(torch.randn(VOCAB, generator=gen) * 0.7, -1)
    second = torch.softmax(torch.randn(VOCAB, VOCAB, generator=gen) * 0.7, -1)
    return first, second


def deterministic_tree(rng: random.Random) -> Draft:
    """Top-k style guesses (fixed, as a drafter's top-k are given the context): three children of the root, two
    under the first, one under the second."""
    return Draft("s", 3, [3, 0, 1, 4, 2, 0], parents=[-1, -1, -1, 0, 0, 1])


def sampled_tree(rng: random.Random, draft_first: torch.Tensor, draft_second: torch.Tensor) -> Draft:
    """Siblings drawn independently from the draft's distribution at their parent: three under the root, two under
    the first of them; each node carries that distribution (sparse: its support)."""
    ids = list(range(VOCAB))

    def draw(probs: torch.Tensor) -> int:
        return rng.choices(ids, weights=probs.tolist())[0]

    root = [draw(draft_first) for _ in range(3)]
    below = [draw(draft_second[root[0]]) for _ in range(2)]
    rows_ = [draft_first] * 3 + [draft_second[root[0]]] * 2
    support = torch.tensor([ids] * 5)
    return Draft("s", 3, [*root, *below], SparseProbs(support, torch.stack(rows_)), parents=[-1, -1, -1, 0, 0])


def joint_counts(first, second, make_draft, seed: int) -> torch.Tensor:
    """[vocab, vocab] counts of the first two tokens: the tree row's, then (when the row emitted one token only)
    the target's own next token, as plain decoding would continue."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(SAMPLES):
        draft = make_draft(rng)
        target_rows = torch.stack([first, *(second[t] for t in draft.token_ids)])  # root, then node i's row
        tokens = verify_tree(target_rows.log(), target_rows, draft, SAMPLED, gen, 0).tokens
        a = tokens[0]
        b = tokens[1] if len(tokens) > 1 else rng.choices(range(VOCAB), weights=second[a].tolist())[0]
        counts[a, b] += 1
    return counts


def joint_pvalue(counts: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> float:
    expected = (first.unsqueeze(1) * second).double().flatten() * SAMPLES
    return float(chisquare(counts.flatten().double().numpy(), (expected * SAMPLES / expected.sum()).numpy()).pvalue)


def draft_law(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(VOCAB, generator=gen), -1), torch.softmax(
        torch.randn(VOCAB, VOCAB, generator=gen), -1
    )


@pytest.mark.parametrize("siblings", ["deterministic", "sampled"])
def test_the_first_two_tokens_follow_the_targets_law(siblings):
    first, second = toy_target(10)
    draft_first, draft_second = draft_law(11)
    if siblings == "deterministic":
        counts = joint_counts(first, second, deterministic_tree, seed=12)
    else:
        counts = joint_counts(first, second, lambda rng: sampled_tree(rng, draft_first, draft_second), seed=13)
    assert joint_pvalue(counts, first, second) > ALPHA


def _sample_without_residual(target_probs, draft, children, uniforms):
    """Broken on purpose: each sibling is tested against the target's own row, never against the residual that
    the rejected siblings before it left (the first sibling that passes its ratio test wins)."""
    node, tokens, path = -1, [], []
    while True:
        target = target_probs[node + 1].double()
        accepted = None
        for child in children[node + 1]:
            token = draft.token_ids[child]
            at_token = 1.0 if draft.probs is None else float(draft.probs.probs[child][token])
            if uniforms[child] * at_token < float(target[token]):
                accepted = child
                break
        if accepted is None:
            tokens.append(int(torch.multinomial(target.float(), 1)[0]))
            return tree_verify.TreeVerdict(tokens, path)
        tokens.append(draft.token_ids[accepted])
        path.append(accepted)
        node = accepted


@pytest.mark.parametrize("siblings", ["deterministic", "sampled"])
def test_negative_control_siblings_without_the_residual_update_fail(monkeypatch, siblings):
    monkeypatch.setattr(tree_verify, "_sample", _sample_without_residual)
    torch.manual_seed(0)
    first, second = toy_target(10)
    draft_first, draft_second = draft_law(11)
    if siblings == "deterministic":
        counts = joint_counts(first, second, deterministic_tree, seed=12)
    else:
        counts = joint_counts(first, second, lambda rng: sampled_tree(rng, draft_first, draft_second), seed=13)
    assert joint_pvalue(counts, first, second) < ALPHA
