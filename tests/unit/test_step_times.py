"""The policy's measured costs (verifier_service/step_times.py): lines through medians, warm-up times scaled to
the live ones, sizes not timed lately or never timed live, estimates that never fall with the size, and how much
slower than their parts each kind of step ran."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from verifier_service import step_times
from verifier_service.step_times import DRAFTING, PLAIN, PROBE, StepTimes


def test_step_times_fit_a_line_through_medians_and_borrow_a_slope():
    times = StepTimes()
    assert times.estimate(1, 1) is None
    for q, seconds in ((1, 0.040), (1, 0.040), (1, 9.0), (5, 0.050), (5, 0.050)):  # one outlier
        times.add(1, q, seconds)
    assert times.estimate(1, 3) == pytest.approx(0.045)
    assert times.slope(1) == pytest.approx(0.0025)
    times.add(8, 8, 0.066)  # one count at batch 8: its own level, batch 1's slope
    assert times.estimate(8, 16) == pytest.approx(0.066 + 8 * 0.0025)
    assert times.estimate(4, 4) == pytest.approx(4 * 0.0375 + 4 * 0.0025)  # batch 1: its base 4 times, its slope
    calls = StepTimes(scales_with_batch=False)  # a propose call: one batched forward, not batch times one
    calls.add(1, 1, 0.010)
    calls.add(1, 3, 0.020)
    assert calls.estimate(8, 2) == pytest.approx(0.015)
    one = StepTimes(scales_with_batch=False)  # one size measured: a smaller one its share, a larger one as much
    one.add(1, 4, 0.008)
    assert [one.estimate(1, k) for k in (1, 2, 4, 6)] == pytest.approx([0.002, 0.004, 0.008, 0.008])
    one.add(1, 2, 0.006)  # a second size: the line through both
    assert one.estimate(1, 1) == pytest.approx(0.005)
    falling = StepTimes()
    falling.add(2, 2, 0.2)
    falling.add(2, 6, 0.1)
    assert falling.slope(2) == 0.0  # never negative


def test_a_warm_up_timed_on_a_busy_machine_is_scaled_to_the_live_times():
    """The warm-up ran three times slower than serving (the other services were starting): the sizes serving has
    not tried since keep the warm-up's shape at the live level, instead of staying three times too dear."""
    times = StepTimes()
    for q in (1, 2, 5):  # 3x a step of 0.0375 + 0.0025 per query token
        times.calibrate(1, q, 3 * (0.0375 + 0.0025 * q))
    assert times.estimate(1, 5) == pytest.approx(0.150)  # nothing live yet: the warm-up as measured
    for _ in range(4):
        times.add(1, 1, 0.040)  # serving at k = 0
    assert times.estimate(1, 1) == pytest.approx(0.040)
    assert times.estimate(1, 5) == pytest.approx(0.050)
    assert times.slope(1) == pytest.approx(0.0025)
    for _ in range(4):
        times.add(1, 5, 0.060)  # measured live now: the live time wins over the scaled warm-up
    assert times.estimate(1, 5) == pytest.approx(0.060, rel=0.05)


def test_a_size_not_timed_lately_is_at_most_its_warm_up_shape_at_the_live_level():
    """The first trees ran slow (a busy moment): 9 rows stay at that time only while it is fresh, then at most the
    warm-up's shape at today's level, so that a tree is tried again and its time corrected."""
    now = [0.0]
    times = StepTimes(stepwise=True, clock=lambda: now[0])
    for q in (1, 5, 9):
        times.calibrate(1, q, 0.020 + 0.0005 * q)  # a quiet warm-up: 9 rows 2 ms dearer than 5
    for _ in range(3):
        times.add(1, 9, 0.035)  # the first trees
        times.add(1, 1, 0.021)
    assert times.estimate(1, 9) == pytest.approx(0.035)  # fresh: what it took
    now[0] += 2 * step_times.FRESH_S
    for _ in range(3):
        times.add(1, 1, 0.0205)
        times.add(1, 5, 0.0225)  # chains and plain steps, timed since
    assert times.estimate(1, 9) == pytest.approx(0.0245)  # live at the warm-up's level: its 9 rows as they were
    for _ in range(3):
        times.add(1, 9, 0.030)  # a tree timed again: its own time, fresh
    assert times.estimate(1, 9) == pytest.approx(0.030)


