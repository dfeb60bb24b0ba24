import pytest

from verifier_service.spec_policy import AcceptanceEstimate, CostRatio, best_draft_length, expected_speedup


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
