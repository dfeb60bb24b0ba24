"""gateway_bench's check of issue 23: the adaptive policy's rows against the best fixed row of each run."""

from types import SimpleNamespace

import pytest

from specdec_bench.gateway_bench import POLICY_TARGET, policy_against_fixed, render_policy


def runs(*tokens_per_s: float) -> list:
    return [SimpleNamespace(tokens_per_s=v) for v in tokens_per_s]


def test_each_run_is_paired_with_its_best_fixed_row():
    results = {
        ("gt", 1): runs(60, 50, 40),
        ("g4", 1): runs(50, 55, 30),
        ("g4t", 1): runs(55, 45, 50),
        ("gts-bf16", 8): runs(100, 90),
        ("g4ts-bf16", 8): runs(100, 100),  # g4s-bf16 did not run: the one fixed row that did is the best
        ("gt", 8): runs(10),  # no fixed row at 8 clients: no cell
    }
    cells = {(c["policy"], c["clients"]): c for c in policy_against_fixed(results)}
    assert set(cells) == {("gt", 1), ("gts-bf16", 8)}
    one = cells[("gt", 1)]
    assert one["fixed"] == ["g4", "g4t"]
    assert one["per_run"] == pytest.approx([60 / 55, 50 / 55, 40 / 50])
    assert one["ratio"] == pytest.approx(50 / 55)
    eight = cells[("gts-bf16", 8)]
    assert eight["fixed"] == ["g4ts-bf16"] and eight["ratio"] == pytest.approx(0.95)


def test_the_report_says_pass_or_fail_against_the_target():
    cells = policy_against_fixed({("gt", 1): runs(90, 96), ("g4t", 1): runs(100, 100)})
    assert cells[0]["ratio"] == pytest.approx(0.93) and cells[0]["ratio"] < POLICY_TARGET
    text = "\n".join(render_policy(cells))
    row = "| gateway: EAGLE head, adaptive k<=4, trees<=8 nodes (default) | 1 | `g4t` | 0.93 | 0.90 0.96 | FAIL |"
    assert row in text
    cells[0]["ratio"] = 0.96
    assert "| 0.96 | 0.90 0.96 | PASS |" in "\n".join(render_policy(cells))
    assert render_policy([]) == []
