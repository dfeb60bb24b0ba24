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
    # The target's final hidden states at committed positions feature_start.. that the drafter has not been
    # sent yet; only for drafters whose `needs_target_features` is True (EAGLE heads), None otherwise.
    features: torch.Tensor | None = None  # [m, hidden]
    feature_start: int = 0
    # Output position (0 = the request's first generated token) of the first draft token: seeded requests
    # draft with the noise of shared/seeded.py at that position and the following ones.
    draft_position: int = 0
    # The request's tenant (the API key's name, '' = anonymous): a drafter that remembers text across requests
    # keeps it per tenant.
    tenant: str = ""
    # Largest token tree the verifier scores this step (nodes, depth <= k); 0: a chain of at most k tokens.
    max_tree_nodes: int = 0
    # A tree's nodes the drafter gives a path probability below this are not sent (its best-guess path is):
    # what a scored node costs the verifier, in tokens it emits (the speculation policy's price). 0: any.
    min_node_prob: float = 0.0


@dataclass(frozen=True)
class SparseProbs:
    """Draft distributions as their supports: the ids and probabilities a truncating drafter sampled from.
    One draft's are [k, n] (rows sum to 1); the verifier batches rows as [batch, k_max, n]. Duplicate ids add
    up; entries with probability 0 are padding and may carry any id."""

    token_ids: torch.Tensor  # [..., n] int64
    probs: torch.Tensor  # [..., n] fp32

    def check(self, vocab_size: int) -> None:
        """ValueError for an out-of-vocabulary id with positive probability (dropping its mass would make the
        verification inexact). Call it on the CPU tensors a proposer sent: on a device it would synchronise."""
        if self.token_ids.shape != self.probs.shape:
            raise ValueError(f"token_ids {tuple(self.token_ids.shape)} and probs {tuple(self.probs.shape)} differ")
        in_vocab = (self.token_ids >= 0) & (self.token_ids < vocab_size)
        if bool(((~in_vocab) & (self.probs != 0)).any()):
            raise ValueError(f"sparse draft ids outside [0, {vocab_size}) carry nonzero probability")

    def to(self, device: torch.device | str) -> SparseProbs:
        return SparseProbs(self.token_ids.to(device), self.probs.to(device, torch.float32))


@dataclass(frozen=True)
class Draft:
    """A chain of draft tokens, or a token tree: `token_ids` are then the nodes in topological order and
    `parents[i]` node i's parent (-1: the last committed token, else an earlier node)."""

    seq_id: str
    committed_len: int
    token_ids: list[int]  # at most k; fewer (even none) is allowed
    probs: SparseProbs | None = None  # per token: the distribution it was sampled from; None: deterministic
    needs_resync: bool = False  # the drafter lacks this sequence's history: resend it whole
    parents: list[int] | None = None  # None: a chain
    # No draft because the drafter could not be reached (a remote proposer down or late): a resync it implies
    # costs nothing until the proposer is back, so the verifier's resync budget does not count it.
    unreachable: bool = False

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def depth(self) -> int:
        """The longest path, in tokens (a chain's length)."""
        return max(tree_depths(self.parents), default=0) if self.parents is not None else len(self.token_ids)

    def best_guess_verdict(self, accepted: list[int]) -> tuple[int, int]:
        """(drafted, accepted) as the chain of the drafter's best guesses would have had them, given the drafts
        verification accepted: a tree's best-guess path (`best_guess_path`), a chain itself. Among a node's children
        only one can hold the accepted token, so the path is accepted as far as its tokens agree."""
        path = best_guess_path(self.parents) if self.parents is not None else range(len(self.token_ids))
        guesses = [self.token_ids[i] for i in path]
        agreed = 0
        while agreed < min(len(guesses), len(accepted)) and guesses[agreed] == accepted[agreed]:
            agreed += 1
        return len(guesses), agreed


def tree_depths(parents: list[int]) -> list[int]:
    """Each node's depth (1 for a child of the root); parents must be topological (parents[i] < i)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def tree_children(parents: list[int]) -> list[list[int]]:
    """children[0] are the root's, children[i + 1] node i's, each in node order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        children[parent + 1].append(node)
    return children


def best_guess_path(parents: list[int]) -> list[int]:
    """The nodes on the path that takes each node's first child, root first: the drafter's best guess at each depth,
    the chain it would have drafted (every tree builder here lists a node's children best first)."""
    children = tree_children(parents)
    path, node = [], -1
    while children[node + 1]:
        node = children[node + 1][0]
        path.append(node)
    return path


class Drafter(Protocol):
    """A drafter may also have `needs_target_features = True`: the engine then keeps the target's hidden
    states of every computed position and sends them along (`DraftRequest.features`)."""

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


FEATURE_WINDOW = 256  # positions of features kept behind those a store's reader has consumed (see trim)


class FeatureStore:
    """The target's final hidden states of one sequence's positions [start, end), in order (verifier and
    EAGLE drafter alike).

    Positions whose K/V came from the verifier's prefix cache were never computed and have none: features
    then start later than 0 (the drafter fills what it lacks itself). A recompute after preemption overlaps
    positions already held and adds nothing for them. Both holders trim what they have consumed to a window
    (`trim`): a store of every position grew with the sequence outside any memory budget (an EAGLE-3 head on
    a 4096-wide target: 24 KB a position)."""

    def __init__(self) -> None:
        self.start = 0
        self.end = 0
        self._chunks: list[tuple[int, torch.Tensor]] = []  # (first position, [n, hidden]), contiguous

    def add(self, position: int, hidden: torch.Tensor) -> None:  # hidden [n, hidden] at position..position+n-1
        if not self._chunks or position > self.end:  # the first ones, or a gap: what came before is no use
            self.start = self.end = position
            self._chunks = []
        skip = self.end - position
        if skip < hidden.shape[0]:
            self._chunks.append((self.end, hidden[skip:]))
            self.end += hidden.shape[0] - skip

    def trim(self, position: int) -> None:
        """Forget the features before `position`; the rest keep theirs. A reader that later wants the older
        ones (a resync, a head whose blocks were evicted) finds the store starting later, as after a prefix-cache
        hit, and fills the gap from the head's own guesses."""
        position = min(position, self.end)
        if position <= self.start:
            return
        kept = []
        for first, tensor in self._chunks:
            if first + tensor.shape[0] <= position:
                continue
            if first < position:  # a copy: a view would keep the whole chunk (a prefill's) alive
                tensor, first = tensor[position - first :].clone(), position
            kept.append((first, tensor))
        self._chunks, self.start = kept, position

    def since(self, position: int) -> tuple[int, torch.Tensor | None]:
        """(first position, features [end - first, hidden]) from `position` on, or (end, None)."""
        first = max(position, self.start)
        if first >= self.end:
            return self.end, None
        return first, self.get(first, self.end)

    def get(self, first: int, end: int) -> torch.Tensor:  # [end - first, hidden]; start <= first <= end <= .end
        """Only the chunks that overlap are joined: a step reads its newest few positions, not the history."""
        parts = [t[max(0, first - s) : end - s] for s, t in self._chunks if s < end and s + t.shape[0] > first]
        return parts[0] if len(parts) == 1 else torch.cat(parts)
