"""specdec_bench.paired_rounds: the first stack against the best of the others over the rounds, not against the
faster of them in each round (which favours them: the faster of two equally fast, noisy stacks)."""

from __future__ import annotations

import statistics

from specdec_bench.paired_rounds import against_the_best, per_round


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
