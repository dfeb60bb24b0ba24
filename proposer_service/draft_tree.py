"""Token trees from a model drafter: EAGLE-2's dynamic tree (Li et al. 2024), batched over sequences per depth.

Under the last committed token (the root) the drafter's `tree_width` best tokens become candidate nodes, each
scored by its cumulative log draft probability (the product along its path). At every depth the `tree_beam`
best candidates of that depth are fed to the drafter (one batched forward for all sequences: `_expand_logits`),
and their `tree_width` best tokens become the next depth's candidates. Finally the `max_tree_nodes` best
candidates are kept: a child never scores above its parent, so the kept set holds every kept node's ancestors.
A node off the best-guess path (each depth's best child of the path above: the chain the drafter would have
sent) whose path probability is below the request's `min_node_prob` (the verifier's price of a scored node, in
tokens) is neither kept nor fed: with the committed head a node is accepted about as often as its path
probability says (greedy; about half as often at T = 0.8), and a third of the nodes of an 8-node tree fall under 5%
and are accepted 2-4% of the time, while each costs the verifier a scored row (docs/BENCHMARKS.md, "Tree nodes
the drafter is sure of"). The best-guess path stays whole: the verifier judges what a tree adds by it
(`Draft.best_guess_verdict`), as a chain of the same depth.

Nodes are deterministic guesses (no probabilities are sent): the verifier accepts a child with the target's
probability of its token under the residual (verifier_service/tree_verify.py), exact for greedy and sampled
requests alike. The ranking distribution is the request's own (temperature, top-k, top-p) for sampled requests
and the drafter's plain softmax for greedy ones, whose one-hot distribution would rank nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from shared.drafting import Draft, DraftRequest
from shared.grammar import GrammarMatcher
from shared.sampling import logits_to_probs, params_to_tensors

if TYPE_CHECKING:
    from proposer_service.paged_drafter import PagedDrafter


@dataclass(frozen=True)
class Expansion:
    """A drafted token fed to the drafter this round: the `index`-th of its row's (its cache slot is the row's
    first draft slot + index), at `depth` (1: a child of the last committed token), seeing the committed
    prefix and `ancestors`: the indices of its fed ancestors and its own, root first."""

    row: int
    token: int
    depth: int
    index: int
    ancestors: tuple[int, ...]

    @property
    def parent(self) -> int:
        """The index of the expansion whose output gave this token's distribution; -1: the root's."""
        return self.ancestors[-2] if len(self.ancestors) > 1 else -1

    @property
    def in_chain(self) -> bool:
        """Fed right after its parent, on a single path: plain causal attention covers it."""
        return self.ancestors == tuple(range(self.index + 1)) and self.depth == self.index + 1


def grows_tree(req: DraftRequest, matcher: GrammarMatcher | None) -> bool:
    """A tree for requests that asked for one, drafting more than one deep; a format or a seed drafts a chain."""
    return req.max_tree_nodes > 0 and req.k > 0 and matcher is None and req.params.seed is None


@dataclass
class _Node:
    token: int
    parent: int  # index in the tree's node list; -1: the root
    depth: int
    score: float  # cumulative log draft probability
    ancestors: tuple[int, ...] = ()  # once fed: the expansion indices of its ancestors and its own


@dataclass
class _Tree:
    nodes: list[_Node] = field(default_factory=list)
    fed: int = 0  # expansions so far
    path: set[int] = field(default_factory=set)  # the best-guess path's nodes so far


def draft_trees(drafter: PagedDrafter, reqs: list[DraftRequest]) -> list[Draft]:
    trees = [_Tree() for _ in reqs]
    floors = [math.log(req.min_node_prob) if req.min_node_prob > 0 else -math.inf for req in reqs]
    rows = list(range(len(reqs)))
    logits = drafter._root_logits(reqs, rows)  # [rows, width]
    for row, best in zip(rows, _best_tokens(drafter, _log_probs(logits, [reqs[i] for i in rows])), strict=True):
        _add_children(drafter, trees[row], -1, 0.0, best)
    for depth in range(1, max(req.k for req in reqs)):
        expansions, expanded = [], []
        for row, (req, tree) in enumerate(zip(reqs, trees, strict=True)):
            if req.k <= depth:
                continue
            frontier = [i for i, node in enumerate(tree.nodes) if node.depth == depth]
            for i in sorted(frontier, key=lambda i: -tree.nodes[i].score)[: drafter.tree_beam]:
                node = tree.nodes[i]
                priced_out = node.score < floors[row] and i not in tree.path
                if priced_out or not _children_can_be_kept(tree, node.score, req.max_tree_nodes):
                    continue
                above = tree.nodes[node.parent].ancestors if node.parent >= 0 else ()
                node.ancestors = (*above, tree.fed)
                expansions.append(Expansion(row, node.token, depth, tree.fed, node.ancestors))
                expanded.append((tree, i))
                tree.fed += 1
        if not expansions:
            break
        logits = drafter._expand_logits(reqs, expansions)  # [expansions, width]
        log_probs = _log_probs(logits, [reqs[e.row] for e in expansions])
        for (tree, i), best in zip(expanded, _best_tokens(drafter, log_probs), strict=True):
            _add_children(drafter, tree, i, tree.nodes[i].score, best)
    return [_kept(req, tree, floor) for req, tree, floor in zip(reqs, trees, floors, strict=True)]


def _log_probs(logits: torch.Tensor, reqs: list[DraftRequest]) -> torch.Tensor:  # [rows, width]
    """The ranking distribution, as log-probabilities: a sampled request's own, a greedy one's plain softmax (also
    beside sampled ones: its top-k or top-p, which greedy output ignores, must not shrink its tree)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    sampled = [i for i, req in enumerate(reqs) if not req.params.is_greedy]
    if sampled:
        rows = torch.tensor(sampled)
        tensors = params_to_tensors([reqs[i].params for i in sampled])
        log_probs[rows] = logits_to_probs(logits[rows], **tensors).log().float()
    return log_probs


