"""Adaptive draft length: draft only as far as it pays.

With per-token acceptance rate `alpha` and a draft position costing `cost_ratio` of a target forward,
a round with k drafts emits (1 - alpha^(k+1)) / (1 - alpha) tokens on average for 1 + k * cost_ratio
target-forward units (Leviathan et al. 2023, eq. 1 and theorem 3.8). The policy picks the k that
maximises that ratio per sequence; k = 0 (plain decoding) wins when the draft is weak. A sequence at
k = 0 learns nothing about its acceptance, so every `probe_interval` steps it drafts once at k = 1
(all such sequences on the same step, so the drafter runs once per interval for all of them).

A draft position costs twice: the drafter's time to propose it (`CostRatio`) and the target's time to
score one more query token (`ScoringCost`). The paper counts only the first, because on a GPU scoring
k + 1 tokens costs about as much as scoring one; on a CPU, or at large batches, it does not, and a policy
that ignores it drafts where drafting loses.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Expected tokens per target-forward unit of a round with k drafts, relative to plain decoding."""
    tokens = k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return tokens / (1.0 + k * cost_ratio)


def best_draft_length(alpha: float, k_max: int, cost_ratio: float) -> int:
    # Ties go to the shorter draft: equal expected speed for less work.
    return max(range(k_max + 1), key=lambda k: (round(expected_speedup(alpha, k, cost_ratio), 9), -k))


@dataclass
class AcceptanceEstimate:
    """Exponential moving average of one sequence's per-token acceptance."""

    alpha: float = 0.5  # an agnostic prior: try drafting, then learn
    weight: float = 0.15

    def update(self, num_drafted: int, num_accepted: int) -> None:
        # Positions past the first rejection were never tested: they carry no evidence.
        tested = min(num_drafted, num_accepted + 1)
        for position in range(tested):
            accepted = 1.0 if position < num_accepted else 0.0
            self.alpha += self.weight * (accepted - self.alpha)


class ScoringCost:
    """The target's extra time per scored draft token, as a fraction of a step, from pure decode steps.

    Step time is modelled as base + per_token * query_tokens. Recent step times are kept per query-token
    count and the line is fitted through their medians (robust to the odd slow step); with fewer than two
    distinct counts seen there is no slope, and scoring is taken as free, the paper's assumption."""

    def __init__(self, window: int = 16, max_counts: int = 16) -> None:
        self.window = window
        self.max_counts = max_counts
        self.samples: dict[int, deque[float]] = {}  # query tokens in the step -> recent step seconds
        # The fit changes only with a new sample; the scheduler reads it once per decoding sequence per step.
        self._line: tuple[float, float] | None = None
        self._line_stale = False

    def update(self, query_tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        self._line_stale = True
        times = self.samples.pop(query_tokens, None) or deque(maxlen=self.window)
        times.append(seconds)
        self.samples[query_tokens] = times  # re-inserted: the dict's order is least recently seen first
        if len(self.samples) > self.max_counts:
            del self.samples[next(iter(self.samples))]

    def per_draft(self, num_seqs: int) -> float:
        """Extra step time when each of `num_seqs` decoding sequences scores one more draft token,
        relative to the step without drafts."""
        if self._line_stale:
            self._line, self._line_stale = self._fit(), False
        line = self._line
        if line is None or num_seqs <= 0:
            return 0.0
        base, per_token = line
        plain_step = base + per_token * num_seqs
        return per_token * num_seqs / plain_step if plain_step > 0 else 0.0

    def _fit(self) -> tuple[float, float] | None:
        if len(self.samples) < 2:
            return None
        points = [(n, statistics.median(times), len(times)) for n, times in self.samples.items()]
        total = sum(w for _, _, w in points)
        mean_n = sum(n * w for n, _, w in points) / total
        mean_t = sum(t * w for _, t, w in points) / total
        var = sum(w * (n - mean_n) ** 2 for n, _, w in points)
        per_token = max(0.0, sum(w * (n - mean_n) * (t - mean_t) for n, t, w in points) / var)
        return mean_t - per_token * mean_n, per_token


class CostRatio:
    """(time per draft position) / (time of the target's scoring forward), as the median of recent steps:
    a drafter's first round for a sequence includes its prompt prefill, an outlier a median ignores."""

    def __init__(self, window: int = 32) -> None:
        self.samples: deque[float] = deque(maxlen=window)

    @property
    def value(self) -> float:
        return statistics.median(self.samples) if self.samples else 0.0  # optimistic until measured

    def update(self, propose_seconds: float, draft_positions: int, score_seconds: float) -> None:
        if draft_positions > 0 and score_seconds > 0:
            self.samples.append(propose_seconds / draft_positions / score_seconds)
