"""Token trees as the drafter grows them (proposer_service/draft_tree.py), on a fake drafter whose logits depend
only on a node's path: a beam node is fed to the drafter only where one of its children could be kept, and
skipping the others sends exactly the tree that feeding every beam node sends."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

import proposer_service.draft_tree as draft_tree
from shared.drafting import DraftRequest
from shared.sampling import SamplingParams

VOCAB = 12


class PathDrafter:
    """Logits per node from a seed made of its path (the tokens under the root): the same node gets the same
    children whatever else was fed before it. Counts head forwards (one per depth with anything fed)."""

    def __init__(self, width: int, beam: int, peak: float) -> None:
        self.tree_width, self.tree_beam, self.peak = width, beam, peak
        self.paths: dict[tuple[int, int], tuple[int, ...]] = {}  # (row, expansion index) -> its path
        self.forwards = 0
        self.fed = 0

    def _logits(self, row: int, path: tuple[int, ...]) -> torch.Tensor:  # [VOCAB]
        gen = torch.Generator().manual_seed(hash((row, path)) % (1 << 31))
        return torch.randn(VOCAB, generator=gen) * self.peak

    def _root_logits(self, reqs, rows) -> torch.Tensor:  # [rows, VOCAB]
        self.paths = {}
        return torch.stack([self._logits(row, ()) for row in rows])

    def _expand_logits(self, reqs, expansions) -> torch.Tensor:  # [expansions, VOCAB]
        self.forwards += 1
        self.fed += len(expansions)
        rows = []
        for e in expansions:
            above = self.paths[(e.row, e.parent)] if e.parent >= 0 else ()
            self.paths[(e.row, e.index)] = (*above, e.token)
            rows.append(self._logits(e.row, self.paths[(e.row, e.index)]))
        return torch.stack(rows)

    def _token(self, index: int) -> int:
        return index


def grown(drafter: PathDrafter, reqs: list[DraftRequest]) -> list[tuple[list[int], list[int] | None]]:
    return [(d.token_ids, d.parents) for d in draft_tree.draft_trees(drafter, reqs)]  # type: ignore[arg-type]


def cases(n: int):
    rng = random.Random(0)
    for case in range(n):
        width, beam, peak = rng.randint(2, 5), rng.randint(1, 3), rng.choice([0.5, 2.0, 5.0])
        reqs = [
            DraftRequest(f"s{case}-{i}", 10, [1], rng.randint(2, 6), max_tree_nodes=rng.randint(2, 14))
            for i in range(rng.randint(1, 4))
        ]
        yield width, beam, peak, reqs


def test_beam_nodes_whose_children_cannot_be_kept_are_not_fed_and_the_trees_are_the_same(monkeypatch):
    fed_all = fed_pruned = forwards_all = forwards_pruned = 0
    for width, beam, peak, reqs in cases(300):
        pruned = PathDrafter(width, beam, peak)
        kept = grown(pruned, reqs)
        with monkeypatch.context() as m:
            m.setattr(draft_tree, "_children_can_be_kept", lambda tree, score, max_nodes: True)
            every = PathDrafter(width, beam, peak)
            assert grown(every, reqs) == kept
        fed_all, fed_pruned = fed_all + every.fed, fed_pruned + pruned.fed
        forwards_all, forwards_pruned = forwards_all + every.forwards, forwards_pruned + pruned.forwards
    # Something was saved, or the check above compared a rule that never fires.
    assert fed_pruned < 0.8 * fed_all
    assert forwards_pruned < forwards_all


def test_negative_control_a_rule_that_prunes_one_node_too_early_changes_the_trees(monkeypatch):
    """Skipping a beam node when max_nodes - 1 nodes score at least as high drops children that are kept."""
    monkeypatch.setattr(
        draft_tree, "_children_can_be_kept", lambda tree, score, n: sum(x.score >= score for x in tree.nodes) < n - 1
    )
    differ = 0
    for width, beam, peak, reqs in cases(300):
        early = grown(PathDrafter(width, beam, peak), reqs)
        with monkeypatch.context() as m:
            m.setattr(draft_tree, "_children_can_be_kept", lambda tree, score, max_nodes: True)
            differ += early != grown(PathDrafter(width, beam, peak), reqs)
    assert differ > 0


class HandMade(PathDrafter):
    """The root's children A, B, C at 0.7, 0.2, 0.1; every node's best children at 0.1, 0.09, 0.09 of it."""

    def _logits(self, row: int, path: tuple[int, ...]) -> torch.Tensor:
        if not path:
            probs = torch.full((VOCAB,), 1e-6)
            probs[:3] = torch.tensor([0.7, 0.2, 0.1])
        else:  # the rest spread thinner than the third best
            probs = torch.full((VOCAB,), 0.72 / (VOCAB - 3))
            probs[:3] = torch.tensor([0.1, 0.09, 0.09])
        return probs.log()


@pytest.mark.parametrize(("max_nodes", "fed_at_depth_2"), [(3, 0), (4, 0), (5, 1)])
def test_a_hand_made_tree_feeds_its_second_depth_only_while_fewer_nodes_outrank_it_than_are_kept(
    max_nodes, fed_at_depth_2
):
    """Width 3, beam 1, depth 3, the hand-made probabilities. Depth 1 feeds A (nothing outranks it). At depth 2
    the beam node is A's best child (0.07): four nodes score at least that (A, B, C and itself), so with room for 3
    or 4 nodes none of its children (at most 0.007) can be kept and it is not fed; with room for 5 it is."""

    drafter = HandMade(width=3, beam=1, peak=1.0)
    tokens, parents = grown(drafter, [DraftRequest("a", 10, [1], 3, max_tree_nodes=max_nodes)])[0]
    assert drafter.fed == 1 + fed_at_depth_2
    assert (tokens, parents) == ([0, 1, 2, 0, 1][:max_nodes], [-1, -1, -1, 0, 0][:max_nodes])


def test_a_greedy_requests_ranking_is_the_same_beside_sampled_requests() -> None:
    """A greedy request ranks its tree by the drafter's plain softmax; its own top-k (which greedy output ignores)
    must not apply when a sampled request shares the batch, or its tree would shrink to a chain there."""
    greedy = DraftRequest("g", 5, [1] * 5, 3, params=SamplingParams(temperature=0.0, top_k=1), max_tree_nodes=8)
    sampled = DraftRequest("s", 5, [1] * 5, 3, params=SamplingParams(temperature=0.7, top_p=0.9), max_tree_nodes=8)
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    mixed = draft_tree._log_probs(logits, [greedy, sampled])
    assert torch.equal(mixed[0], draft_tree._log_probs(logits[:1], [greedy])[0])
    assert torch.isfinite(mixed[0]).all()  # every token ranked, none cut by top-k = 1
    assert torch.equal(mixed[1], draft_tree._log_probs(logits[1:], [sampled])[0])
    assert torch.isinf(mixed[1]).any()  # the sampled request's own top-p does cut its ranking


@pytest.mark.parametrize(
    ("min_prob", "tokens", "parents"),
    [
        (0.0, [0, 1, 2, 0, 1, 2, 0, 1], [-1, -1, -1, 0, 0, 0, 3, 3]),  # A's children 0.07, 0.063, 0.063
        (0.065, [0, 1, 2, 0, 0], [-1, -1, -1, 0, 3]),  # of A's children the best; under it, the path's 0.007
        (0.15, [0, 1, 0, 0], [-1, -1, 0, 2]),  # A, B and the best-guess path A -> A's best -> its best
        (0.8, [0, 0, 0], [-1, 0, 1]),  # the best-guess path alone: the chain the drafter would send
    ],
)
def test_nodes_off_the_best_guess_path_less_likely_than_the_price_are_not_sent(min_prob, tokens, parents):
    """Width 3, beam 1, depth 3, room for 8 nodes, the hand-made probabilities: the tree keeps the nodes whose path
    probability is at least `min_prob`, and its best-guess path whole (the verifier judges the tree by it)."""
    drafter = HandMade(width=3, beam=1, peak=1.0)
    req = DraftRequest("a", 10, [1], 3, max_tree_nodes=8, min_node_prob=min_prob)
    assert grown(drafter, [req])[0] == (tokens, parents)


def paths_and_probs(drafter: PathDrafter, row: int, tokens: list[int], parents: list[int]):
    """Each node's path (its tokens under the root) and path probability under the drafter's plain softmax (greedy
    requests rank by it), and the best-guess path (first children from the root) as a list of paths."""
    paths: list[tuple[int, ...]] = []
    logs: list[float] = []
    for token, parent in zip(tokens, parents, strict=True):
        above = paths[parent] if parent >= 0 else ()
        step = torch.log_softmax(drafter._logits(row, above), dim=-1)[token].item()
        paths.append((*above, token))
        logs.append((logs[parent] if parent >= 0 else 0.0) + step)
    best, node = [], -1
    while (child := next((i for i, p in enumerate(parents) if p == node), None)) is not None:
        best.append(paths[node := child])
    return paths, [math.exp(x) for x in logs], best


def test_a_priced_tree_keeps_the_unpriced_trees_likely_nodes_and_its_best_guess_path_and_feeds_less():
    """Over random drafters and requests, against the same request unpriced: every node sent at a price is on the
    best-guess path or at least that likely; every node of the unpriced tree that likely is sent; the unpriced
    best-guess path is sent (it may go deeper, where fewer nodes outrank it); and the price saves forwards."""
    fed_free = fed_priced = dropped = 0
    rng = random.Random(1)
    for width, beam, peak, reqs in cases(300):
        free = PathDrafter(width, beam, peak)
        unpriced = grown(free, reqs)
        priced_reqs = [replace(r, min_node_prob=rng.choice([0.01, 0.05, 0.2, 0.6])) for r in reqs]
        priced_drafter = PathDrafter(width, beam, peak)
        priced = grown(priced_drafter, priced_reqs)
        for row, (req, free_tree, priced_tree) in enumerate(zip(priced_reqs, unpriced, priced, strict=True)):
            floor = req.min_node_prob * (1 - 1e-6)
            free_paths, free_probs, free_best = paths_and_probs(free, row, *free_tree)
            paths, probs, best = paths_and_probs(priced_drafter, row, *priced_tree)
            assert all(p >= floor or path in best for path, p in zip(paths, probs, strict=True))
            assert {path for path, p in zip(free_paths, free_probs, strict=True) if p >= floor} <= set(paths)
            assert best[: len(free_best)] == free_best
            dropped += len(free_paths) - len(paths)
        fed_free, fed_priced = fed_free + free.fed, fed_priced + priced_drafter.fed
    assert dropped > 0 and fed_priced < fed_free  # the price did something
