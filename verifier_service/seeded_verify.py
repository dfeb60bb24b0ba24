"""Verification of seeded requests: accept a draft exactly when it equals the seeded token there.

The seeded token at each output position is fixed by (seed, position, target_probs) alone
(shared/seeded.py), so verification is a comparison: walk the drafts, emit the target's seeded token at
each position, and stop after the first position where the draft differs (or after the bonus position
when all drafts match). The emitted tokens are the ones plain seeded decoding would emit, whatever was
drafted; draft probabilities are not needed. Noise is drawn lazily: positions after the first mismatch
cost nothing.
"""

from __future__ import annotations

import torch

from shared.seeded import seeded_tokens


def seeded_verify(
    target_probs: torch.Tensor,  # [k+1, vocab]: the row's scored positions, drafts then bonus
    draft_ids: list[int],  # k drafts
    seed: int,
    first_position: int,  # output position (0 = first generated token) of target_probs[0]
) -> list[int]:  # num_accepted + 1 tokens
    k = len(draft_ids)
    emitted = []
    for j in range(k + 1):
        token = int(seeded_tokens(target_probs[j : j + 1], seed, [first_position + j])[0])
        emitted.append(token)
        if j == k or draft_ids[j] != token:  # the bonus position, or the first mismatch: stop here
            return emitted
    raise AssertionError("unreachable: the bonus position always returns")
