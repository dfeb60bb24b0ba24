"""Drafting ahead: while the verifier scores round t, the proposer drafts round t + 1 for the likely outcomes
of that verification, and answers the next request from this speculation cache when its tokens match.

An outcome of a chain d_1..d_k is what the verifier will commit: the first j drafts and then the target's own
token, which differs from d_{j+1}; the drafter's next best candidates at position j + 1 are the guesses, ranked
by their probability: d_1..d_j accepted (each at the acceptance rate measured on this proposer's own past
rounds), d_{j+1} rejected and the candidate the target's token (its share of the drafter's probability left once
d_{j+1} is out). A chain accepted whole is followed by the target's token, guessed by one drafter step after d_k. The
`ahead` best outcomes of every sequence are drafted as if committed, under an alias sequence: a full resend of
the committed tokens plus the outcome (the drafter's prefix cache holds the committed part), k as last asked.
An EAGLE head drafts them from its own predicted features for the outcome's positions (the verifier has not
computed those yet); the real ones are ingested when the sequence's next request arrives.

Entries are keyed by (sequence, committed length, the outcome's tokens) and kept with the round's k, tree size
and sampling parameters; a request that differs in any of them misses and is drafted on demand, as without the
cache. A hit costs the verifier nothing but the round trip. Drafts from the cache are verified like any other:
exactness does not depend on which draft comes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from shared.drafting import Draft, DraftRequest


@dataclass(frozen=True)
class Candidates:
    """A chain draft's per-position guesses: the drafter's most likely tokens at each drafted position and their
    probabilities (the position's own token first when the draft was greedy); one position more than the draft
    when drafting ahead guessed the token after a chain accepted whole."""

    token_ids: list[list[int]]
    probs: list[list[float]]


@dataclass(frozen=True)
class Entry:
    committed_len: int  # of the sequence once the outcome is committed
    request: DraftRequest  # the round t request the entry answers the successor of (k, tree, params)
    draft: Draft
    candidates: Candidates  # the draft's own per-position guesses: what the round after drafts ahead from


@dataclass
class AheadStats:
    hits: int = 0
    misses: int = 0  # requests that drafted on demand while drafting ahead was on
    drafted: int = 0  # draft tokens drafted ahead
    used: int = 0  # of which returned from the cache

    @property
    def wasted(self) -> int:
        return self.drafted - self.used


@dataclass
class SpeculationCache:
    ahead: int  # outcomes drafted per sequence per round (0: off)
    entries: dict[str, dict[tuple[int, ...], Entry]] = field(default_factory=dict)
    stats: AheadStats = field(default_factory=AheadStats)
    last_chains: dict[str, list[int]] = field(default_factory=dict)  # per sequence: the chain it was last sent
    verified: int = 1  # draft positions the verifier decided (prior: one, half accepted)
    accepted: float = 0.5

    @property
    def acceptance(self) -> float:
        return self.accepted / self.verified

    def observe(self, req: DraftRequest) -> None:
        """Count how much of the sequence's last chain the verifier accepted (its committed tokens begin with the
        accepted drafts): the acceptance rate that ranks outcomes."""
        chain = self.last_chains.pop(req.seq_id, None)
        if chain is None or req.committed_len == len(req.new_token_ids):
            return
        num_accepted = 0
        for drafted, committed in zip(chain, req.new_token_ids, strict=False):
            if drafted != committed:
                break
            num_accepted += 1
        self.verified += min(len(chain), num_accepted + 1)
        self.accepted += num_accepted

    def outcomes(self, draft: Draft, candidates: Candidates) -> list[list[int]]:
        """The `ahead` most likely outcomes of verifying a chain draft (token lists the verifier would commit)."""
        scored: list[tuple[float, list[int]]] = []
        prefix_prob, acceptance = 1.0, self.acceptance
        for j, (ids, probs) in enumerate(zip(candidates.token_ids, candidates.probs, strict=False)):
            drafted = draft.token_ids[j] if j < len(draft.token_ids) else None  # None: the bonus position
            drafted_prob = next((p for t, p in zip(ids, probs, strict=True) if t == drafted), 0.0)
            rejected = (1.0 - acceptance) / max(1.0 - drafted_prob, 1e-6) if drafted is not None else 1.0
            for token, prob in zip(ids, probs, strict=True):
                if token != drafted:
                    scored.append((prefix_prob * rejected * prob, [*draft.token_ids[:j], token]))
            if drafted is None:
                break
            prefix_prob *= acceptance
        scored.sort(key=lambda item: -item[0])
        return [outcome for _, outcome in scored[: self.ahead]]

    def store(
        self, seq_id: str, request: DraftRequest, outcome: list[int], draft: Draft, candidates: Candidates
    ) -> None:
        committed = request.committed_len + len(outcome)
        self.entries.setdefault(seq_id, {})[tuple(outcome)] = Entry(committed, request, draft, candidates)
        self.stats.drafted += len(draft.token_ids)

    def lookup(self, req: DraftRequest) -> Entry | None:
        """The cache entry answering this request (its draft renamed for it), or None. Only a delta of exactly
        one drafted-ahead outcome, asked with the same k, tree size and sampling parameters, hits."""
        entries = self.entries.pop(req.seq_id, None)  # a round's entries answer one request at most
        if entries is None or req.k <= 0 or req.committed_len == len(req.new_token_ids):
            return None
        entry = entries.get(tuple(req.new_token_ids))
        if entry is None or entry.committed_len != req.committed_len or not _same_round(entry.request, req):
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.used += len(entry.draft.token_ids)
        return replace(entry, draft=replace(entry.draft, seq_id=req.seq_id, committed_len=req.committed_len))

    def release(self, seq_id: str) -> None:
        self.entries.pop(seq_id, None)
        self.last_chains.pop(seq_id, None)


def _same_round(asked: DraftRequest, now: DraftRequest) -> bool:
    return (asked.k, asked.max_tree_nodes, asked.params) == (now.k, now.max_tree_nodes, now.params)


def top_candidates(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, vocab] logits -> ([rows, width] indices, [rows, width] probabilities) of the most likely tokens."""
    probs = torch.softmax(logits.float(), dim=-1)
    top = probs.topk(min(width, probs.shape[-1]), dim=-1)
    return top.indices, top.values
