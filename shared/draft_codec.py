"""Drafts on the wire (proposer.proto `Draft`): the proposer packs, the verifier unpacks and checks.

Sparse draft distributions travel flattened, position by position: `draft_prob_counts[j]` entries of
`draft_prob_token_ids` / `draft_probs` belong to draft position j; zero-probability entries are left out and
float32 values are exact on the wire. A draft without probabilities is one-hot (greedy, seeded or n-gram).
"""

from __future__ import annotations

import torch

from shared.drafting import Draft, SparseProbs
from shared.proto_gen.specdec.v1 import proposer_pb2

PROB_SUM_TOLERANCE = 1e-3  # float32 probabilities over a few thousand ids sum to 1 within ~1e-5


def pack_draft(seq_id: str, draft: Draft) -> proposer_pb2.Draft:
    """Domain draft -> wire draft; sparse probabilities flattened, zero-probability entries left out."""
    msg = proposer_pb2.Draft(
        seq_id=seq_id,
        committed_len=draft.committed_len,
        draft_token_ids=draft.token_ids,
        needs_resync=draft.needs_resync,
    )
    k = len(draft.token_ids)
    if draft.probs is not None and k:
        ids = draft.probs.token_ids[:k].reshape(k, -1)  # [k, n]
        probs = draft.probs.probs[:k].reshape(k, -1).float()  # [k, n]
        keep = probs > 0
        msg.draft_prob_token_ids.extend(ids[keep].tolist())  # row-major: position by position
        msg.draft_probs.extend(probs[keep].tolist())  # float32 values, exact on the wire
        msg.draft_prob_counts.extend(keep.sum(dim=1).tolist())
    return msg


def unpack_draft(msg: proposer_pb2.Draft, vocab_size: int, max_k: int | None = None) -> Draft:
    """Wire draft -> domain draft (probabilities exactly as sent, float32).

    The proposer is untrusted input: raises ValueError for a draft that would make verification wrong or
    crash: more tokens than the `max_k` asked for, ids outside the target vocabulary, inconsistent counts,
    negative or non-finite probabilities, a distribution that does not sum to 1, or a drafted token that
    has no positive probability in the distribution it was supposedly sampled from.
    """
    token_ids = list(msg.draft_token_ids)
    k = len(token_ids)
    if max_k is not None and k > max_k:
        raise ValueError(f"{k} draft tokens where at most {max_k} were asked for")
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise ValueError(f"draft token ids outside the vocabulary [0, {vocab_size})")
    counts = list(msg.draft_prob_counts)
    if not counts or not k:
        if counts and sum(counts):
            raise ValueError("draft probabilities without draft tokens")
        return Draft(msg.seq_id, msg.committed_len, token_ids, None, msg.needs_resync)
    total = len(msg.draft_probs)
    if len(counts) != k or sum(counts) != total or len(msg.draft_prob_token_ids) != total or min(counts) < 1:
        raise ValueError(f"draft_prob_counts {counts} do not match {k} draft tokens and {total} probabilities")
    flat_ids = torch.tensor(list(msg.draft_prob_token_ids), dtype=torch.int64)
    flat_probs = torch.tensor(list(msg.draft_probs), dtype=torch.float32)
    if bool(((flat_ids < 0) | (flat_ids >= vocab_size)).any()):
        raise ValueError(f"draft distribution ids outside the vocabulary [0, {vocab_size})")
    if not bool(torch.isfinite(flat_probs).all()) or bool((flat_probs < 0).any()):
        raise ValueError("draft probabilities must be finite and >= 0")
    sums = torch.zeros(k, dtype=torch.float64).index_add_(
        0, torch.repeat_interleave(torch.arange(k), torch.tensor(counts)), flat_probs.double()
    )
    if bool(((sums - 1).abs() > PROB_SUM_TOLERANCE).any()):
        raise ValueError(f"draft distributions must sum to 1, got sums {[round(x, 6) for x in sums.tolist()]}")
    counts_t = torch.tensor(counts, dtype=torch.int64)
    n = int(counts_t.max())
    rows = torch.repeat_interleave(torch.arange(k), counts_t)  # [total]
    starts = torch.cumsum(counts_t, 0) - counts_t  # [k]
    cols = torch.arange(total) - starts[rows]  # [total]
    ids = torch.zeros(k, n, dtype=torch.int64)  # padding: id 0 with probability 0
    probs = torch.zeros(k, n, dtype=torch.float32)
    ids[rows, cols] = flat_ids
    probs[rows, cols] = flat_probs
    drafted = torch.tensor(token_ids, dtype=torch.int64).unsqueeze(1)  # [k, 1]
    if not bool(((ids == drafted) & (probs > 0)).any(dim=1).all()):
        raise ValueError("a drafted token has no positive probability in its draft distribution")
    return Draft(msg.seq_id, msg.committed_len, token_ids, SparseProbs(ids, probs), msg.needs_resync)
