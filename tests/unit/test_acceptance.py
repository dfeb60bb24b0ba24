"""What a sequence's drafts are expected to accept (verifier_service/acceptance.py): its chain acceptance from
tested positions only, drawn towards its kind's as far as the kind's verdicts show it tells, and its kind's trees
judged against their own best-guess paths."""

from __future__ import annotations

import random

import pytest

from shared.drafting import Draft, best_guess_path
from verifier_service import acceptance
from verifier_service.acceptance import MIN_POPULATION_POSITIONS, AcceptanceEstimate, OwnWeight, TreeMisses


def test_acceptance_estimate_uses_only_tested_positions():
    est = AcceptanceEstimate(alpha=0.5, weight=0.5)
    est.update(num_drafted=4, num_accepted=1)  # position 1 accepted, 2 rejected, 3-4 untested
    assert est.alpha == pytest.approx(0.5 + 0.5 * (1 - 0.5) - 0.5 * (0.75 - 0))
    full = AcceptanceEstimate(alpha=0.5, weight=0.5)
    full.update(num_drafted=2, num_accepted=2)
    assert full.alpha > 0.8
    assert AcceptanceEstimate(alpha=0.5).chain_gain(3) == pytest.approx(0.5 + 0.25 + 0.125)


def test_a_tree_accepts_as_a_chain_at_the_acceptance_its_kinds_trees_showed():
    est = AcceptanceEstimate(alpha=0.5)
    # Untried: the prior, a fifth of the chain's rejections rescued
    assert est.expected_tree_gain(2) == pytest.approx(0.6 + 0.6**2)
    assert AcceptanceEstimate(alpha=1.0).expected_tree_gain(4) == 4.0
    for _ in range(40):  # every best guess rejected at once, another child accepted each time, the tree whole
        est.update_tree(depth=4, num_accepted=4, best_drafted=4, best_accepted=0)
    assert est.tree_misses.share < 0.1
    assert est.alpha < 0.1 and est.expected_tree_gain(4) > 3.0 > est.chain_gain(4) * 10
    for _ in range(300):  # trees that accept no more than their best guesses
        est.update_tree(depth=4, num_accepted=1, best_drafted=4, best_accepted=1)
    assert est.tree_misses.share == pytest.approx(1.0, abs=0.03)
    assert est.expected_tree_gain(4) == pytest.approx(est.chain_gain(4), rel=0.05)


def test_trees_are_judged_against_their_own_best_guesses_not_the_sequence_s_alpha():
    misses = TreeMisses()
    for i in range(1000):  # best guesses rejected at 6 positions in 10, the trees at 3 in 10
        misses.update(depth=1, num_accepted=int(i % 10 >= 3), best_drafted=1, best_accepted=int(i % 10 >= 6))
    assert misses.share == pytest.approx(0.5, abs=0.03)
    assert AcceptanceEstimate(alpha=0.4, tree_misses=misses).expected_tree_gain(1) == pytest.approx(0.7, abs=0.02)


def test_trees_are_tried_before_they_are_judged():
    misses = TreeMisses()
    for _ in range(acceptance.MIN_TREES - 1):
        misses.update(depth=4, num_accepted=2, best_drafted=2, best_accepted=2)  # a best path 2 long, all a tree got
    assert misses.share == acceptance.TREE_PRIOR_SHARE
    misses.update(depth=4, num_accepted=2, best_drafted=2, best_accepted=2)
    assert misses.share > 1.0  # judged now: a rejection in 3 positions, against none in 2 for the best guesses


def test_tree_misses_count_tested_positions_and_decay():
    misses = TreeMisses()
    misses.update(depth=4, num_accepted=4, best_drafted=4, best_accepted=2)  # tree: 4 tested; best: 3, 1 rejected
    misses.update(depth=4, num_accepted=1, best_drafted=3, best_accepted=1)  # tree: 2, 1 rejected; best: 2, 1
    keep = 1 - acceptance.TREE_WEIGHT
    assert (misses.tree_tested, misses.tree_rejected) == (pytest.approx(keep * 4 + 2), 1.0)
    assert (misses.best_tested, misses.best_rejected) == (pytest.approx(keep * 3 + 2), pytest.approx(keep + 1))


