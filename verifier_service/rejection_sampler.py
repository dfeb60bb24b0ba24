"""Lossless batched rejection sampling for speculative decoding.

For a row with `k` drafts `d_0..d_{k-1}`, draft position `j` accepts `d_j` with probability
`min(1, target_probs[j, d_j] / draft_probs[j, d_j])`. At the first rejection the row emits one
recovered token from `norm(max(0, target_probs[j] - draft_probs[j]))` and stops; when all `k` drafts
are accepted it emits a bonus token from `target_probs[k]`. The emitted tokens are then distributed
exactly as plain sampling from the target (Leviathan et al. 2023, arXiv 2211.17192; Chen et al.
2023, arXiv 2302.01318).

Randomness protocol
-------------------
Row `i` with `k_i` drafts consumes exactly one draw from its own generator::

    u = torch.rand(k_i + 1, generator=generators[i], dtype=torch.float64)

`u[:k_i]` are the acceptance uniforms (draft `j` is accepted iff
`u[j] * draft_probs[j, d_j] < target_probs[j, d_j]` and `draft_probs[j, d_j] > 0`, compared in
float64) and `u[k_i]` drives the single categorical draw
of the row (recovered or bonus token) by inverse CDF: the emitted token is the first index whose
float64 cumulative sum of the (unnormalised) distribution exceeds `u[k_i] * total_mass`. Nothing
else touches the generators, which are CPU generators (uniforms are moved to the probabilities'
device). Hence a row's output depends only on its own inputs and generator
state: it is the same alone or inside any batch, and a seeded request is reproducible. The uniforms
for acceptance tests beyond the first rejection are drawn but unused, so that the number of draws
never depends on the outcome (the generator state after a step depends on `k_i` only).

Draft forms
-----------
`draft_probs` is a `SparseProbs` (the ids and probabilities a truncating proposer sent, `[batch, k_max, n]`)
or None: one-hot drafts from a deterministic proposer (greedy, n-gram). Neither builds a vocabulary-wide
draft tensor: the acceptance test reads target and draft probabilities at the drafted ids (a gather), and the
residual is built for the one position per row where the row stopped. A dense distribution is the sparse one
whose support is the whole vocabulary (the tests use that form). Greedy targets need none of this:
`greedy_verify` compares ids.

Choices for inputs the theory leaves open
-----------------------------------------
- A draft token with `draft_probs[j, d_j] == 0` could not have been sampled by the proposer: that is
  a caller bug. It is rejected (never accepted on the strength of a 0/0 or p/0 ratio) and the row
  samples from the residual, which keeps every emitted token inside the target's support.
- When the residual mass is at most `MIN_RESIDUAL_MASS` (target == draft up to rounding) the row
  samples from `target_probs` instead; see `_stop_distribution`.
- A token with zero target probability is never emitted: acceptance needs `target_probs > 0`, the
  residual is positive only where `target_probs > draft_probs >= 0`, and the inverse CDF never lands
  on a zero-mass index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from shared.drafting import SparseProbs

# Residual mass below which the residual is treated as empty. The rejection probability at a
# position equals the residual mass (both are the total variation distance between target and
# draft), so below this bound rejection happens with probability ~0 and the fallback changes the
# output law by at most this much; fp32 rounding of two "equal" distributions stays well below it.
MIN_RESIDUAL_MASS = 1e-6


@dataclass
class RejectionResult:
    # [batch, k_max + 1] int64, padded with -1; row i holds num_accepted[i] + 1 tokens
    output_token_ids: Tensor
    num_accepted: Tensor  # [batch] int64


def rejection_sample(
    target_probs: Tensor,  # [batch, k_max + 1, vocab]; rows beyond k_i + 1 are padding
    draft_token_ids: Tensor,  # [batch, k_max] int64; entries beyond k_i are padding
    draft_probs: SparseProbs | None,  # sparse [batch, k_max, n], or None: one-hot
    num_draft_tokens: Tensor,  # [batch] int64, k_i in [0, k_max]
    generators: list[torch.Generator],  # one CPU generator per row
    check_mass: bool = True,
) -> RejectionResult:
    """Verify each row's drafts and emit accepted drafts plus one recovered or bonus token.

    `draft_token_ids` and `num_draft_tokens` are checked where they are (keep them on the CPU: on a device the
    checks would synchronise). `check_mass=False` skips the check that the rows read have mass, for a caller
    that has already removed bad rows: the only host synchronisation left is the caller's read of the result."""
    _check_inputs(target_probs, draft_token_ids, draft_probs, num_draft_tokens, generators)
    # Upcast so the acceptance ratio and the residual never run in half precision.
    target_probs = target_probs.float()
    device = target_probs.device
    if draft_probs is not None:
        draft_probs = draft_probs.to(device)
    k_max = draft_token_ids.shape[1]
    draft_token_ids = draft_token_ids.to(device)
    k = num_draft_tokens.to(device=device, dtype=torch.int64)  # [batch]

    accept_uniforms, sample_uniforms = _draw_uniforms(num_draft_tokens, generators, k_max, device)
    num_accepted = _count_accepted(target_probs, draft_token_ids, draft_probs, k, accept_uniforms)
    stop_probs = _stop_distribution(target_probs, draft_token_ids, draft_probs, num_accepted, k)  # [batch, vocab]
    if check_mass:
        _check_mass(stop_probs)
    final_token = inverse_cdf_sample(stop_probs, sample_uniforms)  # [batch]
    return _result(draft_token_ids, num_accepted, final_token)


