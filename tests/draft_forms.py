"""Dense draft distributions for tests: references compare against them, and a dense row is handed to the
sampler as the sparse distribution whose support is the whole vocabulary (the service never builds them)."""

from __future__ import annotations

import torch

from shared.drafting import SparseProbs


def one_hot_draft_probs(draft_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., k] ids -> [..., k, vocab]: the one-hot distribution of a deterministic drafter. Ids outside the
    vocabulary (padding such as -1) give an all-zero row."""
    in_vocab = (draft_token_ids >= 0) & (draft_token_ids < vocab_size)
    safe_ids = torch.where(in_vocab, draft_token_ids, torch.zeros_like(draft_token_ids))
    dense = torch.zeros(*draft_token_ids.shape, vocab_size, dtype=torch.float32)
    dense.scatter_(-1, safe_ids.unsqueeze(-1), in_vocab.unsqueeze(-1).float())
    return dense


def sparse_to_dense_draft_probs(token_ids: torch.Tensor, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., n] ids and probabilities -> [..., vocab]; duplicate ids add up, zero-probability entries are padding
    (any id). An out-of-vocabulary id with positive probability is an error, as in SparseProbs.check."""
    SparseProbs(token_ids, probs).check(vocab_size)
    in_vocab = (token_ids >= 0) & (token_ids < vocab_size)
    safe_ids = torch.where(in_vocab, token_ids, torch.zeros_like(token_ids))
    dense = torch.zeros(*token_ids.shape[:-1], vocab_size, dtype=torch.float32)
    dense.scatter_add_(-1, safe_ids, torch.where(in_vocab, probs.float(), torch.zeros_like(probs.float())))
    return dense


def dense_as_sparse(dense: torch.Tensor) -> SparseProbs:
    """[..., vocab] -> the same distributions with the whole vocabulary as their support."""
    ids = torch.arange(dense.shape[-1]).expand(dense.shape).contiguous()
    return SparseProbs(ids, dense)
