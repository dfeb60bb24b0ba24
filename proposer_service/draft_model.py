"""Drafting with a small causal LM over its own paged KV cache.

Per sequence the draft cache holds the committed tokens plus the draft tokens fed last round; each
request rolls it back to the longest prefix still valid (rejected drafts are dropped), then all
sequences are drafted together: one forward per draft position for the whole batch, the first one also
catching each sequence up on its newly committed tokens (a prefill on first contact).

The draft cache uses the same automatic prefix caching as the verifier (shared/kv/block_manager.py):
a sequence seen for the first time (a new turn of a conversation, a prompt with a known system
prompt) starts from the cached blocks matching its committed tokens, and the full blocks of
committed tokens are registered each round and when a sequence is released or its cache dropped.
Draft tokens never enter the cache: only the prefix that equals the committed tokens is registered.

A long catch-up (a new long prompt, a full resend) runs in chunks of CATCH_UP_CHUNK tokens before the
first draft position, as the verifier's chunked prefill does: one forward over thousands of tokens would
pad every other sequence of the batch to its length.

A sequence with a format (structured output) drafts from the draft model's distribution masked to the tokens
its grammar allows at each position (proposer_service/draft_grammar.py); a drafted end-of-sequence ends it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from proposer_service.draft_grammar import DraftWalk, draft_walk
from proposer_service.paged_drafter import PagedDrafter, common_prefix, draft_generator, stack_supports
from shared.drafting import Draft, DraftRequest
from shared.grammar import GrammarCompiler, GrammarMatcher
from shared.kv.block_manager import BlockManager
from shared.model.runner import ForwardItem, ModelRunner
from shared.sampling import logits_to_probs, params_to_tensors
from shared.seeded import seeded_tokens

CATCH_UP_CHUNK = 512
# Tokens fed per catch-up forward, all sequences together (the verifier's max_num_batched_tokens): a proposer
# that has just restarted, or a verifier that restarted and resends every sequence whole, would otherwise feed
# 16 x 512 tokens at once; the process's memory would then grow to that step's size at some random later time.
CATCH_UP_TOKENS = 2048


@dataclass
class _SeqState:
    generator: torch.Generator
    cached: list[int] = field(default_factory=list)  # tokens whose K/V are in the draft cache, in order
    tenant: str = ""  # the prefix cache is salted with it: one tenant's blocks are never another's hit


class DraftModelDrafter(PagedDrafter[_SeqState]):
    def __init__(
        self, runner: ModelRunner, block_manager: BlockManager, top_n: int = 64, grammar: GrammarCompiler | None = None
    ) -> None:
        super().__init__(runner.cache, block_manager, top_n, grammar)
        self.runner = runner

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts: dict[str, Draft] = {}
        active: list[tuple[DraftRequest, list[int]]] = []
        matchers: list[GrammarMatcher | None] = []  # of the active sequences
        ingest: list[tuple[DraftRequest, list[int]]] = []
        in_request = {req.seq_id for req in requests}
        for req in requests:
            tokens = self.history.apply(req)
            if tokens is None:
                drafts[req.seq_id] = Draft(req.seq_id, req.committed_len, [], needs_resync=True)
                continue
            may_draft, matcher = self.grammar.update(req, tokens)
            if not may_draft:
                req = replace(req, k=0)
            prepared = self._prepare(req, tokens, in_request)
            drafts[req.seq_id] = Draft(req.seq_id, req.committed_len, [])
            if prepared and req.k > 0:
                active.append((req, tokens))
                matchers.append(matcher)
            elif prepared and req.new_token_ids:
                ingest.append((req, tokens))
        self._ingest(ingest)
        for draft in self._draft(active, matchers):
            drafts[draft.seq_id] = draft
        return [drafts[req.seq_id] for req in requests]

    def _prepare(self, req: DraftRequest, tokens: list[int], in_request: set[str]) -> bool:
        """Roll the cache back to its longest valid prefix and reserve room for this round."""
        state = self.states.get(req.seq_id)
        if state is None:
            state = self.states[req.seq_id] = _SeqState(draft_generator(req.params), tenant=req.tenant)
        if not state.cached and not self.blocks.has_seq(req.seq_id):
            # The last committed token is always fed: its logits give d_1.
            match = self.blocks.match_prefix(tokens[: len(tokens) - 1], state.tenant)
            if match.blocks:
                state.cached = list(tokens[: self.blocks.allocate_prefix(req.seq_id, match)])
        valid = min(common_prefix(state.cached, tokens), len(tokens) - 1)
        del state.cached[valid:]
        if self.blocks.has_seq(req.seq_id):
            self.blocks.rollback(req.seq_id, min(valid, self.blocks.num_tokens(req.seq_id)))
            self.blocks.cache_full_blocks(req.seq_id, tokens, valid, state.tenant)
        needed = len(tokens) + req.k - 1  # catch-up tokens plus d_1..d_{k-1} are written
        if not self._reserve(req.seq_id, needed, keep=in_request):
            self._drop_cache(req.seq_id)  # no room even after evicting idle sequences: no draft this round
            return False
        return True

    def _drop_cache(self, seq_id: str) -> None:
        """Free the sequence's draft blocks, leaving those of committed tokens in the prefix cache."""
        state = self.states[seq_id]
        committed = self.history.tokens.get(seq_id, [])
        if self.blocks.has_seq(seq_id):
            self.blocks.cache_full_blocks(seq_id, committed, common_prefix(state.cached, committed), state.tenant)
        self.blocks.free(seq_id)
        state.cached.clear()

    def _draft(
        self, active: list[tuple[DraftRequest, list[int]]], matchers: list[GrammarMatcher | None]
    ) -> list[Draft]:
        if not active:
            return []
        with draft_walk(self.grammar, matchers) as walk:
            return self._draft_walking(active, walk)

    def _draft_walking(self, active: list[tuple[DraftRequest, list[int]]], walk: DraftWalk) -> list[Draft]:
        reqs = [req for req, _ in active]
        states = [self.states[req.seq_id] for req in reqs]
        feeds = [tokens[len(state.cached) :] for (_, tokens), state in zip(active, states, strict=True)]
        # The first draft position also catches up on what is left: at most CATCH_UP_TOKENS over the batch.
        self._feed_in_chunks(reqs, states, feeds, keep=max(1, min(CATCH_UP_CHUNK, CATCH_UP_TOKENS // len(reqs))))
        out_ids: list[list[int]] = [[] for _ in reqs]
        out_probs: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in reqs]
        ended = [False] * len(reqs)  # the format ended the draft early
        for step in range(max(req.k for req in reqs)):
            rows = [i for i, req in enumerate(reqs) if req.k > step and not ended[i]]
            if not rows:
                break
            items = []
            for i in rows:
                items.append(ForwardItem(self.blocks.block_table(reqs[i].seq_id), len(states[i].cached), feeds[i], 1))
                states[i].cached.extend(feeds[i])
            logits = torch.cat(self.runner.forward(items))  # [rows, vocab]
            logits, rows = walk.mask(logits, rows, ended)
            for row, (token, support) in zip(
                rows, self._sample(logits, [reqs[i] for i in rows], states, rows, step), strict=True
            ):
                keep, draft_on = walk.advance(row, token)
                ended[row] = not draft_on
                if not keep:
                    continue
                out_ids[row].append(token)
                if support is not None:
                    out_probs[row].append(support)
                feeds[row] = [token]
        return [
            Draft(req.seq_id, req.committed_len, ids, stack_supports(probs) if probs else None)
            for req, ids, probs in zip(reqs, out_ids, out_probs, strict=True)
        ]

    def _ingest(self, rows: list[tuple[DraftRequest, list[int]]]) -> None:
        """k = 0 with new tokens (the verifier is prefilling this prompt): compute their K/V now, in chunks, so
        the first draft round finds the prompt cached instead of catching up on all of it at once. The last
        committed token stays unfed: the first draft position reads it."""
        reqs = [req for req, _ in rows]
        states = [self.states[req.seq_id] for req in reqs]
        feeds = [tokens[len(state.cached) :] for (_, tokens), state in zip(rows, states, strict=True)]
        self._feed_in_chunks(reqs, states, feeds, keep=1)

    def _feed_in_chunks(
        self, reqs: list[DraftRequest], states: list[_SeqState], feeds: list[list[int]], keep: int
    ) -> None:
        """Feed all but the last `keep` tokens of each feed, at most CATCH_UP_CHUNK per sequence and
        CATCH_UP_TOKENS in all per forward (no logits); `feeds` keep the rest."""
        while True:
            rows = [i for i, feed in enumerate(feeds) if len(feed) > keep]
            if not rows:
                return
            items = []
            budget = CATCH_UP_TOKENS
            for i in rows:
                n = min(CATCH_UP_CHUNK, len(feeds[i]) - keep, budget)
                if n <= 0:
                    break  # the next forward feeds the others
                budget -= n
                chunk, feeds[i] = feeds[i][:n], feeds[i][n:]
                items.append(ForwardItem(self.blocks.block_table(reqs[i].seq_id), len(states[i].cached), chunk, 0))
                states[i].cached.extend(chunk)
            self.runner.forward(items)

    def _sample(self, logits, reqs: list[DraftRequest], states: list[_SeqState], rows: list[int], step: int):
        params = [req.params for req in reqs]
        probs = logits_to_probs(logits, **params_to_tensors(params))  # [rows, vocab]
        for row_probs, req, row in zip(probs, reqs, rows, strict=True):
            p = req.params
            if p.is_greedy:
                yield int(row_probs.argmax()), None
                continue
            if p.seed is not None:
                # The target's noise at this output position: the verifier accepts exactly what it would emit,
                # and reads no draft probabilities, so none are sent.
                yield int(seeded_tokens(row_probs.unsqueeze(0), p.seed, [req.draft_position + step])[0]), None
                continue
            # Truncate to the top_n tokens and sample from exactly that renormalised distribution.
            top_probs, top_ids = row_probs.topk(min(self.top_n, row_probs.shape[-1]))
            # The generators are CPU generators, and the wire wants CPU tensors anyway.
            top_probs, top_ids = (top_probs / top_probs.sum()).cpu(), top_ids.cpu()
            choice = torch.multinomial(top_probs, 1, generator=states[row].generator)
            yield int(top_ids[choice]), (top_ids, top_probs)