def greedy_verify(
    target_token_ids: Tensor,  # [batch, k_max + 1] int64: the target's argmax at each scored position
    draft_token_ids: Tensor,  # [batch, k_max] int64; entries beyond k_i are padding
    num_draft_tokens: Tensor,  # [batch] int64
) -> RejectionResult:
    """Greedy targets (one-hot target_probs): accept while the draft equals the target's argmax, then emit the
    argmax. The same result rejection_sample gives for one-hot targets, by comparing ids; no randomness used."""
    device = target_token_ids.device
    k_max = draft_token_ids.shape[1]
    draft_token_ids = draft_token_ids.to(device)
    is_draft = torch.arange(k_max, device=device).unsqueeze(0) < num_draft_tokens.to(device).unsqueeze(1)
    matches = (draft_token_ids == target_token_ids[:, :k_max]) & is_draft  # [batch, k_max]
    num_accepted = matches.long().cumprod(dim=1).sum(dim=1)  # [batch]
    final_token = target_token_ids.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [batch]
    return _result(draft_token_ids, num_accepted, final_token)


def _result(draft_token_ids: Tensor, num_accepted: Tensor, final_token: Tensor) -> RejectionResult:
    k_max = draft_token_ids.shape[1]
    positions = torch.arange(k_max + 1, device=draft_token_ids.device).unsqueeze(0)  # [1, k_max + 1]
    # [batch, k_max + 1]: drafts followed by the final token, so one mask picks a row's prefix.
    padded_drafts = torch.cat([draft_token_ids, final_token.unsqueeze(1)], dim=1)
    output_token_ids = torch.where(
        positions < num_accepted.unsqueeze(1), padded_drafts, torch.full_like(padded_drafts, -1)
    )
    output_token_ids.scatter_(1, num_accepted.unsqueeze(1), final_token.unsqueeze(1))
    return RejectionResult(output_token_ids=output_token_ids, num_accepted=num_accepted)


