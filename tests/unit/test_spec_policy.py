import pytest

from verifier_service.spec_policy import (
    AcceptanceEstimate,
    CostRatio,
    ScoringCost,
    best_draft_length,
    expected_speedup,
)


def test_expected_speedup_closed_form():
    assert expected_speedup(0.5, 0, 0.3) == 1.0
    assert expected_speedup(0.5, 2, 0.0) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_speedup(1.0, 4, 0.25) == pytest.approx(5 / 2)
    assert expected_speedup(0.1, 4, 0.3) == pytest.approx((1 - 0.1**5) / (0.9 * 2.2))


@pytest.mark.parametrize(
    ("alpha", "cost", "expected"),
    [(0.1, 0.3, 0), (0.9, 0.05, 6), (0.7, 0.0, 6), (0.6, 0.3, 1), (0.8, 0.1, 6), (0.8, 0.3, 3), (0.0, 0.0, 0)],
)
def test_best_draft_length(alpha, cost, expected):
    assert best_draft_length(alpha, 6, cost) == expected


def test_acceptance_estimate_uses_only_tested_positions():
    est = AcceptanceEstimate(alpha=0.5, weight=0.5)
    est.update(num_drafted=4, num_accepted=1)  # position 1 accepted, 2 rejected, 3-4 untested
    assert est.alpha == pytest.approx(0.5 + 0.5 * (1 - 0.5) - 0.5 * (0.75 - 0))
    full = AcceptanceEstimate(alpha=0.5, weight=0.5)
    full.update(num_drafted=2, num_accepted=2)
    assert full.alpha > 0.8


def test_cost_ratio_is_a_robust_median():
    c = CostRatio()
    assert c.value == 0.0
    for seconds in (0.03, 0.03, 5.0, 0.03):  # one prefill-heavy outlier
        c.update(seconds, 1, 0.1)
    assert c.value == pytest.approx(0.3)


def test_scoring_cost_is_free_until_two_query_counts_are_seen():
    cost = ScoringCost()
    assert cost.per_draft(1) == 0.0
    for _ in range(5):
        cost.update(4, 0.2)
    assert cost.per_draft(4) == 0.0  # one count: no slope to fit


def test_scoring_cost_fits_base_plus_per_token():
    cost = ScoringCost()
    for n in (1, 2, 5, 8, 9):  # step time 80 ms + 20 ms per query token
        for _ in range(3):
            cost.update(n, 0.080 + 0.020 * n)
    assert cost.per_draft(1) == pytest.approx(0.020 / 0.100)  # v_1 - 1 at batch 1
    assert cost.per_draft(8) == pytest.approx(8 * 0.020 / 0.240)


def test_scoring_cost_ignores_an_outlier_and_never_goes_negative():
    cost = ScoringCost()
    for n, seconds in ((1, 0.1), (1, 0.1), (1, 5.0), (5, 0.2), (5, 0.2)):
        cost.update(n, seconds)
    assert cost.per_draft(1) == pytest.approx(0.025 / 0.1)
    falling = ScoringCost()
    falling.update(1, 0.2)
    falling.update(5, 0.1)
    assert falling.per_draft(1) == 0.0


def test_scoring_cost_forgets_the_least_recent_counts():
    cost = ScoringCost(max_counts=2)
    cost.update(1, 0.1)
    cost.update(3, 0.3)  # 100 ms per token so far
    cost.update(5, 0.34)  # evicts n = 1: the fit is through n = 3 and 5 only, 20 ms per token
    assert cost.per_draft(1) == pytest.approx(0.02 / (0.24 + 0.02))


def test_scoring_cost_switches_a_middling_draft_off():
    """A draft accepted 30% of the time at 10% of the target's cost pays if scoring is free, not if
    each scored token adds a quarter of a step (a CPU's v_1 = 1.25)."""
    assert best_draft_length(0.3, 4, 0.1) > 0
    assert best_draft_length(0.3, 4, 0.1 + 0.25) == 0


def test_sequences_at_k0_probe_on_the_same_step():
    """A hopeless draft is off, except one k = 1 probe every `probe_interval` steps, taken by all such
    sequences together so the drafter runs once per interval rather than on most steps."""
    from shared.kv.block_manager import BlockManager
    from shared.sampling import SamplingParams
    from verifier_service.config import EngineConfig
    from verifier_service.scheduler import Scheduler
    from verifier_service.sequence import Sequence

    config = EngineConfig(num_speculative_tokens=4, adaptive_k=True, probe_interval=4)
    scheduler = Scheduler(config, BlockManager(8, 4))
    seqs = [Sequence(f"s{i}", [1, 2, 3], SamplingParams(max_tokens=50), i, tokens=[1, 2, 3]) for i in range(3)]
    for seq in seqs:
        seq.acceptance.alpha = 0.0
    ks = []
    for step in range(1, 9):
        scheduler.num_steps = step
        ks.append([scheduler.draft_length(seq) for seq in seqs])
    assert ks == [[0, 0, 0]] * 3 + [[1, 1, 1]] + [[0, 0, 0]] * 3 + [[1, 1, 1]]
    seqs[0].acceptance.alpha = 0.9  # a draft that works is used at every step, at full length
    assert scheduler.draft_length(seqs[0]) == 4
