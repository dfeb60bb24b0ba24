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

from dataclasses import dataclass, field

import torch

from proposer_service.draft_tree import Expansion
from proposer_service.paged_drafter import PagedDrafter, common_prefix, draft_generator
from shared.drafting import DraftRequest
from shared.grammar import GrammarCompiler
from shared.kv.block_manager import BlockManager
from shared.model.attention import TreeSpec
from shared.model.runner import ForwardItem, ModelRunner

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
        self.vocab_size = runner.vocab_size
        self._feeds: dict[str, list[int]] = {}  # per active sequence: what its first draft position feeds

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
        needed = len(tokens) + self.draft_feeds(req)  # catch-up tokens plus the drafted tokens fed
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

    def _catch_up(self, active: list[tuple[DraftRequest, list[int]]], idle: list[tuple[DraftRequest, list[int]]]):
        """Idle sequences with new tokens (the verifier is prefilling this prompt, k = 0) compute their K/V now,
        in chunks, so the first draft round finds the prompt cached instead of catching up on all of it at once;
        the last committed token stays unfed. Active ones feed all but what the first draft position feeds
        (at most CATCH_UP_TOKENS over the batch)."""
        ingest = [(req, tokens) for req, tokens in idle if req.new_token_ids]
        self._feed_in_chunks(ingest, keep=1)
        feeds = self._feed_in_chunks(active, keep=max(1, min(CATCH_UP_CHUNK, CATCH_UP_TOKENS // max(1, len(active)))))
        self._feeds = {req.seq_id: feed for (req, _), feed in zip(active, feeds, strict=True)}

    def _root_logits(self, reqs: list[DraftRequest], rows: list[int]) -> torch.Tensor:  # [len(rows), vocab]
        """Feed what the catch-up left (the last committed token at least): the last row's logits give d_1."""
        items, fed = [], []
        for i in rows:
            seq_id = reqs[i].seq_id
            feed, state = self._feeds.pop(seq_id), self.states[seq_id]
            items.append(ForwardItem(self.blocks.block_table(seq_id), len(state.cached), feed, 1))
            fed.append((state, feed))
        logits = torch.cat(self.runner.forward(items))
        _now_cached(fed)
        return logits

    def _expand_logits(self, reqs: list[DraftRequest], expansions: list[Expansion]) -> torch.Tensor:
        """Each drafted token at its slot after the committed tokens; a tree node with tree attention. Tokens fed
        in a chain stay in `cached` (an accepted one is reused next round); tree nodes are overwritten."""
        items, fed = [], []
        for e in expansions:
            seq_id = reqs[e.row].seq_id
            state, base = self.states[seq_id], len(self.history.tokens[seq_id])  # base: the first draft slot
            table = self.blocks.block_table(seq_id)
            if e.in_chain:
                items.append(ForwardItem(table, base + e.index, [e.token], 1))
                fed.append((state, [e.token]))
            else:
                tree = TreeSpec(base, (base - 1 + e.depth,), (tuple(base + a for a in e.ancestors),))
                items.append(ForwardItem(table, base + e.index, [e.token], 1, tree))
        logits = torch.cat(self.runner.forward(items))
        _now_cached(fed)
        return logits

    def _feed_in_chunks(self, rows: list[tuple[DraftRequest, list[int]]], keep: int) -> list[list[int]]:
        """Feed all but the last `keep` uncached tokens of each row, at most CATCH_UP_CHUNK per sequence and
        CATCH_UP_TOKENS in all per forward (no logits); returns what each row left unfed."""
        states = [self.states[req.seq_id] for req, _ in rows]
        feeds = [tokens[len(state.cached) :] for (_, tokens), state in zip(rows, states, strict=True)]
        while True:
            pending = [i for i, feed in enumerate(feeds) if len(feed) > keep]
            if not pending:
                return feeds
            items, fed = [], []
            budget = CATCH_UP_TOKENS
            for i in pending:
                n = min(CATCH_UP_CHUNK, len(feeds[i]) - keep, budget)
                if n <= 0:
                    break  # the next forward feeds the others
                budget -= n
                chunk, feeds[i] = feeds[i][:n], feeds[i][n:]
                seq_id = rows[i][0].seq_id
                items.append(ForwardItem(self.blocks.block_table(seq_id), len(states[i].cached), chunk, 0))
                fed.append((states[i], chunk))
            self.runner.forward(items)
            _now_cached(fed)


def _now_cached(fed: list[tuple[_SeqState, list[int]]]) -> None:
    """After the forward that wrote their K/V, not before: a forward that raises must not leave `cached` claiming
    positions never written, which release and the next round would offer to the prefix cache."""
    for state, tokens in fed:
        state.cached.extend(tokens)
