"""specdec_bench.paired_rounds: the first stack against the best of the others over the rounds, not against the
faster of them in each round (which favours them: the faster of two equally fast, noisy stacks); the A/A twin as a
control beside them."""

from __future__ import annotations

import json
import math
import random
import statistics
from types import SimpleNamespace

import pytest

from specdec_bench import gateway_bench as gb
from specdec_bench.paired_rounds import BASE_NAME, against_the_best, base_stack, median_interval, per_round, report


def rounds(*tokens_per_s: float) -> list[dict[str, float]]:
    return [{"tokens_per_s": x} for x in tokens_per_s]


def test_the_best_other_stack_is_chosen_by_its_median_ratio_and_compared_round_by_round():
    samples = {
        "target": rounds(10, 20, 10, 20),
        "policy": rounds(14, 28, 15, 26),
        "chain": rounds(15, 26, 14, 28),  # ratios 1.5, 1.3, 1.4, 1.4: median 1.4
        "tree": rounds(16, 24, 13, 27),  # 1.6, 1.2, 1.3, 1.35: median 1.325
    }
    assert per_round(samples, "chain", "target") == [1.5, 1.3, 1.4, 1.4]
    best, ratios = against_the_best(samples, "policy", ["chain", "tree"])
    assert best == "chain"
    assert ratios == [14 / 15, 28 / 26, 15 / 14, 26 / 28]
    # The faster of the two in each round is the negative control: it makes the policy look slower than
    # against either stack alone.
    fixed = zip(samples["chain"], samples["tree"], strict=True)
    faster = [max(chain["tokens_per_s"], tree["tokens_per_s"]) for chain, tree in fixed]
    per_round_max = [p["tokens_per_s"] / f for p, f in zip(samples["policy"], faster, strict=True)]
    assert statistics.median(per_round_max) < statistics.median(ratios)


def test_the_twin_is_reported_as_an_aa_control_and_kept_out_of_the_product_stacks(capsys, tmp_path):
    samples = {
        "target": [{"tokens_per_s": x, "ttft_p50_ms": 100.0} for x in (10, 20, 10)],
        "policy": [{"tokens_per_s": x, "ttft_p50_ms": 100.0} for x in (12, 22, 11)],
        gb.TWIN: [{"tokens_per_s": x, "ttft_p50_ms": 100.0} for x in (9, 21, 10)],
    }
    out = tmp_path / "record.json"
    args = SimpleNamespace(clients=8, temperature=0.8, rounds=3, json=str(out))
    report(args, ["policy"], samples, {}, 1.0)
    printed = capsys.readouterr().out
    assert "A/A control, target-twin / target (no difference): ratio median 1.000" in printed
    # The twin is a control, not a speculating stack: never "the best of the others", never the first.
    assert "policy / target-twin" not in printed and "the best of the others" not in printed
    record = json.loads(out.read_text())
    assert record["stacks"] == ["policy"]
    assert record["ratios"][gb.TWIN] == [0.9, 21 / 20, 1.0]
    # Only on request: the default stacks of gateway_bench hold no twin.
    default = gb.build_stacks(tmp_path, "target", "draft", "head")
    assert gb.TWIN not in default and "target" in default
    assert [p.name for p in gb.build_stacks(tmp_path, "target", "draft", None, [gb.TWIN])[gb.TWIN].procs] == [
        "target-twin-verifier",
        "target-twin-gateway",
    ]


def test_the_median_interval_takes_the_sign_tests_order_statistics():
    # n = 12: P(B <= 2) = 79/4096 <= 0.05 < P(B <= 3) = 299/4096, so the 3rd smallest and the 3rd largest
    low, high, coverage = median_interval([0.9 + 0.01 * i for i in (5, 11, 0, 7, 3, 9, 1, 10, 2, 8, 4, 6)])
    assert (round(low, 6), round(high, 6)) == (0.92, 0.99)
    assert coverage == 1 - 2 * 79 / 4096
    assert median_interval([1.0, 2.0, 3.0, 4.0]) == (1.0, 4.0, 0.875)  # too few rounds for 90%: the whole range


def test_the_median_interval_covers_the_median_as_often_as_it_says():
    """Rounds from a skewed law (exponential, median ln 2): the interval holds the true median in its stated share
    of 4,000 seeded trials; an interval one order statistic narrower (the negative control) falls short of 90%."""
    rng = random.Random(0)
    trials, n, median = 4000, 12, math.log(2)
    held = narrower = 0
    for _ in range(trials):
        values = [rng.expovariate(1.0) for _ in range(n)]
        low, high, coverage = median_interval(values)
        held += low <= median <= high
        ordered = sorted(values)
        narrower += ordered[3] <= median <= ordered[n - 4]
    assert abs(held / trials - coverage) < 0.015
    assert narrower / trials < 0.9


def test_the_base_stack_runs_the_first_stack_s_services_from_another_checkout(tmp_path):
    """`--base-code`: old code against new in the same rounds. Each of its services imports from the other
    checkout (PYTHONPATH), under its own name and logs, so neither stack's processes or logs are mistaken for
    the other's."""
    checkout = tmp_path / "old"
    (checkout / "verifier_service").mkdir(parents=True)
    logs = tmp_path / "logs"
    logs.mkdir()
    stack = base_stack(str(checkout), logs, ("target-model", "draft", "head"), "eagle-adaptive-tree")
    assert stack.name == BASE_NAME
    assert {p.name for p in stack.procs} == {f"{BASE_NAME}-{role}" for role in ("proposer", "verifier", "gateway")}
    assert all(p.env["PYTHONPATH"] == str(checkout.resolve()) for p in stack.procs)
    assert all(p.log_path.parent == logs / BASE_NAME for p in stack.procs)
    new = gb.build_stacks(logs, "target-model", "draft", "head", ["eagle-adaptive-tree"])["eagle-adaptive-tree"]
    assert all("PYTHONPATH" not in p.env for p in new.procs)  # the stack it is set against: this checkout's
    with pytest.raises(SystemExit, match="no verifier_service"):
        base_stack(str(tmp_path / "nothing"), logs, ("target-model", "draft", "head"), "eagle-adaptive-tree")
