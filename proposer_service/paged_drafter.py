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
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Generic, Protocol, TypeVar

import torch

from proposer_service.draft_ahead import Candidates, SpeculationCache, top_candidates
from proposer_service.draft_grammar import DraftGrammar, DraftWalk, draft_walk
from proposer_service.draft_tree import Expansion, draft_trees, grows_tree
from proposer_service.suffix_branches import SuffixBranches
from shared.drafting import Draft, DraftRequest, SequenceHistory, SparseProbs
from shared.grammar import GrammarCompiler, GrammarMatcher
from shared.kv.block_manager import BlockManager
from shared.kv.cache import KVCache
from shared.sampling import SamplingParams, logits_to_probs, params_to_tensors
from shared.seeded import gumbel_argmax, gumbel_noise

AHEAD_WIDTH = 3  # guesses kept per draft position for drafting ahead
# Where a round's time goes (the proposer's `specdec_proposer_phase_duration_seconds`): `ingest`, the tokens of
# rounds answered from the speculation cache that drafting ahead had not applied yet; `catch_up`, the drafter's
# state brought up to the committed tokens (an EAGLE head: one forward over the new positions' target features,
# the first of the round, reading weights the verifier's step pushed out of the cache); `draft`, the chains and
# trees themselves; `text`, the sequences' own text beside them (`branches`: their suffix trees brought up to date,
# the continuations found and joined; 0 without).
PHASES = ("ingest", "catch_up", "draft", "text")
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
        self.cache = SpeculationCache(0)  # drafting ahead (draft_ahead.py): off until `ahead` is set
        self.candidates: dict[str, Candidates] = {}  # per sequence: its last chain's per-position guesses
        self.ahead_width = AHEAD_WIDTH
        self._ingest: list[DraftRequest] = []  # requests answered from the cache, their tokens not yet applied
        self._no_evict = False  # while drafting ahead: never evict a real sequence's cache for an alias
        self._subset_ids: list[int] | None = None  # vocab_subset as a list, once read
        self.phase_seconds = dict.fromkeys(PHASES, 0.0)  # the last round's (`propose`), by phase
        self.branches: SuffixBranches | None = None  # the sequences' own text beside the model's guesses

    # ---- the round ------------------------------------------------------------------------------

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """One round: requests whose outcome was drafted ahead are answered from the speculation cache (their
        tokens applied later, off the critical path), the others drafted now; with `branches`, joined by the
        sequences' own text (suffix_branches.py)."""
        if self.branches is None:
            return self._round(requests)
        started, in_round = time.perf_counter(), [0.0]

        def timed_round(asked: list[DraftRequest]) -> list[Draft]:
            round_started = time.perf_counter()
            try:
                return self._round(asked)
            finally:
                in_round[0] += time.perf_counter() - round_started

        drafts = self.branches.propose(requests, timed_round)
        self.phase_seconds["text"] = time.perf_counter() - started - in_round[0]
        if self.cache.ahead:  # drafting ahead guesses outcomes of the chain sent: the text's, where it was swapped in
            for draft in drafts:
                sent = draft.token_ids
                if sent and draft.parents is None and sent != self.cache.last_chains.get(draft.seq_id):
                    self.cache.last_chains[draft.seq_id] = sent
                    self.candidates.pop(draft.seq_id, None)  # the model's guesses along its own chain
        return drafts

    def _round(self, requests: list[DraftRequest]) -> list[Draft]:
        started = time.perf_counter()
        self._apply_ingests()
        self.phase_seconds = dict.fromkeys(PHASES, 0.0)
        self.phase_seconds["ingest"] = time.perf_counter() - started
        if not self.cache.ahead:
            return self._propose_now(requests)
        hits = {}
        for req in requests:
            self.cache.observe(req)
            entry = self.cache.lookup(req)
            if entry is not None:
                hits[req.seq_id] = entry.draft
                self.candidates[req.seq_id] = entry.candidates
                self._ingest.append(replace(req, k=0, max_tree_nodes=0))
        drafted = iter(self._propose_now([req for req in requests if req.seq_id not in hits]))
        drafts = [hits[req.seq_id] if req.seq_id in hits else next(drafted) for req in requests]
        for draft in drafts:
            if draft.token_ids and draft.parents is None:
                self.cache.last_chains[draft.seq_id] = draft.token_ids
        return drafts

    def draft_ahead(self, requests: list[DraftRequest], drafts: list[Draft], stale: Callable[[], bool]) -> None:
        """After a round was answered: draft the next round for the likely outcomes of its chains (`stale()` turns
        true when the next request arrived: stop there, it is the critical path now)."""
        self._apply_ingests()
        plans = []
        for req, draft in zip(requests, drafts, strict=True):
            candidates = self.candidates.get(req.seq_id)
            if req.k <= 0 or draft.parents is not None or candidates is None or req.params.structured_output:
                continue
            tokens = self.history.tokens.get(req.seq_id)
            if tokens is not None and len(tokens) == req.committed_len:
                plans.append((req, tokens, draft, candidates))
        if not plans or stale():
            return
        self._no_evict = True
        try:
            ranked = [
                (req, tokens, self.cache.outcomes(draft, cands))
                for req, tokens, draft, cands in self._with_bonus_guesses(plans)
            ]
            for rank in range(self.cache.ahead):
                rows = [(req, tokens, outcomes[rank]) for req, tokens, outcomes in ranked if rank < len(outcomes)]
                if not rows or stale():
                    return
                self._draft_for_outcomes(rows, rank)
        finally:
            self._no_evict = False

    def _with_bonus_guesses(
        self, plans: list[tuple[DraftRequest, list[int], Draft, Candidates]]
    ) -> list[tuple[DraftRequest, list[int], Draft, Candidates]]:
        """A chain accepted whole commits the target's token after it: the drafter's guesses of that position come
        from one more step after the whole draft (one batched forward, under a second alias)."""
        full = [(req, tokens, draft) for req, tokens, draft, _ in plans if len(draft.token_ids) == req.k]
        peeks = [
            replace(
                req,
                seq_id=f"{req.seq_id}\x00peek",
                committed_len=len(tokens) + len(draft.token_ids),
                new_token_ids=[*tokens, *draft.token_ids],
                k=1,
                **self._alias_fields(req, len(draft.token_ids)),
            )
            for req, tokens, draft in full
        ]
        bonus = {}
        if peeks:
            try:
                self._propose_now(peeks)
                for (req, _, _), peek in zip(full, peeks, strict=True):
                    guesses = self.candidates.pop(peek.seq_id, None)
                    if guesses is not None and guesses.token_ids:
                        bonus[req.seq_id] = guesses
            finally:  # an alias holds state and blocks: never left behind, also when drafting fails
                self.release([peek.seq_id for peek in peeks])
        out = []
        for req, tokens, draft, cands in plans:
            extra = bonus.get(req.seq_id)
            if extra is not None:
                cands = Candidates(cands.token_ids + extra.token_ids[:1], cands.probs + extra.probs[:1])
            out.append((req, tokens, draft, cands))
        return out

    def _alias_fields(self, req: DraftRequest, num_new: int) -> dict:
        """An alias's features (what the drafter has of the real sequence) and its draft position."""
        start, features = self._alias_features(req.seq_id)
        return {"features": features, "feature_start": start, "draft_position": req.draft_position + num_new}

    def _draft_for_outcomes(self, rows: list[tuple[DraftRequest, list[int], list[int]]], rank: int) -> None:
        """Each sequence's committed tokens plus an outcome, drafted under an alias, then the alias released."""
        aliases = []
        for req, tokens, outcome in rows:
            full = [*tokens, *outcome]
            aliases.append(
                replace(
                    req,
                    seq_id=f"{req.seq_id}\x00ahead{rank}",
                    committed_len=len(full),
                    new_token_ids=full,
                    **self._alias_fields(req, len(outcome)),
                )
            )
        try:
            for (req, _, outcome), alias, draft in zip(rows, aliases, self._propose_now(aliases), strict=True):
                candidates = self.candidates.pop(alias.seq_id, None)
                if draft.token_ids and candidates is not None:
                    self.cache.store(req.seq_id, req, outcome, draft, candidates)
        finally:
            self.release([a.seq_id for a in aliases])

    def _apply_ingests(self) -> None:
        if self._ingest:
            pending, self._ingest = self._ingest, []
            self._propose_now(pending)

    def _alias_features(self, seq_id: str) -> tuple[int, torch.Tensor | None]:
        """The target features an alias of this sequence starts from (a drafter that reads them)."""
        return 0, None

    def _propose_now(self, requests: list[DraftRequest]) -> list[Draft]:
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
        started = time.perf_counter()
        self._catch_up(active, idle)
        caught_up = time.perf_counter()
        self.phase_seconds["catch_up"] += caught_up - started
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
        if active:
            self.phase_seconds["draft"] += time.perf_counter() - caught_up
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
        guesses: list[tuple[list[list[int]], list[list[float]]]] = [([], []) for _ in reqs]
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
            if self.cache.ahead:
                self._note_candidates(guesses, logits, rows)
            picks = self._sample(logits, [reqs[i] for i in rows], [states[i] for i in rows], step)
            for row, (token, support) in zip(rows, picks, strict=True):
                keep, draft_on = walk.advance(row, token)
                ended[row] = not draft_on
                if not keep:
                    continue
                out_ids[row].append(token)
                if support is not None:
                    out_probs[row].append(support)
        if self.cache.ahead:
            for req, (ids, probs) in zip(reqs, guesses, strict=True):
                self.candidates[req.seq_id] = Candidates(ids, probs)
        return [
            Draft(req.seq_id, req.committed_len, ids, stack_supports(probs) if probs else None)
            for req, ids, probs in zip(reqs, out_ids, out_probs, strict=True)
        ]

    def _note_candidates(self, guesses, logits: torch.Tensor, rows: list[int]) -> None:
        """The `ahead_width` likeliest tokens at this draft position, per row: what drafting ahead guesses from."""
        index, probs = top_candidates(logits, self.ahead_width)
        for row, ids, row_probs in zip(rows, index.tolist(), probs.tolist(), strict=True):
            guesses[row][0].append([self._token(i) for i in ids])
            guesses[row][1].append(row_probs)

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
        if self._subset_ids is None and self.vocab_subset is not None:
            self._subset_ids = self.vocab_subset.tolist()  # indexing a tensor per drafted token costs microseconds
        return index if self._subset_ids is None else self._subset_ids[index]

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
        if self._ingest:  # a cache hit's tokens not yet applied: the sequence is gone, and so is their history
            gone = set(seq_ids)
            self._ingest = [req for req in self._ingest if req.seq_id not in gone]
        if self.branches is not None:
            self.branches.release(seq_ids)
        for seq_id in seq_ids:
            self.cache.release(seq_id)
            self.candidates.pop(seq_id, None)
            if seq_id in self.states:
                self._drop_cache(seq_id)
            self.history.release(seq_id)
            self.grammar.release(seq_id)
            self.states.pop(seq_id, None)
            self.blocks.free(seq_id)

    def _reserve(self, seq_id: str, num_tokens: int, keep: set[str]) -> bool:
        """Room for `num_tokens`, evicting the caches of idle sequences (not in `keep`), oldest first."""
        while not self.blocks.can_reserve(seq_id, num_tokens):
            victims = [s for s in self.states if s not in keep and self.blocks.has_seq(s) and not self._no_evict]
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
