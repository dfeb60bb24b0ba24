"""Drafting with an EAGLE head (shared/model/eagle.py) fed by the target's features.

Per sequence the head's paged KV cache holds positions 0..num_done-1, built from the target's real
features (sent by the verifier with the committed tokens) or, where the verifier has none (its prefix
cache served those positions), from the head's own predictions. Each request first catches the head up
on the newly committed positions (one forward for the whole batch), then drafts k tokens autoregressively
on predicted features (one forward per draft position), and the next request rolls the draft positions
back. Drafts never affect what the verifier emits: a poor feature only costs acceptance.

The head's prefix cache is keyed on token pairs: the K/V of head position j depends on tokens 0..j+1.

A sequence with a format (structured output) drafts from the head's distribution masked to the tokens its
grammar allows at each position (proposer_service/draft_grammar.py); a drafted end-of-sequence ends it, and
so does a position where the head's vocabulary subset holds no allowed token.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from proposer_service.draft_grammar import DraftWalk, draft_walk
from proposer_service.paged_drafter import PagedDrafter, draft_generator, stack_supports
from shared.drafting import Draft, DraftRequest, FeatureStore
from shared.grammar import GrammarCompiler, GrammarMatcher
from shared.kv.block_manager import BlockManager
from shared.kv.cache import KVCache
from shared.model.attention import SeqSpan, build_metadata
from shared.model.eagle import EagleHead
from shared.sampling import logits_to_probs, params_to_tensors
from shared.seeded import gumbel_argmax, gumbel_noise

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

    # ---- Drafter protocol ------------------------------------------------------------------------

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts: dict[str, Draft] = {}
        active: list[tuple[DraftRequest, list[int]]] = []
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
            if self._can_draft(req, tokens, in_request):
                active.append((req, tokens))
                matchers.append(matcher)
            else:
                drafts[req.seq_id] = Draft(req.seq_id, req.committed_len, [])
        if active:
            self._catch_up(active)
            with draft_walk(self.grammar, matchers) as walk:
                for draft in self._draft([req for req, _ in active], walk):
                    drafts[draft.seq_id] = draft
        return [drafts[req.seq_id] for req in requests]

    # ---- state ----------------------------------------------------------------------------------

    def _can_draft(self, req: DraftRequest, tokens: list[int], in_request: set[str]) -> bool:
        if not self._take_features(req) or req.k <= 0:
            return False
        if self.states[req.seq_id].features.end == 0:  # the verifier sends none: nothing to draft from
            return False
        return self._prepare(req, tokens, in_request)

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
        if features.dim() != 2 or features.shape[1] != self.head.arch.hidden_size:
            return False
        if req.feature_start < 0 or req.feature_start + features.shape[0] > req.committed_len - 1:
            return False
        state.features.add(req.feature_start, features.float())
        return True

    def _forget(self, seq_id: str) -> None:
        self._drop_cache(seq_id)
        del self.states[seq_id]

    def _prepare(self, req: DraftRequest, tokens: list[int], in_request: set[str]) -> bool:
        """Pick up cached head blocks on first contact and reserve room for catch-up and drafts."""
        state = self.states[req.seq_id]
        keys = _pair_keys(tokens)  # head position j <-> (t_j, t_{j+1})
        if state.num_done == 0 and not self.blocks.has_seq(req.seq_id):
            # Leave the last position to compute: its output is the first draft's feature.
            match = self.blocks.match_prefix(keys[: len(keys) - 1], state.tenant)
            if match.blocks:
                state.num_done = state.num_exact = self.blocks.allocate_prefix(req.seq_id, match)
        if self.blocks.has_seq(req.seq_id):
            self.blocks.rollback(req.seq_id, min(state.num_done, self.blocks.num_tokens(req.seq_id)))
            self.blocks.cache_full_blocks(req.seq_id, keys, state.num_exact, state.tenant)
        # catch-up to position len(tokens) - 2, then k - 1 draft positions
        if not self._reserve(req.seq_id, len(tokens) - 1 + req.k - 1, keep=in_request):
            self._drop_cache(req.seq_id)
            return False
        return True

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

    def _forward(self, rows: list[tuple[str, int, torch.Tensor, list[int]]]) -> list[torch.Tensor]:
        """rows: (seq_id, first position, features [n, hidden], next token ids [n]) -> outputs [n, hidden]."""
        spans = [SeqSpan(self.blocks.block_table(seq_id), start, len(ids)) for seq_id, start, _, ids in rows]
        meta = build_metadata(spans, self.kv_cache.block_size, self.head.fc_weight.device)
        features = torch.cat([f for _, _, f, _ in rows])  # [T, hidden]
        next_ids = torch.tensor([t for *_, ids in rows for t in ids], dtype=torch.int64)
        hidden = self.head(features, next_ids, self.kv_cache.layers, meta)  # [T, hidden]
        return list(hidden.split([len(ids) for *_, ids in rows]))

    def _catch_up(self, active: list[tuple[DraftRequest, list[int]]]) -> None:
        """Bring every sequence's head to position len(tokens) - 2: real features in one batched forward,
        positions without one filled one at a time from the head's own guess."""
        batch = []
        for req, tokens in active:
            state, end = self.states[req.seq_id], len(tokens) - 1
            self._fill(req.seq_id, tokens, min(end, max(state.num_done, state.features.start)))
            real_end = min(end, state.features.end)
            if state.num_done < real_end:
                feats = state.features.get(state.num_done, real_end)
                batch.append((req.seq_id, state.num_done, feats, tokens[state.num_done + 1 : real_end + 1]))
        for (seq_id, start, _, ids), out in zip(batch, self._forward(batch) if batch else [], strict=True):
            state = self.states[seq_id]
            if state.num_exact == start:
                state.num_exact = start + len(ids)
            state.num_done, state.last_hidden = start + len(ids), out[-1]
        for req, tokens in active:
            self._fill(req.seq_id, tokens, len(tokens) - 1)

    def _fill(self, seq_id: str, tokens: list[int], end: int) -> None:
        """Positions num_done..end-1 from predicted features, one at a time (the first from zeros if nothing
        precedes); of a long gap all but the last MAX_SEQUENTIAL_FILL positions in one forward from zeros."""
        state = self.states[seq_id]
        bulk_end = end - MAX_SEQUENTIAL_FILL
        if state.num_done < bulk_end:
            zeros = self.head.fc_bias.new_zeros(bulk_end - state.num_done, self.head.arch.hidden_size)
            (out,) = self._forward([(seq_id, state.num_done, zeros, tokens[state.num_done + 1 : bulk_end + 1])])
            state.num_done, state.last_hidden = bulk_end, out[-1]
        while state.num_done < end:
            guess = (
                state.last_hidden
                if state.last_hidden is not None
                else self.head.fc_bias.new_zeros(self.head.arch.hidden_size)
            )
            (out,) = self._forward([(seq_id, state.num_done, guess.unsqueeze(0), [tokens[state.num_done + 1]])])
            state.num_done, state.last_hidden = state.num_done + 1, out[-1]

    def _draft(self, reqs: list[DraftRequest], walk: DraftWalk) -> list[Draft]:
        states = [self.states[req.seq_id] for req in reqs]
        guesses = [s.last_hidden for s in states]  # each: predicted feature at the first draft's position
        assert all(g is not None for g in guesses)
        out_ids: list[list[int]] = [[] for _ in reqs]
        out_probs: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in reqs]
        ended = [False] * len(reqs)  # the format ended the draft early
        for step in range(max(req.k for req in reqs)):
            rows = [i for i, req in enumerate(reqs) if req.k > step and not ended[i]]
            if not rows:
                break
            if step:
                forward_rows = [
                    (reqs[i].seq_id, states[i].num_done + step - 1, guesses[i].unsqueeze(0), [out_ids[i][-1]])  # type: ignore[union-attr]
                    for i in rows
                ]
                for i, out in zip(rows, self._forward(forward_rows), strict=True):
                    guesses[i] = out[-1]
            logits = self.head.compute_logits(torch.stack([guesses[i] for i in rows]))  # type: ignore[misc]
            logits, rows = walk.mask(logits, rows, ended, self.head.vocab_subset)
            for i, (token, support) in zip(
                rows, self._sample(logits, [reqs[i] for i in rows], [states[i] for i in rows], step), strict=True
            ):
                keep, draft_on = walk.advance(i, token)
                ended[i] = not draft_on
                if not keep:
                    continue
                out_ids[i].append(token)
                if support is not None:
                    out_probs[i].append(support)
        return [
            Draft(req.seq_id, req.committed_len, ids, stack_supports(probs) if probs else None)
            for req, ids, probs in zip(reqs, out_ids, out_probs, strict=True)
        ]

    def _sample(self, logits: torch.Tensor, reqs: list[DraftRequest], states: list[_SeqState], step: int):
        """logits [rows, draft_vocab] over the subset -> (token id, sparse support or None) per row."""
        subset = self.head.vocab_subset
        params = [req.params for req in reqs]
        if all(p.is_greedy for p in params):
            for index in logits.argmax(dim=-1).tolist():
                yield int(subset[index]), None
            return
        probs = logits_to_probs(logits, **params_to_tensors(params))  # [rows, draft_vocab]
        for row_probs, req, state in zip(probs, reqs, states, strict=True):
            p = req.params
            if p.is_greedy:
                yield int(subset[row_probs.argmax()]), None
                continue
            if p.seed is not None:
                # The target's noise at this output position, read at the subset's token ids; the verifier
                # accepts exactly what it would emit and reads no draft probabilities.
                noise = gumbel_noise(p.seed, [req.draft_position + step], self.vocab_size)[:, subset.cpu()]
                yield int(subset[gumbel_argmax(row_probs.unsqueeze(0), noise)[0]]), None  # noise: [1, draft_vocab]
                continue
            # The head's distribution is zero outside the subset; truncate to top_n and send exactly that.
            top_probs, top_index = row_probs.topk(min(self.top_n, row_probs.shape[-1]))
            top_probs, top_ids = (top_probs / top_probs.sum()).cpu(), subset[top_index].cpu()
            choice = torch.multinomial(top_probs, 1, generator=state.generator)
            yield int(top_ids[choice]), (top_ids, top_probs)


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
) -> EagleDrafter:
    """The head from its folder, with the target's embedding and LM head [vocab, hidden] (only those tensors)."""
    from shared.model.eagle import build_head

    head, _ = build_head(head_dir, target_embedding, target_lm_head, device)
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
        arch.num_layers, num_blocks, block_size, arch.num_kv_heads, arch.head_dim, weight.dtype, weight.device
    )
    return EagleDrafter(head, cache, BlockManager(num_blocks, block_size, enable_prefix_caching), top_n, grammar)
