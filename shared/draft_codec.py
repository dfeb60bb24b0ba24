"""Drafts on the wire (proposer.proto `Draft`): the proposer packs, the verifier unpacks and checks.

Sparse draft distributions travel flattened, position by position: `draft_prob_counts[j]` entries of
`draft_prob_token_ids` / `draft_probs` belong to draft position j; zero-probability entries are left out and
float32 values are exact on the wire. A draft without probabilities is one-hot (greedy, seeded or n-gram).
"""

from __future__ import annotations

import torch

from shared.drafting import Draft, SparseProbs, tree_depths
from shared.proto_gen.specdec.v1 import proposer_pb2

PROB_SUM_TOLERANCE = 1e-3  # float32 probabilities over a few thousand ids sum to 1 within ~1e-5
# The widest distribution per draft position a verifier accepts unless told otherwise (GetInfoRequest's
# max_draft_support): the proposers' top-n is 64; a batch of 256 sequences x 8 positions x 1,024 entries is
# 25 MB of padded tensors, where an unbounded width let one 64 MiB reply make the verifier allocate gigabytes.
DEFAULT_MAX_DRAFT_SUPPORT = 1024


def pack_draft(seq_id: str, draft: Draft) -> proposer_pb2.Draft:
    """Domain draft -> wire draft; sparse probabilities flattened, zero-probability entries left out."""
    msg = proposer_pb2.Draft(
        seq_id=seq_id,
        committed_len=draft.committed_len,
        draft_token_ids=draft.token_ids,
        needs_resync=draft.needs_resync,
        draft_parents=draft.parents or [],
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


def unpack_draft(
    msg: proposer_pb2.Draft,
    vocab_size: int,
    max_k: int | None = None,
    max_tree_nodes: int = 0,
    max_support: int | None = None,
) -> Draft:
    """Wire draft -> domain draft (probabilities exactly as sent, float32).

    The proposer is untrusted input, in size as in values: raises ValueError for a draft that would make
    verification wrong, crash or allocate without bound: more tokens (or a deeper tree) than the `max_k` asked
    for, a tree where none was asked for or with more than `max_tree_nodes` nodes or parents out of order, a
    position whose distribution has more entries than the vocabulary or than `max_support` (checked on the
    counts, before any entry is read), ids outside the target vocabulary, inconsistent counts, negative or
    non-finite probabilities, a distribution that does not sum to 1, or a drafted token that has no positive
    probability in the distribution it was supposedly sampled from.
    """
    k = len(msg.draft_token_ids)
    parents = _tree_parents(msg, max_k, max_tree_nodes)
    if parents is None and max_k is not None and k > max_k:
        raise ValueError(f"{k} draft tokens where at most {max_k} were asked for")
    token_ids = list(msg.draft_token_ids)
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise ValueError(f"draft token ids outside the vocabulary [0, {vocab_size})")
    if len(msg.draft_prob_counts) not in (0, k):
        raise ValueError(f"{len(msg.draft_prob_counts)} draft_prob_counts for {k} draft tokens")
    counts = list(msg.draft_prob_counts)
    if not counts or not k:
        if counts and sum(counts):
            raise ValueError("draft probabilities without draft tokens")
        return Draft(msg.seq_id, msg.committed_len, token_ids, None, msg.needs_resync, parents)
    widest = min(vocab_size, max_support) if max_support else vocab_size
    if max(counts) > widest:
        raise ValueError(f"a draft position's distribution has {max(counts)} entries; at most {widest} are accepted")
    total = len(msg.draft_probs)
    if sum(counts) != total or len(msg.draft_prob_token_ids) != total or min(counts) < 1:
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
    return Draft(msg.seq_id, msg.committed_len, token_ids, SparseProbs(ids, probs), msg.needs_resync, parents)


def _tree_parents(msg: proposer_pb2.Draft, max_k: int | None, max_tree_nodes: int) -> list[int] | None:
    """The draft's tree (None: a chain), checked: asked for, no bigger or deeper than asked, topological."""
    if not msg.draft_parents:
        return None
    if max_tree_nodes <= 0:
        raise ValueError("a token tree where only a chain was asked for")
    if len(msg.draft_parents) != len(msg.draft_token_ids):
        raise ValueError(f"{len(msg.draft_parents)} parents for {len(msg.draft_token_ids)} tree nodes")
    if len(msg.draft_parents) > max_tree_nodes:
        raise ValueError(f"a tree of {len(msg.draft_parents)} nodes where at most {max_tree_nodes} were asked for")
    parents = list(msg.draft_parents)
    if any(not -1 <= parent < node for node, parent in enumerate(parents)):
        raise ValueError("tree parents must come before their children (-1: the committed prefix)")
    depth = max(tree_depths(parents))
    if max_k is not None and depth > max_k:
        raise ValueError(f"a tree {depth} deep where at most {max_k} was asked for")
    return parents
