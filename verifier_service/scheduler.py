"""Continuous batching: which sequences run this step, how many tokens each feeds, and its draft length.

Every sequence is in one state: its committed tokens, of which the first `num_computed` are in the
cache. A step feeds the uncomputed ones (a prefill chunk, or the single newest token when decoding)
plus `k` draft tokens when the feed reaches the end. When blocks run out, draft lengths drop to 0
first, then the newest sequences are preempted: their blocks are freed and they are recomputed later
from their committed tokens, which leaves their output unchanged.

Prefix caching (see shared/kv/block_manager.py): a sequence entering the batch (new, or back after
preemption) first takes the cached blocks matching its tokens and starts with `num_computed` past
them. Its last token is never taken from the cache: its logits sample the next token. The scheduler
registers a running sequence's full blocks once their tokens are committed and computed, i.e. never
a block holding draft positions, and again when a sequence leaves (finished, aborted or preempted),
so its blocks stay reusable until their space is needed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from shared.kv.block_manager import BlockManager
from verifier_service.config import EngineConfig
from verifier_service.sequence import Sequence
from verifier_service.spec_policy import Plan, SpecPolicy


@dataclass
class PrefixCacheStats:
    """Counters over admitted requests (first admission only: a recompute after preemption is not a query)."""

    query_tokens: int = 0  # prompt tokens
    hit_tokens: int = 0  # of which K/V came from the prefix cache

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_feed: int  # committed tokens fed this step
    k: int  # draft length (a tree's depth) scored after them (only when the feed reaches the end)
    tree_nodes: int = 0  # > 0: a token tree of at most this many nodes may be scored instead of a chain
    min_node_prob: float = 0.0  # a tree's nodes the drafter thinks less likely are not sent (Plan.min_node_prob)

    @property
    def draft_slots(self) -> int:
        """KV slots reserved for the draft: a chain's k tokens or a tree's nodes."""
        return max(self.k, self.tree_nodes)

    @property
    def samples(self) -> bool:
        return self.seq.num_computed + self.num_feed == len(self.seq.tokens)


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache = PrefixCacheStats()
        self.policy = SpecPolicy(config.max_tree_nodes)  # its times are measured by the engine
        self.num_steps = 0
        self._planned: tuple[frozenset[str], dict[str, Plan]] | None = None  # plan_ahead's, for the next step

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free_blocks(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        self.num_steps += 1
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        for seq in self.running:  # what the last step committed becomes reusable
            self.blocks.cache_full_blocks(seq.seq_id, seq.tokens, seq.num_computed, seq.tenant)
        plans = self._next_plans()
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq not in self.running:  # preempted while making room for an older sequence
                continue
            item = self._schedule_running(seq, budget, plans.get(seq.seq_id, Plan(0)), scheduled)
            if item is not None:
                scheduled.append(item)
                budget -= item.num_feed + item.draft_slots
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            item = self._admit(self.waiting[0], budget)
            if item is None:
                break
            self.running.append(self.waiting.popleft())
            scheduled.append(item)
            budget -= item.num_feed
        return scheduled

    def max_draft_length(self, seq: Sequence) -> int:
        """The largest k for a sequence about to decode: never past the context limit or the tokens it may still
        emit, nor past the request's own cap."""
        room = self.config.max_model_len - len(seq.tokens)
        k_cap = self.config.num_speculative_tokens
        if seq.max_draft_tokens is not None:
            k_cap = min(k_cap, seq.max_draft_tokens)
        return max(0, min(k_cap, seq.tokens_left - 1, room - 1))

    def plan_ahead(self) -> dict[str, Plan]:
        """The next step's plans, made now (the engine asks the proposer before the step starts); the next
        schedule() keeps them unless the set of sequences that may draft changed meanwhile."""
        plans = self._plans(self.num_steps + 1)
        self._planned = (frozenset(plans), plans)
        return plans

    def _next_plans(self) -> dict[str, Plan]:
        planned, self._planned = self._planned, None
        decoding = self._decoding()
        if planned is None or planned[0] != frozenset(s.seq_id for s in decoding):
            return self._plans(self.num_steps)
        # Prompts that arrived since the plan was made are added between steps: it may not catch up beside them
        if self._feeds_prompts() and any(planned[1][s.seq_id].k and self.lag(s) for s in decoding):
            return self._plans(self.num_steps)
        return planned[1]

    def lag(self, seq: Sequence) -> int:
        """The positions the sequence's next propose call would catch up (0 where it carries no more than a step's
        tokens)."""
        lag = len(seq.tokens) - seq.num_sent_to_proposer
        return lag if lag > self.config.step_tokens else 0

    def _decoding(self) -> list[Sequence]:
        return [seq for seq in self.running if seq.num_uncomputed <= self.config.max_num_batched_tokens]

    def _plans(self, step: int) -> dict[str, Plan]:
        """The draft of every sequence whose feed may reach its end at this step (a decode, or a prompt's last
        chunk): the configured k (and tree) as far as each may draft, or with adaptive k the policy's plan for the
        whole batch (spec_policy.py), varied every `probe_interval` steps so that its costs are measured at more
        than one size."""
        decoding = self._decoding()
        k_maxes = [self.max_draft_length(seq) for seq in decoding]
        if not self.config.adaptive_k:
            nodes = self.config.max_tree_nodes
            plans = [Plan(k, nodes if 1 <= k < nodes else 0) for k in k_maxes]
        else:
            vary = step % self.config.probe_interval == 0
            lags = [self.lag(s) for s in decoding]
            if self._feeds_prompts():
                # A catch-up would hold up the first tokens of the prompts this step prefills (a long prompt's own
                # last chunk too: its call would carry the prompt). At 8 clients through the gateway (co-located, Zen 4
                # host) a burst's first request drafted its first step, its prompt caught up, while the other seven
                # prompts waited: the verifier's time to first token was 154 ms against target-only's 130 (mean).
                k_maxes = [0 if lag else k for k, lag in zip(k_maxes, lags, strict=True)]
            plans = self.policy.plan(
                [(s.acceptance, k) for s, k in zip(decoding, k_maxes, strict=True)],
                vary,
                lags,
                [s.tokens_left for s in decoding],
            )
        return {seq.seq_id: plan for seq, plan in zip(decoding, plans, strict=True)}

    def _feeds_prompts(self) -> bool:
        """Whether the next step may feed a prompt (one being prefilled, or one waiting with room to be admitted):
        someone's first token waits for it."""
        if any(seq.num_uncomputed > 1 for seq in self.running):
            return True
        return bool(self.waiting) and len(self.running) < self.config.max_num_seqs

    def _schedule_running(
        self, seq: Sequence, budget: int, plan: Plan, scheduled: list[ScheduledSeq]
    ) -> ScheduledSeq | None:
        num_feed = min(seq.num_uncomputed, budget)
        if num_feed <= 0:
            return None
        k = min(plan.k, budget - num_feed) if num_feed == seq.num_uncomputed else 0
        nodes = min(plan.tree_nodes, budget - num_feed) if k else 0
        drafting = ScheduledSeq(seq, num_feed, k, *((nodes, plan.min_node_prob) if nodes > k else (0, 0.0)))
        for item in (drafting, ScheduledSeq(seq, num_feed, 0)) if drafting.draft_slots else (drafting,):
            # under memory pressure drafting goes first
            if self._reserve(seq, seq.num_computed + num_feed + item.draft_slots):
                return item
        while not self._reserve(seq, seq.num_computed + num_feed):
            if self._drop_a_draft(scheduled):
                continue
            victim = max(self.running, key=lambda s: s.arrival)
            self._preempt(victim)
            if victim is seq:
                return None
        return ScheduledSeq(seq, num_feed, 0)

    def _drop_a_draft(self, scheduled: list[ScheduledSeq]) -> bool:
        """Under memory pressure drafts go before sequences: the newest sequence scheduled with draft slots this
        step gives them back and decodes plainly. False when none has any (then a sequence is preempted)."""
        for i in reversed(range(len(scheduled))):
            item = scheduled[i]
            if item.draft_slots:
                self.blocks.rollback(item.seq.seq_id, item.seq.num_computed + item.num_feed)
                scheduled[i] = ScheduledSeq(item.seq, item.num_feed, 0)
                return True
        return False

    def _admit(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        # The last token is always fed: its logits give the first new token.
        match = self.blocks.match_prefix(seq.tokens[: len(seq.tokens) - 1], seq.tenant)  # per tenant: no probing
        # Admit only if the whole sequence fits now, so a new arrival cannot trigger preemption loops.
        if self.blocks.blocks_needed_with_prefix(match, len(seq.tokens) + 1) > self.blocks.num_free_blocks:
            return None
        seq.num_computed = self.blocks.allocate_prefix(seq.seq_id, match)
        if seq.num_cached_prompt is None:
            seq.num_cached_prompt = min(seq.num_computed, len(seq.prompt_ids))
            self.prefix_cache.query_tokens += len(seq.prompt_ids)
            self.prefix_cache.hit_tokens += seq.num_cached_prompt
        num_feed = min(seq.num_uncomputed, budget)
        if not self._reserve(seq, seq.num_computed + num_feed):  # cannot happen after the check above
            self.blocks.free(seq.seq_id)
            seq.num_computed = 0
            return None
        return ScheduledSeq(seq, num_feed, 0)

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        if not self.blocks.can_reserve(seq.seq_id, num_tokens):
            return False
        pairs = self.blocks.reserve(seq.seq_id, num_tokens)
        # Only full blocks of committed, computed tokens are shared, and a sequence never writes below
        # `num_computed`, so a write never lands in a shared or cached block.
        assert not pairs, "a step wrote into a shared or cached block"
        return True

    def _free_blocks(self, seq: Sequence) -> None:
        """Leave the sequence's committed, computed full blocks in the prefix cache, then free them."""
        self.blocks.cache_full_blocks(seq.seq_id, seq.tokens, min(seq.num_computed, len(seq.tokens)), seq.tenant)
        self.blocks.free(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free_blocks(seq)
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