def _check_inputs(
    target_probs: Tensor,
    draft_token_ids: Tensor,
    draft_probs: SparseProbs | None,
    num_draft_tokens: Tensor,
    generators: list[torch.Generator],
) -> None:
    if target_probs.dim() != 3 or draft_token_ids.dim() != 2:
        raise ValueError("expected target_probs [b, k+1, v] and draft_token_ids [b, k]")
    batch, k_max = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    if target_probs.shape != (batch, k_max + 1, vocab):
        raise ValueError(f"target_probs {tuple(target_probs.shape)} should be {(batch, k_max + 1, vocab)}")
    if draft_probs is not None and draft_probs.token_ids.shape[:2] != (batch, k_max):
        raise ValueError(f"sparse draft_probs {tuple(draft_probs.token_ids.shape)} should be {(batch, k_max, 'n')}")
    if num_draft_tokens.shape != (batch,):
        raise ValueError(f"num_draft_tokens {tuple(num_draft_tokens.shape)} should be {(batch,)}")
    if len(generators) != batch:
        raise ValueError(f"need one generator per row: {len(generators)} generators for {batch} rows")
    if bool(((num_draft_tokens < 0) | (num_draft_tokens > k_max)).any()):
        raise ValueError(f"num_draft_tokens must lie in [0, {k_max}]")
    device = draft_token_ids.device
    real = torch.arange(k_max, device=device) < num_draft_tokens.to(device)[:, None]  # [batch, k_max]
    if bool((real & ((draft_token_ids < 0) | (draft_token_ids >= vocab))).any()):
        raise ValueError(f"draft token ids must lie in [0, {vocab})")


