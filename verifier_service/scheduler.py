"""Continuous batching: which sequences run this step, how many tokens each feeds, and its draft length.

Every sequence is in one state: its committed tokens, of which the first `num_computed` are in the
cache. A step feeds the uncomputed ones (a prefill chunk, or the single newest token when decoding)
plus `k` draft tokens when the feed reaches the end. When blocks run out, draft lengths drop to 0
first, then the newest sequences are preempted: their blocks are freed and they are recomputed later
from their committed tokens, which leaves their output unchanged.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from shared.kv.block_manager import BlockManager
from verifier_service.sequence import Sequence
from verifier_service.spec_policy import CostRatio, ScoringCost, best_draft_length


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    num_speculative_tokens: int = 0
    adaptive_k: bool = False
    probe_interval: int = 16


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_feed: int  # committed tokens fed this step
    k: int  # draft tokens scored after them (only when the feed reaches the end)

    @property
    def samples(self) -> bool:
        return self.seq.num_computed + self.num_feed == len(self.seq.tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.cost_ratio = CostRatio()  # measured by the engine
        self.scoring_cost = ScoringCost()  # measured by the engine

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq not in self.running:  # preempted while making room for an older sequence
                continue
            item = self._schedule_running(seq, budget)
            if item is not None:
                scheduled.append(item)
                budget -= item.num_feed + item.k
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            item = self._admit(self.waiting[0], budget)
            if item is None:
                break
            self.running.append(self.waiting.popleft())
            scheduled.append(item)
            budget -= item.num_feed
        return scheduled

    def draft_length(self, seq: Sequence) -> int:
        """k for a sequence about to decode: never past the context limit or the tokens it may still emit."""
        remaining_output = seq.params.max_tokens - len(seq.output_ids)
        room = self.config.max_model_len - len(seq.tokens)
        k_cap = self.config.num_speculative_tokens
        if seq.max_draft_tokens is not None:
            k_cap = min(k_cap, seq.max_draft_tokens)
        k_max = max(0, min(k_cap, remaining_output - 1, room - 1))
        if not self.config.adaptive_k or k_max == 0:
            return k_max
        cost = self.cost_ratio.value + self.scoring_cost.per_draft(len(self.running))
        k = best_draft_length(seq.acceptance.alpha, k_max, cost)
        if k > 0:
            seq.acceptance.steps_at_zero = 0
            return k
        seq.acceptance.steps_at_zero += 1
        return 1 if seq.acceptance.steps_at_zero % self.config.probe_interval == 0 else 0

    def _schedule_running(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        num_feed = min(seq.num_uncomputed, budget)
        if num_feed <= 0:
            return None
        k = self.draft_length(seq) if num_feed == seq.num_uncomputed else 0
        k = min(k, budget - num_feed)
        for draft_len in dict.fromkeys((k, 0)):  # under memory pressure drafting goes first
            if self._reserve(seq, seq.num_computed + num_feed + draft_len):
                return ScheduledSeq(seq, num_feed, draft_len)
        while not self._reserve(seq, seq.num_computed + num_feed):
            victim = max(self.running, key=lambda s: s.arrival)
            self._preempt(victim)
            if victim is seq:
                return None
        return ScheduledSeq(seq, num_feed, 0)

    def _admit(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        num_feed = min(seq.num_uncomputed, budget)
        # Admit only if the whole sequence fits now, so a new arrival cannot trigger preemption loops.
        if self.blocks.blocks_needed(seq.seq_id, len(seq.tokens) + 1) > self.blocks.num_free_blocks:
            return None
        if not self._reserve(seq, seq.num_computed + num_feed):
            return None
        return ScheduledSeq(seq, num_feed, 0)

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        if not self.blocks.can_reserve(seq.seq_id, num_tokens):
            return False
        pairs = self.blocks.reserve(seq.seq_id, num_tokens)
        assert not pairs, "sequences never share blocks without prefix caching"
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
