"""What the two model drafters (draft model, EAGLE head) share: per-sequence committed history and state over
a paged KV cache of their own, release, eviction of idle sequences when blocks run out, the drafter's own
sampling stream, each sequence's format (structured output), and the drafting loops themselves.

A round (`propose`): every request updates its sequence (history, format, `_prepare`: the drafter's own
state); the drafter catches its sequences up on their committed tokens (`_catch_up`); then the sequences that
draft advance together. `_root_logits` gives each row's distribution of the first draft token; feeding a
drafted token (an `Expansion`) gives the distribution after it (`_expand_logits`), batched over all rows.
- Chains: one position at a time; the format masks the logits and `_sample` picks the token (greedy, seeded with
  the target's noise, or from the top `top_n` tokens, whose exact distribution is sent).
- Trees (the verifier asked for up to `max_tree_nodes` nodes; proposer_service/draft_tree.py): the best
  `tree_width` tokens under each node, the `tree_beam` best nodes of each depth expanded, the best nodes by
  cumulative draft probability kept (EAGLE-2's dynamic tree). They are deterministic guesses: no probabilities
  are sent. Sequences with a format or a seed draft chains.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import replace
from typing import Generic, Protocol, TypeVar

import torch

from proposer_service.draft_grammar import DraftGrammar, DraftWalk, draft_walk
from proposer_service.draft_tree import Expansion, draft_trees, grows_tree
from shared.drafting import Draft, DraftRequest, SequenceHistory, SparseProbs
from shared.grammar import GrammarCompiler, GrammarMatcher
from shared.kv.block_manager import BlockManager
from shared.kv.cache import KVCache
from shared.sampling import SamplingParams, logits_to_probs, params_to_tensors
from shared.seeded import gumbel_argmax, gumbel_noise

# Offsets the drafter's stream from the verifier's, which is seeded from the same request seed.
DRAFT_SEED_OFFSET = 0x9E3779B97F4A7C15


class SeqState(Protocol):
    generator: torch.Generator  # the drafter's sampling stream for this sequence


State = TypeVar("State", bound=SeqState)


class PagedDrafter(Generic[State]):
    vocab_size: int  # the target's vocabulary: drafted ids and seeded noise live in it

    def __init__(
        self,
        kv_cache: KVCache,
        block_manager: BlockManager,
        top_n: int,
        grammar: GrammarCompiler | None = None,
        tree_width: int = 4,
        tree_beam: int = 2,
    ) -> None:
        self.kv_cache = kv_cache
        self.blocks = block_manager
        self.top_n = top_n  # sampled drafts come from the top_n tokens, and exactly that distribution is sent
        self.tree_width = tree_width  # a tree's children per expanded node
        self.tree_beam = tree_beam  # a tree's nodes expanded per depth
        self.history = SequenceHistory()
        self.states: dict[str, State] = {}
        self.grammar = DraftGrammar(grammar)  # without a compiler, sequences with a format are not drafted

    # ---- the round ------------------------------------------------------------------------------

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts: dict[str, Draft] = {}
        active: list[tuple[DraftRequest, list[int]]] = []  # draft this round
        idle: list[tuple[DraftRequest, list[int]]] = []  # prepared, k = 0: only follow the committed tokens
        matchers: list[GrammarMatcher | None] = []  # of the active sequences
        in_request = {req.seq_id for req in requests}
        for req in requests:
            tokens = self.history.apply(req)
            if tokens is None:
                drafts[req.seq_id] = Draft(req.seq_id, req.committed_len, [], needs_resync=True)
                continue
            may_draft, matcher = self.grammar.update(req, tokens)
            if not may_draft:
                req = replace(req, k=0)
            drafts[req.seq_id] = Draft(req.seq_id, req.committed_len, [])
            if not self._prepare(req, tokens, in_request):
                continue
            if req.k > 0:
                active.append((req, tokens))
                matchers.append(matcher)
            else:
                idle.append((req, tokens))
        self._catch_up(active, idle)
        grow = [grows_tree(req, matcher) for (req, _), matcher in zip(active, matchers, strict=True)]
        trees = [req for (req, _), tree in zip(active, grow, strict=True) if tree]
        chains = [(req, matcher) for (req, _), matcher, tree in zip(active, matchers, grow, strict=True) if not tree]
        if trees:
            for draft in draft_trees(self, trees):
                drafts[draft.seq_id] = draft
        if chains:
            with draft_walk(self.grammar, [matcher for _, matcher in chains]) as walk:
                for draft in self._draft([req for req, _ in chains], walk):
                    drafts[draft.seq_id] = draft
        return [drafts[req.seq_id] for req in requests]

    def draft_feeds(self, req: DraftRequest) -> int:
        """Draft tokens this round may feed into the drafter's cache: a chain's first k - 1, or the expansions
        of a tree's first k - 1 depths."""
        return max(0, req.k - 1) * (self.tree_beam if grows_tree(req, None) else 1)

    def _draft(self, reqs: list[DraftRequest], walk: DraftWalk) -> list[Draft]:
        states = [self.states[req.seq_id] for req in reqs]
        out_ids: list[list[int]] = [[] for _ in reqs]
        out_probs: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in reqs]
        ended = [False] * len(reqs)  # the format ended the draft early
        for step in range(max(req.k for req in reqs)):
            rows = [i for i, req in enumerate(reqs) if req.k > step and not ended[i]]
            if not rows:
                break
            if step == 0:
                logits = self._root_logits(reqs, rows)  # [len(rows), width]
            else:
                chain = tuple(range(step))
                logits = self._expand_logits(reqs, [Expansion(i, out_ids[i][-1], step, step - 1, chain) for i in rows])
            logits, rows = walk.mask(logits, rows, ended, self.vocab_subset)
            picks = self._sample(logits, [reqs[i] for i in rows], [states[i] for i in rows], step)
            for row, (token, support) in zip(rows, picks, strict=True):
                keep, draft_on = walk.advance(row, token)
                ended[row] = not draft_on
                if not keep:
                    continue
                out_ids[row].append(token)
                if support is not None:
                    out_probs[row].append(support)
        return [
            Draft(req.seq_id, req.committed_len, ids, stack_supports(probs) if probs else None)
            for req, ids, probs in zip(reqs, out_ids, out_probs, strict=True)
        ]

    def _sample(
        self, logits: torch.Tensor, reqs: list[DraftRequest], states: list[State], step: int
    ) -> Iterator[tuple[int, tuple[torch.Tensor, torch.Tensor] | None]]:
        """logits [rows, width] (over `vocab_subset` when there is one) -> (token id, sparse support or None)."""
        subset = self.vocab_subset
        params = [req.params for req in reqs]
        if all(p.is_greedy for p in params):
            for index in logits.argmax(dim=-1).tolist():
                yield self._token(index), None
            return
        probs = logits_to_probs(logits, **params_to_tensors(params))  # [rows, width]
        for row_probs, req, state in zip(probs, reqs, states, strict=True):
            p = req.params
            if p.is_greedy:
                yield self._token(int(row_probs.argmax())), None
                continue
            if p.seed is not None:
                # The target's noise at this output position (read at the subset's ids): the verifier accepts
                # exactly what it would emit, and reads no draft probabilities, so none are sent.
                noise = gumbel_noise(p.seed, [req.draft_position + step], self.vocab_size)  # [1, vocab]
                if subset is not None:
                    noise = noise[:, subset.cpu()]  # [1, width]
                yield self._token(int(gumbel_argmax(row_probs.unsqueeze(0), noise)[0])), None
                continue
            # Truncate to the top_n tokens and sample from exactly that renormalised distribution (zero outside a
            # subset); the generators are CPU generators, and the wire wants CPU tensors anyway.
            top_probs, top_index = row_probs.topk(min(self.top_n, row_probs.shape[-1]))
            top_ids = top_index if subset is None else subset[top_index]
            top_probs, top_ids = (top_probs / top_probs.sum()).cpu(), top_ids.cpu()
            choice = torch.multinomial(top_probs, 1, generator=state.generator)
            yield int(top_ids[choice]), (top_ids, top_probs)

    def _token(self, index: int) -> int:
        return index if self.vocab_subset is None else int(self.vocab_subset[index])

    # ---- what each drafter provides ---------------------------------------------------------------

    @property
    def vocab_subset(self) -> torch.Tensor | None:
        """The ids the logits' columns stand for, or None when column c is token c."""
        return None

    def _prepare(self, req: DraftRequest, tokens: list[int], in_request: set[str]) -> bool:
        """Follow the request's committed tokens and reserve room for this round; False: no draft this round."""
        raise NotImplementedError

    def _catch_up(self, active: list[tuple[DraftRequest, list[int]]], idle: list[tuple[DraftRequest, list[int]]]):
        """Bring the drafter's cache to each active sequence's last committed token (and idle ones as it likes)."""
        raise NotImplementedError

    def _root_logits(self, reqs: list[DraftRequest], rows: list[int]) -> torch.Tensor:  # [len(rows), width]
        """Each row's logits for the first draft token (after its last committed token)."""
        raise NotImplementedError

    def _expand_logits(self, reqs: list[DraftRequest], expansions: list[Expansion]) -> torch.Tensor:
        """[len(expansions), width]: the logits after feeding each expansion's token at its place."""
        raise NotImplementedError

    def _drop_cache(self, seq_id: str) -> None:
        """Free the sequence's blocks, leaving those that hold committed tokens exactly in the prefix cache."""
        raise NotImplementedError

    # ---- state ----------------------------------------------------------------------------------

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            if seq_id in self.states:
                self._drop_cache(seq_id)
            self.history.release(seq_id)
            self.grammar.release(seq_id)
            self.states.pop(seq_id, None)
            self.blocks.free(seq_id)

    def _reserve(self, seq_id: str, num_tokens: int, keep: set[str]) -> bool:
        """Room for `num_tokens`, evicting the caches of idle sequences (not in `keep`), oldest first."""
        while not self.blocks.can_reserve(seq_id, num_tokens):
            victims = [s for s in self.states if s not in keep and self.blocks.has_seq(s)]
            if not victims:
                return False
            self._drop_cache(victims[0])  # dicts keep insertion order
        self.kv_cache.copy_blocks(self.blocks.reserve(seq_id, num_tokens))
        return True


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def stack_supports(supports: list[tuple[torch.Tensor, torch.Tensor]]) -> SparseProbs:
    return SparseProbs(torch.stack([ids for ids, _ in supports]), torch.stack([p for _, p in supports]))


def draft_generator(params: SamplingParams) -> torch.Generator:
    seed = secrets.randbits(63) if params.seed is None else (params.seed + DRAFT_SEED_OFFSET) % (2**63)
    return torch.Generator().manual_seed(seed)
