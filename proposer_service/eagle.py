"""Drafting with an EAGLE head (shared/model/eagle.py) fed by the target's features.

Per sequence the head's paged KV cache holds positions 0..num_done-1, built from the target's real
features (sent by the verifier with the committed tokens) or, where the verifier has none (its prefix
cache served those positions), from the head's own predictions. Each request first catches the head up
on the newly committed positions (one forward for the whole batch), then drafts k tokens autoregressively
on predicted features (one forward per draft position), and the next request rolls the draft positions
back. A sequence that drafted before and now decodes plainly (k = 0, its tokens sent k at a time off the
verifier's critical path) is followed: its new positions are computed as they come, so that the round that
resumes drafting carries no stale catch-up. Drafts never affect what the verifier emits: a poor feature only
costs acceptance.

The head's prefix cache is keyed on token pairs: the K/V of head position j depends on tokens 0..j+1.

A sequence with a format (structured output) drafts from the head's distribution masked to the tokens its
grammar allows at each position (proposer_service/draft_grammar.py); a drafted end-of-sequence ends it, and
so does a position where the head's vocabulary subset holds no allowed token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from proposer_service.draft_tree import Expansion
from proposer_service.paged_drafter import PagedDrafter, draft_generator
from shared.drafting import FEATURE_WINDOW, DraftRequest, FeatureStore
from shared.grammar import GrammarCompiler
from shared.kv.block_manager import BlockManager
from shared.kv.cache import KVCache
from shared.model.attention import SeqSpan, TreeSpec, build_metadata, uses_kernel
from shared.model.eagle import EagleHead

MAX_SEQUENTIAL_FILL = 16  # gap positions filled one by one from the head's own guesses; earlier ones in bulk


@dataclass
class _SeqState:
    generator: torch.Generator
    features: FeatureStore = field(default_factory=FeatureStore)
    num_done: int = 0  # head positions in the cache (real or filled features)
    num_exact: int = 0  # leading positions built from real features only: the cacheable prefix
    last_hidden: torch.Tensor | None = None  # head output at num_done - 1: its guess of feature num_done
    tenant: str = ""  # the prefix cache is salted with it: one tenant's blocks are never another's hit


class EagleDrafter(PagedDrafter[_SeqState]):
    needs_target_features = True

    def __init__(
        self,
        head: EagleHead,
        cache: KVCache,
        block_manager: BlockManager,
        top_n: int = 64,
        grammar: GrammarCompiler | None = None,
    ) -> None:
        super().__init__(cache, block_manager, top_n, grammar)
        self.head = head
        self.vocab_size = head.arch.vocab_size
        self._fed: dict[tuple[int, int], torch.Tensor] = {}  # this round: (row, expansion index) -> head output

    @property
    def vocab_subset(self) -> torch.Tensor:
        return self.head.vocab_subset

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers the head reads: what an in-process engine keeps for it."""
        return self.head.feature_layers

    # ---- state ----------------------------------------------------------------------------------

    def _prepare(self, req: DraftRequest, tokens: list[int], in_request: set[str]) -> bool:
        """Store the request's features; then, for a request that drafts, pick up cached head blocks on first
        contact and reserve room for catch-up and drafts; for one that does not, whether it is followed now."""
        if not self._take_features(req):
            return False
        if req.k <= 0:
            return self._prepare_follow(req, tokens)
        if self.states[req.seq_id].features.end == 0:  # the verifier sends none: nothing to draft from
            return False
        return self._prepare_blocks(req, tokens, in_request)

    def _prepare_follow(self, req: DraftRequest, tokens: list[int]) -> bool:
        """A sequence that drafted before and now decodes plainly (the verifier sends its tokens k at a time, off
        its critical path) has its head caught up on their real features as they come, so that the round that
        resumes drafting computes one step's positions, not every position since it last drafted (at 8 clients,
        25-32 ms on the critical path). Never evicts: with no room, the catch-up waits for the next draft round.
        A prompt that never drafted waits too: it may never draft."""
        state = self.states[req.seq_id]
        if not self.blocks.has_seq(req.seq_id) or state.num_done < state.features.start:
            return False
        self._roll_back_drafts(req.seq_id, _pair_keys(tokens))
        end = min(len(tokens) - 1, state.features.end)
        return end > state.num_done and self._reserve(req.seq_id, end, keep=set(self.states))  # evicts no one

    def _alias_features(self, seq_id: str) -> tuple[int, torch.Tensor | None]:
        """An alias drafting ahead starts from the real features the sequence has; the outcome's positions have
        none yet, and are filled from the head's own guesses (as a prefix-cache gap is)."""
        state = self.states.get(seq_id)
        return state.features.since(0) if state is not None else (0, None)

    def _take_features(self, req: DraftRequest) -> bool:
        """Store the request's features; False (no draft) when they do not line up with its prefix."""
        if req.committed_len == len(req.new_token_ids) and req.seq_id in self.states:
            self._forget(req.seq_id)  # a full resend replaces whatever we built
        state = self.states.get(req.seq_id)
        if state is None:
            state = self.states[req.seq_id] = _SeqState(draft_generator(req.params), tenant=req.tenant)
        if req.features is None:
            return True
        features = req.features
        # A position's feature exists once the target has read its token; the last committed one is unread.
        if features.dim() != 2 or features.shape[1] != self.head.feature_width:
            return False
        if req.feature_start < 0 or req.feature_start + features.shape[0] > req.committed_len - 1:
            return False
        state.features.add(req.feature_start, features.float())
        return True

    def _forget(self, seq_id: str) -> None:
        self._drop_cache(seq_id)
        del self.states[seq_id]

    def _prepare_blocks(self, req: DraftRequest, tokens: list[int], in_request: set[str]) -> bool:
        state = self.states[req.seq_id]
        keys = _pair_keys(tokens)  # head position j <-> (t_j, t_{j+1})
        if state.num_done == 0 and not self.blocks.has_seq(req.seq_id):
            # Leave the last position with a real feature to compute: its output is the guess of the next
            # feature (the first draft's, or the first position filled without one).
            match = self.blocks.match_prefix(keys[: min(len(keys) - 1, state.features.end - 1)], state.tenant)
            if match.blocks:
                state.num_done = state.num_exact = self.blocks.allocate_prefix(req.seq_id, match)
        if self.blocks.has_seq(req.seq_id):
            self._roll_back_drafts(req.seq_id, keys)
        # catch-up to position len(tokens) - 2, then k - 1 draft positions
        if not self._reserve(req.seq_id, len(tokens) - 1 + self.draft_feeds(req), keep=in_request):
            self._drop_cache(req.seq_id)
            return False
        return True

    def _roll_back_drafts(self, seq_id: str, keys: list[int]) -> None:
        """Shrink the head's blocks to its computed positions (the last round's draft positions go) and offer
        the full blocks of exact positions to the prefix cache."""
        state = self.states[seq_id]
        self.blocks.rollback(seq_id, min(state.num_done, self.blocks.num_tokens(seq_id)))
        self.blocks.cache_full_blocks(seq_id, keys, state.num_exact, state.tenant)

    def _drop_cache(self, seq_id: str) -> None:
        """Free the head blocks, leaving those of exact positions in the prefix cache; features stay."""
        state = self.states[seq_id]
        if self.blocks.has_seq(seq_id):
            keys = _pair_keys(self.history.tokens.get(seq_id, []))
            self.blocks.cache_full_blocks(seq_id, keys, min(state.num_exact, len(keys)), state.tenant)
        self.blocks.free(seq_id)
        state.num_done = state.num_exact = 0
        state.last_hidden = None

    # ---- forwards -------------------------------------------------------------------------------

    def _forward(self, rows: list) -> list[torch.Tensor]:
        """rows: (seq_id, first position, head inputs g [n, hidden] (fused real features or the head's own
        states), next token ids [n][, tree spec]) -> the head's states [n, hidden]; without a tree the
        positions are causal from the first."""
        spans = [SeqSpan(self.blocks.block_table(row[0]), row[1], len(row[3]), *row[4:]) for row in rows]
        # For the cpu kernel only its rows: the masks and per-call groups of the other backends were built here and
        # never read (0.1 ms of a 0.8 ms draft forward at one sequence)
        kernel = uses_kernel(self.head.backend)
        meta = build_metadata(spans, self.kv_cache.block_size, self.head.fc_weight.device, kernel=kernel)
        features = torch.cat([row[2] for row in rows])  # [T, hidden]
        next_ids = torch.tensor([t for row in rows for t in row[3]], dtype=torch.int64, device=features.device)
        hidden = self.head(features, next_ids, self.kv_cache.layers, meta)  # [T, hidden]
        return list(hidden.split([len(row[3]) for row in rows]))

    def _catch_up(self, active: list[tuple[DraftRequest, list[int]]], idle: list[tuple[DraftRequest, list[int]]]):
        """Bring every active sequence's head to position len(tokens) - 2: real features in one batched forward,
        positions without one filled from the head's own guesses (`_fill`). Idle ones that `_prepare_follow` kept
        go as far as their real features in the same forward."""
        gaps = []  # positions before the first real feature: a prefix the verifier's cache served
        for req, tokens in active:
            state = self.states[req.seq_id]
            gaps.append((req.seq_id, tokens, min(len(tokens) - 1, max(state.num_done, state.features.start))))
        self._fill(gaps)
        batch = []
        for req, tokens in [*active, *idle]:
            state = self.states[req.seq_id]
            real_end = min(len(tokens) - 1, state.features.end)
            if state.num_done < real_end:
                feats = self.head.fuse_features(state.features.get(state.num_done, real_end))  # [n, hidden]
                batch.append((req.seq_id, state.num_done, feats, tokens[state.num_done + 1 : real_end + 1]))
        for (seq_id, start, _, ids), out in zip(batch, self._forward(batch) if batch else [], strict=True):
            state = self.states[seq_id]
            if state.num_exact == start:
                state.num_exact = start + len(ids)
            state.num_done, state.last_hidden = start + len(ids), out[-1]
            # The head's K/V holds what came before; only what its prefix cache was offered can a draft-ahead
            # alias (or the sequence after an eviction) match instead of recomputing from these features.
            reusable = min(state.num_done, self.blocks.num_cached_tokens(seq_id))
            state.features.trim(reusable - FEATURE_WINDOW)
        self._fill([(req.seq_id, tokens, len(tokens) - 1) for req, tokens in active])

    def _fill(self, gaps: list[tuple[str, list[int], int]]) -> None:
        """Per (sequence, tokens, end): positions num_done..end-1 from predicted features, each from the one before
        (the first from zeros if nothing precedes), one position of every sequence per forward; of a long gap all
        but the last MAX_SEQUENTIAL_FILL positions in one forward from zeros. Batched over the sequences: a fresh
        batch of 8 requests whose prompts the verifier's prefix cache served had filled 16 positions each, one
        sequence after another (128 forwards, 85-135 ms in one probe's propose call at 8 clients)."""
        hidden = self.head.arch.hidden_size
        bulk = []
        for seq_id, tokens, end in gaps:
            state, bulk_end = self.states[seq_id], end - MAX_SEQUENTIAL_FILL
            if state.num_done < bulk_end:
                zeros = self.head.fc_bias.new_zeros(bulk_end - state.num_done, hidden)
                bulk.append((seq_id, state.num_done, zeros, tokens[state.num_done + 1 : bulk_end + 1]))
        for (seq_id, start, _, ids), out in zip(bulk, self._forward(bulk) if bulk else [], strict=True):
            state = self.states[seq_id]
            state.num_done, state.last_hidden = start + len(ids), out[-1]
        while True:
            rows = []
            for seq_id, tokens, end in gaps:
                state = self.states[seq_id]
                if state.num_done < end:
                    guess = state.last_hidden if state.last_hidden is not None else self.head.fc_bias.new_zeros(hidden)
                    rows.append((seq_id, state.num_done, guess.unsqueeze(0), [tokens[state.num_done + 1]]))
            if not rows:
                return
            for (seq_id, *_), out in zip(rows, self._forward(rows), strict=True):
                state = self.states[seq_id]
                state.num_done, state.last_hidden = state.num_done + 1, out[-1]

    def _root_logits(self, reqs: list[DraftRequest], rows: list[int]) -> torch.Tensor:  # [len(rows), draft_vocab]
        """The head's output at the last committed position is its guess of the next feature: d_1's logits."""
        self._fed = {}
        return self.head.compute_logits(torch.stack([self.states[reqs[i].seq_id].last_hidden for i in rows]))  # type: ignore[misc]

    def _expand_logits(self, reqs: list[DraftRequest], expansions: list[Expansion]) -> torch.Tensor:
        """The head fed a drafted token with the feature it guessed for it (its parent's output), at head position
        num_done + depth - 1, written at slot num_done + index; a tree node sees the prefix and its ancestors."""
        rows = []
        for e in expansions:
            seq_id = reqs[e.row].seq_id
            state = self.states[seq_id]
            feature = state.last_hidden if e.parent < 0 else self._fed[(e.row, e.parent)]
            assert feature is not None
            tree = None
            if not e.in_chain:
                visible = tuple(state.num_done + a for a in e.ancestors)
                tree = TreeSpec(state.num_done, (state.num_done + e.depth - 1,), (visible,))
            rows.append((seq_id, state.num_done + e.index, feature.unsqueeze(0), [e.token], tree))
        outs = self._forward(rows)
        for e, out in zip(expansions, outs, strict=True):
            self._fed[(e.row, e.index)] = out[-1]
        return self.head.compute_logits(torch.stack([out[-1] for out in outs]))