def _best_tokens(drafter: PagedDrafter, log_probs: torch.Tensor) -> list[list[tuple[float, int]]]:
    """Per row of log_probs [rows, width], its `tree_width` best (log-probability, column), best first: one topk."""
    top = log_probs.topk(min(drafter.tree_width, log_probs.shape[-1]), dim=-1)
    return [
        list(zip(values, indices, strict=True))
        for values, indices in zip(top.values.tolist(), top.indices.tolist(), strict=True)
    ]


def _add_children(drafter: PagedDrafter, tree: _Tree, parent: int, score: float, best: list[tuple[float, int]]) -> None:
    depth = tree.nodes[parent].depth + 1 if parent >= 0 else 1
    first = len(tree.nodes)
    for value, index in best:
        if value > float("-inf"):  # a truncated distribution may hold fewer tokens than the width
            tree.nodes.append(_Node(drafter._token(index), parent, depth, score + value))
    if len(tree.nodes) > first and (parent < 0 or parent in tree.path):
        tree.path.add(first)  # the best child of the path's last node


def _children_can_be_kept(tree: _Tree, score: float, max_nodes: int) -> bool:
    """Whether a child of a node scored `score` could be among the kept nodes. A child scores at most its parent,
    and comes after every node there is now, which wins a tie: with `max_nodes` nodes already scored at least its
    parent's, neither it nor anything under it is kept, and feeding its parent (a head forward) would change
    nothing that is sent."""
    return sum(node.score >= score for node in tree.nodes) < max_nodes


def _kept(req: DraftRequest, tree: _Tree, floor: float) -> Draft:
    """Of the best max_tree_nodes nodes (ties to the earlier: a parent before its children), those scored at least
    `floor` and those on the best-guess path, in creation order, which is topological. The best nodes hold a prefix
    of the path: a path node's first child outranks its siblings, so it is among them if any sibling is."""
    best = sorted(sorted(range(len(tree.nodes)), key=lambda i: (-tree.nodes[i].score, i))[: req.max_tree_nodes])
    kept = [i for i in best if tree.nodes[i].score >= floor or i in tree.path]
    position = {node: j for j, node in enumerate(kept)}
    tokens = [tree.nodes[i].token for i in kept]
    parents = [position[tree.nodes[i].parent] if tree.nodes[i].parent >= 0 else -1 for i in kept]
    return Draft(req.seq_id, req.committed_len, tokens, parents=parents)
