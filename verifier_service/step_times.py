"""What the speculation policy (`spec_policy.py`) knows of time: the verifier's own measurements of scoring per
batch size and query tokens, of propose calls and of the rest of a step (`StepTimes`), and how much slower than
their parts' medians each kind of step recently ran (`Outcomes`)."""

from __future__ import annotations

import bisect
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

# A size measured within this many seconds is estimated from those times alone; older ones count only where none
# is newer. And while a drafting plan is chosen, a plain step is run when plain decoding at the batch size was
# last measured longer ago (at most one step in this many seconds): through the gateway at 8 clients (bf16 target,
# Zen 4 host) plain steps measured during a slow minute (50-87 ms, against 36-44 ms in the target-only stack of
# the same run) made plain decoding look 1.6x dearer than it was, and the policy drafted at 0.89-0.93x target-only
# from then on without ever timing a plain step again.
FRESH_S = 5.0
# A step's parts are each timed as their median of recent times: what a step usually costs, not what it costs on
# average (the odd slow propose call, the catch-up a probe carries after plain steps). So each kind of step (plain,
# drafting, probe) per batch size is expected as much slower as its last OUTCOME_WINDOW steps ran, start to start,
# than their parts' medians said, believed as far as they outnumber OUTCOME_PRIOR
# (PROBE_PRIOR for probes). Through the gateway at 8 clients
# (bf16 target, Zen 4 host, 2026-12-05) probes at k = 1 were expected to take 30 ms and took 50 (a 19 ms catch-up
# in the propose call), plain steps 21.0 ms and 22.0.
OUTCOME_WINDOW = 64
OUTCOME_PRIOR = 16
# Drafting runs (`DraftingRuns`): an average over about the last four. Runs at a batch size are alike (at 8 clients
# on two cores, 1-3 steps each where drafting barely pays; at one client, every step of a request).
RUN_WEIGHT = 0.25
# Probes are few by design (and then each is believed sooner): at 8 clients, T = 0.8, about one a request, and
# the first ones of a fresh batch carry every prompt (8 x 40-60 tokens through the EAGLE head, 25-30 ms).
PROBE_PRIOR = 2

PLAIN, DRAFTING, PROBE = "plain", "drafting", "probe"


