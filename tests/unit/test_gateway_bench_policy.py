"""gateway_bench's check of issue 23: the adaptive policy's rows against the fixed row that is best over the runs,
run by run."""

from types import SimpleNamespace

import pytest

from specdec_bench.gateway_bench import POLICY_TARGET, policy_against_fixed, render_policy


def runs(*tokens_per_s: float) -> list:
    return [SimpleNamespace(tokens_per_s=v) for v in tokens_per_s]


def test_each_run_is_paired_with_the_fixed_row_best_over_the_runs():
    results = {
        ("gt", 1): runs(60, 50, 40),
        ("g4", 1): runs(50, 55, 30),  # median 50
        ("g4t", 1): runs(55, 45, 52),  # median 52: the best over the runs
        ("gts-bf16", 8): runs(100, 90),
        ("g4ts-bf16", 8): runs(100, 100),  # g4s-bf16 did not run: the one fixed row that did is the best
        ("gt", 8): runs(10),  # no fixed row at 8 clients: no cell
    }
    cells = {(c["policy"], c["clients"]): c for c in policy_against_fixed(results)}
    assert set(cells) == {("gt", 1), ("gts-bf16", 8)}
    one = cells[("gt", 1)]
    assert one["fixed"] == ["g4", "g4t"] and one["best"] == "g4t"
    assert one["per_run"] == pytest.approx([60 / 55, 50 / 45, 40 / 52])
    assert one["ratio"] == pytest.approx(60 / 55)
    # The faster fixed row of each run (55, 55, 52): a lower ratio than against either row alone
    assert one["against_faster"] == pytest.approx(50 / 55)
    assert one["against_faster"] < one["ratio"]
    eight = cells[("gts-bf16", 8)]
    assert eight["fixed"] == ["g4ts-bf16"] and eight["ratio"] == pytest.approx(0.95)


def test_the_report_says_pass_or_fail_against_the_target():
    cells = policy_against_fixed({("gt", 1): runs(90, 96), ("g4t", 1): runs(100, 100)})
    assert cells[0]["ratio"] == pytest.approx(0.93) and cells[0]["ratio"] < POLICY_TARGET
    text = "\n".join(render_policy(cells))
    label = "gateway: EAGLE head, adaptive k<=4, trees<=8 nodes (default)"
    row = f"| {label} | 1 | `g4t` | `g4t` | 0.93 | 0.90 0.96 | 0.93 | FAIL |"
    assert row in text
    cells[0]["ratio"] = 0.96
    assert "| 0.96 | 0.90 0.96 | 0.93 | PASS |" in "\n".join(render_policy(cells))
    assert render_policy([]) == []