def test_a_sequence_drafting_trees_follows_its_text_through_their_best_guesses():
    shared = TreeMisses()
    one, other = AcceptanceEstimate(alpha=0.5, tree_misses=shared), AcceptanceEstimate(alpha=0.5, tree_misses=shared)
    for _ in range(20):
        one.update_tree(depth=4, num_accepted=4, best_drafted=4, best_accepted=4)
    assert one.alpha > 0.9  # its best guesses were all accepted
    assert other.alpha == 0.5 and other.tree_misses.trees == 20  # the other learned what trees add, not the text


def test_the_best_guess_path_follows_first_children():
    #  root -> 0 (a) -> 2 (c) -> 4 (e)
    #       -> 1 (b)    3 (d)
    draft = Draft("s", 10, [11, 12, 13, 14, 15], parents=[-1, -1, 0, 0, 2])
    assert best_guess_path(draft.parents) == [0, 2, 4]
    assert draft.best_guess_verdict([11, 13, 15]) == (3, 3)
    assert draft.best_guess_verdict([11, 14]) == (3, 1)  # the second child at depth 2 was accepted
    assert draft.best_guess_verdict([12]) == (3, 0)
    assert draft.best_guess_verdict([]) == (3, 0)
    assert Draft("s", 10, [7, 8, 9]).best_guess_verdict([7, 8]) == (3, 2)  # a chain is its own best guess


def _kind_serves(truths: list[float], steps: int, seed: int = 0) -> tuple[OwnWeight, list[AcceptanceEstimate]]:
    """Sequences of one kind, each with its own true per-position acceptance, drafting chains of 4 in turn for
    `steps` steps each, as the engine updates them (the sequence's, then the kind's)."""
    rng = random.Random(seed)
    population = AcceptanceEstimate(weight=0.01)
    weight = OwnWeight(population)
    estimates = []
    for truth in truths:
        est = AcceptanceEstimate(alpha=population.alpha, own_weight=weight)
        for _ in range(steps):
            accepted = 0
            while accepted < 4 and rng.random() < truth:
                accepted += 1
            est.update(4, accepted)
            population.update(4, accepted)
        estimates.append(est)
    return weight, estimates


def test_where_sequences_differ_for_good_their_own_acceptance_is_planned_with():
    weight, estimates = _kind_serves([0.2, 0.85] * 40, steps=30)
    assert weight.slope > 0.8, weight.slope
    low, high = estimates[-2], estimates[-1]
    assert low.predicted < 0.35 and high.predicted > 0.75, (low.predicted, high.predicted)


def test_where_a_run_of_accepted_drafts_tells_nothing_the_kind_s_acceptance_is_planned_with():
    """Every sequence accepts each position with probability 0.5: alpha, an average over ~20 positions, wanders
    0.3-0.7 all the same, and a plan that believed it chose long chains after lucky runs (through the gateway, chains
    of 4 chosen at alpha 0.64 accepted 0.98 drafts a step where 1.48 were expected)."""
    weight, estimates = _kind_serves([0.5] * 80, steps=30)
    assert weight.slope < 0.2, weight.slope
    wandered = max(estimates, key=lambda est: abs(est.alpha - 0.5))
    assert abs(wandered.alpha - 0.5) > 0.12  # alpha did wander ...
    assert abs(wandered.predicted - 0.5) < 0.05, (wandered.alpha, wandered.predicted)  # ... the plan did not follow
    assert wandered.chain_gain(4) == pytest.approx(acceptance._geometric(wandered.predicted, 4))


def test_own_acceptance_is_planned_with_as_it_is_until_the_kind_s_is_known():
    population = AcceptanceEstimate(weight=0.01)
    est = AcceptanceEstimate(alpha=0.9, own_weight=OwnWeight(population))
    assert est.predicted == 0.9  # nothing behind the kind's estimate yet
    population.tested = MIN_POPULATION_POSITIONS
    assert est.predicted == pytest.approx(0.5 + 0.5 * 0.4)  # the prior slope: halfway
    assert AcceptanceEstimate(alpha=0.9).predicted == 0.9  # no kind: alpha as it is