def _draw_uniforms(
    num_draft_tokens: Tensor, generators: list[torch.Generator], k_max: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Per-row draws of the randomness protocol (module docstring), laid out for batched use."""
    k_list = num_draft_tokens.tolist()
    draws = [torch.rand(k_i + 1, generator=g, dtype=torch.float64) for k_i, g in zip(k_list, generators, strict=True)]
    flat = torch.cat(draws) if draws else torch.empty(0, dtype=torch.float64)  # [sum(k_i + 1)]
    lengths = torch.tensor([k_i + 1 for k_i in k_list], dtype=torch.int64)  # [batch]
    rows = torch.repeat_interleave(torch.arange(len(k_list)), lengths)  # [sum(k_i + 1)]
    starts = torch.cumsum(lengths, 0) - lengths
    cols = torch.arange(flat.numel()) - torch.repeat_interleave(starts, lengths)
    # Padding uniforms are never used: positions >= k_i are masked out of the acceptance test.
    uniforms = torch.ones(len(k_list), k_max + 1, dtype=torch.float64)  # [batch, k_max + 1]
    uniforms[rows, cols] = flat
    sample_uniforms = uniforms[torch.arange(len(k_list)), lengths - 1]  # [batch]
    return uniforms[:, :k_max].to(device), sample_uniforms.to(device)


def _count_accepted(
    target_probs: Tensor,  # [batch, k_max + 1, vocab]
    draft_token_ids: Tensor,  # [batch, k_max]
    draft_probs: SparseProbs | None,
    k: Tensor,  # [batch]
    accept_uniforms: Tensor,  # [batch, k_max] float64
) -> Tensor:  # [batch] int64
    k_max = draft_token_ids.shape[1]
    is_draft = torch.arange(k_max, device=k.device).unsqueeze(0) < k.unsqueeze(1)  # [batch, k_max]
    # Padding ids may be anything (-1, out of vocab): point them at token 0 so gather is safe.
    safe_ids = torch.where(is_draft, draft_token_ids, torch.zeros_like(draft_token_ids))
    target_at_draft = target_probs[:, :k_max].gather(-1, safe_ids.unsqueeze(-1)).squeeze(-1)  # [batch, k_max]
    draft_at_draft = _draft_at_draft(draft_probs, safe_ids)  # [batch, k_max]
    # u * q < p in float64 is "u < p / q" without the division, so q == 0 cannot produce inf/NaN;
    # q == 0 is rejected outright (module docstring).
    accepted = (accept_uniforms * draft_at_draft.double() < target_at_draft.double()) & (draft_at_draft > 0)
    accepted &= is_draft
    # Drafts after the first rejection do not count even if their own test passed.
    return accepted.long().cumprod(dim=1).sum(dim=1)


def _draft_at_draft(draft_probs: SparseProbs | None, ids: Tensor) -> Tensor:  # [batch, k_max]
    """The draft's probability of each drafted id."""
    if draft_probs is None:
        return torch.ones(ids.shape, dtype=torch.float32, device=ids.device)
    # [batch, k_max, n] -> [batch, k_max]: duplicate ids add up.
    matches = draft_probs.token_ids == ids.unsqueeze(-1)
    return torch.where(matches, draft_probs.probs, torch.zeros_like(draft_probs.probs)).sum(dim=-1)


def _stop_distribution(
    target_probs: Tensor,  # [batch, k_max + 1, vocab]
    draft_token_ids: Tensor,  # [batch, k_max]
    draft_probs: SparseProbs | None,
    num_accepted: Tensor,  # [batch]
    k: Tensor,  # [batch]
) -> Tensor:  # [batch, vocab], unnormalised
    """Distribution of the row's last token: the residual at a rejection, the target for the bonus. Only the
    stop position's draft distribution is ever made vocabulary-wide, and only as `target - draft` there."""
    rows = torch.arange(target_probs.shape[0], device=target_probs.device)
    stop_target = target_probs[rows, num_accepted]  # [batch, vocab]
    k_max = draft_token_ids.shape[1]
    if k_max == 0:
        return stop_target
    # Meaningless for bonus rows, which the where() below sends to the target.
    stop = num_accepted.clamp(max=k_max - 1)  # [batch]
    if draft_probs is None:  # one-hot: the drafted id loses all its mass
        ids = draft_token_ids[rows, stop].unsqueeze(1)  # [batch, 1]
        probs = torch.ones(ids.shape, dtype=torch.float32, device=ids.device)
    else:
        ids, probs = draft_probs.token_ids[rows, stop], draft_probs.probs[rows, stop]  # [batch, n]
    # Padding entries (probability 0) may carry any id: point them at token 0, where they subtract nothing.
    vocab = target_probs.shape[-1]
    real = (ids >= 0) & (ids < vocab) & (probs != 0)
    ids = torch.where(real, ids, torch.zeros_like(ids))
    probs = torch.where(real, probs, torch.zeros_like(probs))
    residual = stop_target.scatter_add(-1, ids, -probs).clamp(min=0)
    residual_mass = residual.sum(dim=-1, dtype=torch.float64)  # [batch]
    # An empty residual means rejection had probability ~0 (see MIN_RESIDUAL_MASS); sampling the
    # target then stays inside its support and avoids normalising a zero vector.
    use_target = (num_accepted == k) | ~(residual_mass > MIN_RESIDUAL_MASS)
    return torch.where(use_target.unsqueeze(1), stop_target, residual)


def _check_mass(probs: Tensor) -> None:  # [batch, vocab]
    total = probs.sum(dim=-1, dtype=torch.float64)
    if not bool(torch.isfinite(total).all() & (total > 0).all()):
        raise ValueError("a target_probs row the sampler reads has no finite positive mass")


def inverse_cdf_sample(
    probs: Tensor,  # [batch, vocab] unnormalised, nonnegative
    uniforms: Tensor,  # [batch] float64 in [0, 1)
) -> Tensor:  # [batch] int64
    cdf = probs.double().cumsum(dim=-1)  # [batch, vocab]; float64 so a long tail is not rounded away
    total = cdf[:, -1]  # [batch]
    # u < 1, but u * total may round up to total; keeping the threshold strictly below the total
    # guarantees an index whose cdf exceeds it.
    threshold = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    # First index whose cdf exceeds the threshold; its cdf step is positive, so it has positive mass.
    token = torch.searchsorted(cdf, threshold.unsqueeze(1), right=True).squeeze(1)  # [batch]
    return token