def test_a_size_other_sizes_were_timed_many_times_since_is_at_most_its_warm_up_shape_at_the_live_level():
    """Within FRESH_S too: trees timed in a slow half-second, then `window` chain and plain steps back at the old
    level, leave 9 rows at most the warm-up's shape at that level (before: at their slow time for FRESH_S, a whole
    request at one client)."""
    now = [0.0]
    times = StepTimes(stepwise=True, clock=lambda: now[0])
    for q in (1, 5, 9):
        times.calibrate(1, q, 0.020 + 0.0005 * q)
    for _ in range(4):
        times.add(1, 9, 0.0245)
        now[0] += 0.03
    for _ in range(4):
        times.add(1, 9, 0.036)  # the host slows: the median of 9 rows' 8 times is half slow
        times.add(1, 9, 0.036)
        now[0] += 0.03
    assert times.estimate(1, 9) == pytest.approx(0.036)
    for step in range(times.window):
        assert times.estimate(1, 9) == pytest.approx(0.036)  # a few steps of other sizes: still its own time
        times.add(1, 5 if step % 2 else 1, 0.0225 if step % 2 else 0.0205)  # chains and plain steps, as before
        now[0] += 0.03
    assert now[0] < step_times.FRESH_S
    assert times.estimate(1, 9) == pytest.approx(0.0245)  # the warm-up's 9 rows at the live level (1.0)


def test_outcomes_are_a_ratio_of_sums_drawn_towards_one_while_few():
    outcomes = step_times.Outcomes(window=4)
    assert outcomes.slowdown(8, DRAFTING) == 1.0
    outcomes.add(8, DRAFTING, 0.1, 0.2)
    trust = 1 / (1 + step_times.OUTCOME_PRIOR)
    assert outcomes.slowdown(8, DRAFTING) == pytest.approx(1 + trust * (2 - 1))
    for _ in range(3):
        outcomes.add(8, DRAFTING, 0.1, 0.1)
    drafting = 1 + 4 / (4 + step_times.OUTCOME_PRIOR) * (0.5 / 0.4 - 1)  # 4 steps: 0.5 s realised, 0.4 expected
    assert outcomes.slowdown(8, DRAFTING) == pytest.approx(drafting)
    assert outcomes.slowdown(8, PROBE) == pytest.approx(drafting)  # no probe seen yet: as drafting steps ran
    outcomes.add(8, PROBE, 0.1, 0.2)
    trust = 1 / (1 + step_times.PROBE_PRIOR)  # probes are few: each believed sooner
    assert outcomes.slowdown(8, PROBE) == pytest.approx(drafting + trust * (2 - drafting))
    outcomes.add(8, DRAFTING, 0.1, 0.1)  # the window drops the slow one
    assert outcomes.slowdown(8, DRAFTING) == pytest.approx(1.0)
    assert outcomes.slowdown(8, PLAIN) == outcomes.slowdown(4, DRAFTING) == 1.0  # kept apart
    outcomes.add(8, PLAIN, 0.0, 0.2)  # nothing expected yet: not counted
    assert not outcomes.steps.get((8, PLAIN))


def test_step_times_estimate_never_falls_as_the_size_grows():
    """The plan stops weighing larger chain plans once even every remaining token at today's step time could not
    win (SpecPolicy._filled): that needs scoring estimates that never fall with the size, whatever was measured
    (noisy points, a warm-up, one size, a neighbour's slope)."""
    rng = random.Random(5)
    for trial in range(200):
        times = StepTimes(stepwise=trial % 2 == 0)
        for batch in rng.sample(range(1, 9), rng.randint(1, 3)):
            for size in rng.sample(range(batch, 6 * batch + 1), rng.randint(1, 5)):
                (times.add if rng.random() < 0.7 else times.calibrate)(batch, size, rng.uniform(0.01, 0.05))
        for batch in range(1, 9):
            estimates = [times.estimate(batch, size) for size in range(batch, 8 * batch)]
            if estimates[0] is None:  # nothing measured anywhere near
                continue
            # up to rounding: the prune keeps a margin of 1e-9
            assert all(b >= a * (1 - 1e-12) for a, b in itertools.pairwise(estimates)), (trial, batch, estimates)


def test_a_size_never_timed_live_is_at_most_the_live_line_extended_to_it():
    """The warm-up put 9 rows at 1.65 times one row; serving timed 1 to 5 rows at about 1.3 times' slope. Scaled to
    the live level, 9 rows would look dearer than anything serving measured suggests, and no tree would ever be
    drafted whole to correct it: the live line, extended, caps it until 9 rows are timed themselves."""
    times = StepTimes(stepwise=True)
    for q in (1, 3, 5, 9):
        times.calibrate(1, q, 0.019 * (1 + 0.081 * (q - 1)))  # 9 rows: 1.65x one row
    for _ in range(3):
        times.add(1, 1, 0.025)
        times.add(1, 3, 0.026)
        times.add(1, 5, 0.029)
    line_at_9 = (0.025 + 0.026 + 0.029) / 3 + 0.001 * (9 - 3)  # least squares: through the mean, 1 ms a row
    assert times.estimate(1, 9) == pytest.approx(line_at_9)
    scaled_warm_up = 0.019 * 1.648 * statistics.median([0.025 / 0.019, 0.026 / 0.019 / 1.162, 0.029 / 0.019 / 1.324])
    assert times.estimate(1, 9) < 0.9 * scaled_warm_up
    for _ in range(3):
        times.add(1, 9, 0.036)  # 9 rows were dearer after all: their own time counts once timed
    assert times.estimate(1, 9) == pytest.approx(0.036)
