"""The drafter contract, shared by the in-process engine and the gRPC proposer.

It mirrors the wire protocol: each request carries the sequence's committed length and only the tokens
committed since the last request, so a drafter keeps per-sequence history; a draft names the committed
length it was built on, so a stale one can be recognised and discarded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from shared.sampling import SamplingParams


@dataclass(frozen=True)
class DraftRequest:
    seq_id: str
    committed_len: int  # committed tokens in the sequence, prompt included
    new_token_ids: list[int]  # committed since the last request for this sequence (all of them on first contact)
    k: int
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True)
class SparseProbs:
    """The distribution each draft token was sampled from, as its support: ids and probabilities."""

    token_ids: torch.Tensor  # [k, n] int64
    probs: torch.Tensor  # [k, n] fp32, rows sum to 1


@dataclass(frozen=True)
class Draft:
    seq_id: str
    committed_len: int
    token_ids: list[int]  # at most k; fewer (even none) is allowed
    probs: SparseProbs | None = None  # None: each token was chosen deterministically (one-hot)
    needs_resync: bool = False  # the drafter lacks this sequence's history: resend it whole


class Drafter(Protocol):
    def propose(self, requests: list[DraftRequest]) -> list[Draft]: ...

    def release(self, seq_ids: list[str]) -> None: ...


class SequenceHistory:
    """Committed tokens per sequence, rebuilt from the deltas the requests carry."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def apply(self, req: DraftRequest) -> list[int] | None:
        """The full committed sequence, or None when the delta does not fit what we hold."""
        tokens = self.tokens.setdefault(req.seq_id, [])
        start = req.committed_len - len(req.new_token_ids)
        if start > len(tokens) or start < 0:
            return None
        del tokens[start:]  # a resend of tokens we already hold replaces them
        tokens.extend(req.new_token_ids)
        return tokens

    def release(self, seq_id: str) -> None:
        self.tokens.pop(seq_id, None)
