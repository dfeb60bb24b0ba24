"""Verification of a token tree: walk from the committed prefix down the tree, keeping the target's law exactly.

A tree row's scored positions are the root's (the last committed token: row 0) and each node's (node i: row
i + 1). At the current node the target's distribution for the next token is its row; its children are the
candidates, tried in node order:
- greedy: the child whose token is the target's argmax, if any;
- seeded: the child whose token is the seeded token at that output position (shared/seeded.py);
- sampled: multi-draft recursive rejection sampling (SpecInfer, Miao et al. 2024; Chen et al. 2023's rule
  applied round after round): with `residual` starting as the target's distribution, a child drafted from a
  sparse distribution q is accepted with probability min(1, residual(token) / q(token)), and a rejection
  leaves max(0, residual - q); a deterministic child (no distribution: a drafter's top-k guess) is accepted
  with the residual's probability of its token, and a rejection zeroes that token. Each round emits the
  residual's law exactly, so the emitted token follows the target's whatever the children were, provided
  siblings with distributions are independent draws from them (the wire contract).
The first accepted child becomes the current node; when none is, the row emits one token from the last
residual (the target's own row at a leaf, or where the residual has no mass left) and stops.

Randomness protocol: a sampled tree row draws `num_nodes + 1` float64 uniforms from its generator at once,
uniform i for node i's test and the last for the final token, whatever the outcome, so the generator's state
after a step depends on the tree's size only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.drafting import Draft, tree_children
from shared.sampling import SamplingParams, first_argmax
from shared.seeded import seeded_tokens
from verifier_service.rejection_sampler import MIN_RESIDUAL_MASS, inverse_cdf_sample


@dataclass(frozen=True)
class TreeVerdict:
    tokens: list[int]  # the accepted path's tokens, then one recovered or bonus token
    path: list[int]  # the accepted nodes, root to leaf (draft indices)


def verify_tree(
    target_logits: torch.Tensor,  # [num_nodes + 1, vocab] (after any grammar mask): greedy rows read the argmax
    target_probs: torch.Tensor,  # [num_nodes + 1, vocab]: row 0 the root's, row i + 1 node i's
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator,
    first_position: int,  # output position of the first token this row emits (seeded rows)
) -> TreeVerdict:
    assert draft.parents is not None
    children = tree_children(draft.parents)
    if params.is_greedy:
        argmax = first_argmax(target_logits).tolist()  # one read for the whole tree
        return _follow(draft, children, lambda node, depth: argmax[node + 1])
    if params.is_seeded:
        seed = params.seed
        assert seed is not None
        return _follow(
            draft,
            children,
            lambda node, depth: int(
                seeded_tokens(target_probs[node + 1 : node + 2], seed, [first_position + depth])[0]
            ),
        )
    uniforms = torch.rand(len(draft.token_ids) + 1, generator=generator, dtype=torch.float64).tolist()
    return _sample(target_probs, draft, children, uniforms)


def _follow(draft: Draft, children: list[list[int]], token_at) -> TreeVerdict:
    """Walk down while a child holds the token the target emits at the current node (`token_at(node, depth)`,
    node -1 the root)."""
    node, tokens, path = -1, list[int](), list[int]()
    while True:
        token = token_at(node, len(path))
        tokens.append(token)
        match = next((child for child in children[node + 1] if draft.token_ids[child] == token), None)
        if match is None:
            return TreeVerdict(tokens, path)
        node = match
        path.append(node)


def _sample(target_probs: torch.Tensor, draft: Draft, children: list[list[int]], uniforms: list[float]) -> TreeVerdict:
    node, tokens, path = -1, list[int](), list[int]()
    while True:
        target = target_probs[node + 1].double()  # [vocab]
        residual, accepted = target.clone(), None
        for child in children[node + 1]:
            mass = float(residual.sum())
            if not mass > MIN_RESIDUAL_MASS:
                break  # a rejection of probability ~0 left nothing: the target's own row decides (see below)
            token = draft.token_ids[child]
            if draft.probs is None:  # a deterministic guess
                if uniforms[child] * mass < float(residual[token]):
                    accepted = child
                    break
                residual[token] = 0.0
                continue
            draft_probs = _dense(draft, child, residual)  # [vocab] float64
            at_token = float(draft_probs[token])
            if at_token > 0 and uniforms[child] * at_token * mass < float(residual[token]):
                accepted = child
                break
            residual = (residual / mass - draft_probs).clamp(min=0)
        if accepted is None:
            stop = residual if float(residual.sum()) > MIN_RESIDUAL_MASS else target
            final = inverse_cdf_sample(
                stop.unsqueeze(0), torch.tensor([uniforms[-1]], dtype=torch.float64, device=stop.device)
            )
            tokens.append(int(final[0]))
            return TreeVerdict(tokens, path)
        tokens.append(draft.token_ids[accepted])
        path.append(accepted)
        node = accepted


def _dense(draft: Draft, node: int, like: torch.Tensor) -> torch.Tensor:  # [vocab] float64, on like's device
    assert draft.probs is not None
    ids, probs = draft.probs.token_ids[node], draft.probs.probs[node]  # [n]; padding has probability 0
    real = (ids >= 0) & (ids < like.shape[-1]) & (probs != 0)
    dense = torch.zeros_like(like)
    return dense.index_add_(0, ids[real].to(like.device), probs[real].to(like.device, torch.float64))