class StepTimes:
    """Recent times (seconds) per batch size and size (query tokens, or draft depth), fitted per batch size as a
    line through the medians (robust to the odd slow step) of each size's times of the last FRESH_S seconds, or
    all of its times where none is that recent; a batch size without a line of its own borrows the slope of the
    nearest one that has.

    Times measured before serving (`calibrate`) fill the sizes not measured since, scaled by how the live times
    compare with them where both exist: a warm-up timed on a busy machine (the other services starting beside
    it) keeps its shape but not its level, so the sizes serving never tries do not stay as dear as they were."""

    def __init__(
        self,
        window: int = 16,
        scales_with_batch: bool = True,
        stepwise: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window = window
        self.clock = clock
        # A cost that rises in steps (`stepwise`: the target's scoring; bf16 products with AMX run 16 rows at a
        # time): a batch size measured at two sizes or more is estimated from its own points, made non-decreasing
        # (isotonic), not from one line through them all. With bf16 weights in blocks of 16, at batch 8
        # 8 to 16 rows took 35-39 ms, 18 to 32 rows 59-67 ms, 34 to 48 rows 83-88 ms: a line through 8, 16, 24
        # and 40 rows put 16 at 45 ms and 24 at 58, so the plan that fills 16 rows (k = 1 for all) looked dear.
        self.stepwise = stepwise
        # A batch size measured nowhere: the nearest one's line, scaled by the batch ratio when larger (a target
        # step), or as it is (a propose call: one batched forward, its cost far from linear in the batch; a
        # guess on the cheap side drafts, is measured and corrects, one on the dear side is never tried).
        self.scales_with_batch = scales_with_batch
        self.samples: dict[int, dict[int, deque[tuple[float, float]]]] = {}  # batch -> size -> (when, seconds)
        self.calibrated: dict[int, dict[int, float]] = {}  # batch -> size -> seconds, before serving
        self._lines: dict[int, tuple[float, float] | None] = {}  # batch -> (base, per unit), cached until new data
        self._steps: dict[int, list[tuple[int, float]]] = {}  # batch -> isotonic (size, seconds), cached likewise
        # batch -> (size, seconds) where that one size is all that is known (no other batch has a line): a smaller
        # size is estimated as its share of it, the cheap side (a per-call cost would make it dearer), as a larger
        # one is by the flat line. At batch 1 (bf16 target, T = 0.8) the first propose calls were at k = 4 (6.3 ms),
        # and k = 1 looked as dear: the policy decoded plainly for a whole 128-token request at 62 tok/s where
        # drafting 2-3 tokens ran at 72-73.
        self._only: dict[int, tuple[int, float]] = {}

    def calibrate(self, batch: int, size: int, seconds: float) -> None:
        if seconds > 0:
            self.calibrated.setdefault(batch, {})[size] = seconds
            self._forget(batch)

    def add(self, batch: int, size: int, seconds: float) -> None:
        if seconds <= 0:
            return
        sizes = self.samples.setdefault(batch, {})
        sizes.setdefault(size, deque(maxlen=self.window)).append((self.clock(), seconds))
        self._forget(batch)

    def measured(self, batch: int, size: int) -> bool:
        """Measured live at this size (not only at warm-up, not a guess from other sizes)."""
        return bool(self.samples.get(batch, {}).get(size))

    def stale(self, batch: int, size: int) -> bool:
        """Measured live at this size, but not within FRESH_S seconds."""
        times = self.samples.get(batch, {}).get(size)
        return times is not None and len(times) > 0 and self.clock() - times[-1][0] > FRESH_S

    def _median(self, times: deque[tuple[float, float]]) -> tuple[float, int]:
        """The median of the times measured within FRESH_S seconds, or of all where none is that recent, and how
        many it is the median of."""
        since = self.clock() - FRESH_S
        used = [seconds for when, seconds in times if when >= since] or [seconds for _, seconds in times]
        return statistics.median(used), len(used)

    def _forget(self, batch: int) -> None:
        self._lines.pop(batch, None)
        self._steps.pop(batch, None)
        self._only.pop(batch, None)

    def estimate(self, batch: int, size: int) -> float | None:
        """The expected time, or None when nothing is known at this batch size."""
        line = self.line(batch)
        if line is None:
            return None
        only = self._only.get(batch)
        if only is not None and 0 < size < only[0]:  # one size measured: a smaller one as its share of it
            return only[1] * size / only[0]
        if self.stepwise:
            if batch not in self._steps:
                self._steps[batch] = _isotonic(self._points(batch))
            if len(self._steps[batch]) >= 2:
                return self._step_estimate(self._steps[batch], size, line[1])
        return max(0.0, line[0] + line[1] * size)

    @staticmethod
    def _step_estimate(steps: list[tuple[int, float]], size: int, slope: float) -> float:
        """Between the measured sizes (isotonic fit), a straight line from one to the next; outside them, the
        nearest one's time and the line's slope. Between two sizes a step may hide (the warm-up measures them
        close together where it matters); a guess on the cheap side is tried, measured and corrected, one on the
        dear side is never tried."""
        index = bisect.bisect_left(steps, (size, -1.0))
        if index == len(steps) or index == 0:
            nearest_size, seconds = steps[min(index, len(steps) - 1)]
            return max(0.0, seconds + slope * (size - nearest_size))
        (lower_size, lower), (upper_size, upper) = steps[index - 1], steps[index]
        return lower + (upper - lower) * (size - lower_size) / (upper_size - lower_size)

    def has_slope(self, batch: int) -> bool:
        """Measured at two sizes or more at this batch size."""
        return len(self._points(batch)) >= 2

    def slope(self, batch: int) -> float:
        line = self.line(batch)
        return line[1] if line is not None else 0.0

    def line(self, batch: int) -> tuple[float, float] | None:
        if batch not in self._lines:
            self._lines[batch] = self._fit(batch)
        return self._lines[batch]

    def _fit(self, batch: int) -> tuple[float, float] | None:
        points = self._points(batch)
        if len(points) >= 2:
            return _line(points)
        others = [b for b in {*self.samples, *self.calibrated} if b != batch and len(self._points(b)) >= 2]
        if not others:
            if points:
                self._only[batch] = points[0][:2]
            return (points[0][1], 0.0) if points else None
        nearest = min(others, key=lambda b: abs(b - batch))
        base, slope = _line(self._points(nearest))
        if points:  # this batch's own level, the neighbour's slope
            size, seconds, _ = points[0]
            return seconds - slope * size, slope
        scale = batch / nearest if batch > nearest and self.scales_with_batch else 1.0
        return base * scale, slope

    def _behind(self, batch: int) -> set[int]:
        """The sizes timed live whose newest time is older than `window` times of other sizes at this batch size."""
        sizes = {size: times for size, times in self.samples.get(batch, {}).items() if times}
        whens = sorted(when for times in sizes.values() for when, _ in times)
        return {
            size
            for size, times in sizes.items()
            if len(whens) - bisect.bisect_right(whens, times[-1][0]) >= self.window
        }

    def _points(self, batch: int) -> list[tuple[int, float, int]]:
        """Per size, its live median, or its warm-up time at the live level (the median ratio of live to warm-up
        times, over the sizes measured lately where any was); a size not measured lately (not within FRESH_S, or
        not in the last `window` times of the batch size) is the cheaper of the two. At one client (fp32 target)
        the first trees, 9 rows, took 30-35 ms against 24-26 later: those times were all the policy knew of 9 rows,
        a tree step looked 45 ms against a chain's 30, and none was drafted again to correct it; a guess on the
        cheap side is tried, measured and corrected. Within FRESH_S too: through the gateway at one client a slow
        half-second put 9 rows at 35.7 ms, the chains drafted since ran back at the old level (scoring 1 token in
        23 ms again, against 21-27), and no tree was drafted for the rest of the 4-second run.

        A size never timed live is also at most the line through the live sizes' times (where two or more were
        timed), extended to it: the warm-up's shape was not what serving saw. At one client (fp32 target, the
        other services beside it, 2026-12-07) it put 9 rows at 1.65 times one row and live trees scored at 1.3
        times; scaled to the live level, a tree step was expected at 41 ms against 26 for a chain of 3, none was
        drafted whole (the node price cut them to 3.5 nodes) and the policy ran 6-9% slower than a tree every
        step. Where the line is too cheap (rows that cross a block of the products), one step is tried and timed,
        and its own time counts from then on."""
        live = {size: self._median(t) for size, t in self.samples.get(batch, {}).items() if t}
        behind = self._behind(batch)
        fresh = {size for size in live if not self.stale(batch, size) and size not in behind}
        warm_up = self.calibrated.get(batch, {})

        def ratios(sizes) -> list[float]:
            return [live[size][0] / seconds for size, seconds in warm_up.items() if size in sizes]

        scale = statistics.median(ratios(fresh) or ratios(live) or [1.0])
        line = _line([(size, median, n) for size, (median, n) in live.items()]) if len(live) >= 2 else None
        points = [
            (size, seconds * scale if line is None else min(seconds * scale, max(0.0, line[0] + line[1] * size)), 1)
            for size, seconds in warm_up.items()
            if size not in live
        ]
        for size, (median, n) in live.items():
            if size not in fresh and size in warm_up:
                median = min(median, warm_up[size] * scale)
            points.append((size, median, n))
        return points


def _isotonic(points: list[tuple[int, float, int]]) -> list[tuple[int, float]]:
    """(size, seconds) by size, made non-decreasing by pooling adjacent violators (weighted by their counts): a
    noisy point between two sizes does not make a larger size look cheaper than a smaller one."""
    blocks: list[list[float]] = []  # [seconds, weight, number of sizes pooled]
    ordered = sorted(points)
    for _, seconds, weight in ordered:
        blocks.append([seconds, float(weight), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            top = blocks.pop()
            below = blocks[-1]
            total = below[1] + top[1]
            below[0] = (below[0] * below[1] + top[0] * top[1]) / total
            below[1], below[2] = total, below[2] + top[2]
    values = [seconds for seconds, _, count in blocks for _ in range(int(count))]
    return [(size, value) for (size, _, _), value in zip(ordered, values, strict=True)]


def _line(points: list[tuple[int, float, int]]) -> tuple[float, float]:
    total = sum(w for _, _, w in points)
    mean_x = sum(x * w for x, _, w in points) / total
    mean_y = sum(y * w for _, y, w in points) / total
    var = sum(w * (x - mean_x) ** 2 for x, _, w in points)
    slope = max(0.0, sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points) / var) if var else 0.0
    return mean_y - slope * mean_x, slope


class Outcomes:
    """Per batch size and kind of step, how long steps took against how long they were expected to take. Probes
    are kept apart from chosen drafting plans: a probe follows a run of plain steps, and its propose call carries
    their tokens (a catch-up) unless the proposer followed them."""

    def __init__(self, window: int = OUTCOME_WINDOW) -> None:
        self.window = window
        self.steps: dict[tuple[int, str], deque[tuple[float, float]]] = {}  # (expected, realised seconds)
        self._slowdowns: dict[tuple[int, str], float] = {}

    def add(self, batch: int, kind: str, expected_s: float, realised_s: float) -> None:
        if expected_s <= 0 or realised_s <= 0:
            return  # nothing was expected yet
        self.steps.setdefault((batch, kind), deque(maxlen=self.window)).append((expected_s, realised_s))
        self._slowdowns.clear()  # a probe's leans on drafting steps'

    def slowdown(self, batch: int, kind: str) -> float:
        """Realised over expected seconds, a ratio of sums (a slow step counts for what it cost), drawn towards
        1 while few steps were seen (a few may be a slow moment's; a probe's towards drafting steps')."""
        key = (batch, kind)
        if key not in self._slowdowns:
            prior = self.slowdown(batch, DRAFTING) if kind == PROBE else 1.0
            steps = self.steps.get(key, ())
            if not steps:
                return prior
            ratio = sum(realised for _, realised in steps) / sum(expected for expected, _ in steps)
            trust = len(steps) / (len(steps) + (PROBE_PRIOR if kind == PROBE else OUTCOME_PRIOR))
            self._slowdowns[key] = min(4.0, max(0.5, prior + trust * (ratio - prior)))
        return self._slowdowns[key]


class DraftingRuns:
    """Per batch size, how many steps in a row drafting plans ran (probes and plain steps end a run): the steps a
    catch-up is paid back over. A run counts at the batch size it started at, for at most `cap` steps; a size
    where no run ended yet expects `cap`. The expectation is an average over about the last 1 / RUN_WEIGHT runs."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.expected: dict[int, float] = {}
        self._run: tuple[int, int] | None = None  # (batch it started at, steps so far)

    def add(self, batch: int, drafting: bool) -> None:
        """One decode step: `drafting` when it ran a drafting plan (not a probe)."""
        if drafting:
            start, steps = self._run or (batch, 0)
            self._run = (start, steps + 1)
            return
        if self._run is not None:
            start, steps = self._run
            self._run = None
            seen = self.expected.get(start)
            length = min(steps, self.cap)
            self.expected[start] = length if seen is None else seen + RUN_WEIGHT * (length - seen)

    def steps(self, batch: int) -> float:
        return self.expected.get(batch, float(self.cap))


@dataclass(frozen=True)
class StepCost:
    """A decode step's emitted tokens and its time in parts (seconds): expected, or as it ran."""

    tokens: float
    scoring: float  # the target's forward and verification
    propose: float  # the propose call on the critical path
    rest: float  # from verification to the next step's start

    @property
    def seconds(self) -> float:
        return self.scoring + self.propose + self.rest