def _pair_keys(tokens: list[int]) -> list[int]:
    """One int per head position j: the pair (t_j, t_{j+1}) its K/V depends on, besides earlier ones."""
    return [a * (1 << 31) + b for a, b in zip(tokens, tokens[1:], strict=False)]


def make_eagle_drafter(
    head_dir: str,
    target_embedding: torch.Tensor,
    target_lm_head: torch.Tensor,
    num_blocks: int,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    top_n: int = 64,
    device: str = "cpu",
    grammar: GrammarCompiler | None = None,
    dtype: torch.dtype = torch.float32,
    attention_backend: str = "auto",
) -> EagleDrafter:
    """The head from its folder, with the target's embedding and LM head [vocab, hidden] (only those tensors),
    its weights and KV cache in `dtype`, attending through `attention_backend` (shared.model.eagle.build_head)."""
    from shared.model.eagle import build_head

    head, _ = build_head(head_dir, target_embedding, target_lm_head, device, dtype, attention_backend=attention_backend)
    return drafter_for_head(head, num_blocks, block_size, enable_prefix_caching, top_n, grammar)


def drafter_for_head(
    head: EagleHead,
    num_blocks: int,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    top_n: int = 64,
    grammar: GrammarCompiler | None = None,
) -> EagleDrafter:
    """A drafter with a fresh KV cache around a head already loaded (several engines can share one head)."""
    arch, weight = head.arch, head.fc_weight
    cache = KVCache(
        arch.num_layers, num_blocks, block_size, arch.num_kv_heads, arch.head_dim, head.dtype, weight.device
    )
    return EagleDrafter(head, cache, BlockManager(num_blocks, block_size, enable_prefix_caching), top_n, grammar)
