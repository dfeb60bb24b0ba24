"""What a sequence's drafts are expected to accept: its own chain acceptance (`AcceptanceEstimate`), drawn towards
its kind's as far as a sequence's recent acceptance has told of its next drafts (`OwnWeight`), and, for trees, the
share of a chain's rejections its kind's trees still reject (`TreeMisses`). The speculation policy
(`spec_policy.py`) plans from these; the engine updates them from every verdict."""

from __future__ import annotations

from dataclasses import dataclass, field

# Trees (`TreeMisses`): a tree's other guesses rescue some of the positions where the drafter's best guess, a
# chain's token, is rejected. With the committed EAGLE head (`specdec_train.evaluate`, 54 held-out prompts) a
# chain of 4 accepts 0.50 / 0.24 / 0.12 / 0.06 greedy and trees of at most 10 nodes 0.68 / 0.40 / 0.19 / 0.08:
# 0.83 of the chain's rejections, at T = 0.8 about 0.85. The prior is a little better than that (trees are tried,
# then judged): the trees' and their best-guess paths' rejection rates start from TREE_PRIOR_SHARE times
# TREE_PRIOR_REJECTION and from TREE_PRIOR_REJECTION, each worth TREE_PRIOR_POSITIONS tested positions at first;
# the sums, the prior's included, decay by TREE_WEIGHT a tree. Over whole held-out runs with a tree every step the
# share is 0.835 greedy and 0.840 at T = 0.8, but from eight trees (about 15 tested positions) its estimate spreads
# by about +-0.2: through the gateway the sampled kind's came out 0.96-1.00 after 8-14 trees with a prior of 4
# positions that never decayed, and its requests drafted chains for the rest of the run. Worth 16 at first, the
# prior holds a few unlucky trees near it; after fifty trees it is worth 6, after a hundred 2.
TREE_PRIOR_SHARE = 0.8
TREE_PRIOR_REJECTION = 0.5
TREE_PRIOR_POSITIONS = 16.0
TREE_WEIGHT = 0.02
MIN_TREES = 8
# A tree's nodes that the drafter puts below the plan's price are not sent (`SpecPolicy._priced`), so a tree scores
# fewer rows than its bound: a kind's trees are expected to score as many as its recent ones did, a moving average
# over about the last ten (the price moves with the measured costs).
NODES_WEIGHT = 0.1
# A kind's acceptance (SpecPolicy.population) is a new sequence's prior (SpecPolicy.new_estimate), and a sequence's
# own is drawn towards it (`OwnWeight`), once it rests on this many tested positions
MIN_POPULATION_POSITIONS = 20
# A sequence's own acceptance (an average over its last ~20 tested positions) tells less of its next drafts than it
# says: after a run of accepted drafts it is high, and the next positions are accepted about as often as its kind's.
# Replayed over the 54 held-out prompts (committed EAGLE head, chains of 4, 2026-12-07), the fifth of steps where it
# was highest accepted 0.27 drafts a step fewer than it predicted greedy, 0.48 at T = 0.8, and the lowest fifth 0.35
# and 0.28 more; through the gateway at one client (the bench's prompts) chains of 4 were chosen at alpha 0.64 and
# accepted 0.98 drafts a step against 1.48 expected, while chains of 2 chosen at 0.49 accepted 0.93 against 0.73.
# So the policy plans with its kind's acceptance plus a slope times the sequence's difference from it, the slope
# of a regression of each tested position's verdict on that difference, over about the last 1 / OWN_DECAY tested
# positions of the kind, starting from OWN_PRIOR_SLOPE worth OWN_PRIOR_POSITIONS positions that differ by
# OWN_PRIOR_SPREAD. In the replay the learned slope came to 0.40-0.47 greedy and 0.2-0.4 at T = 0.8, and its
# predictions' squared error per position fell 2.1% greedy and 2.6% at T = 0.8 against the sequence's own alpha.
OWN_DECAY = 0.001
OWN_PRIOR_SLOPE = 0.5
OWN_PRIOR_POSITIONS = 20.0
OWN_PRIOR_SPREAD = 0.1


@dataclass
class TreeMisses:
    """The share of a chain's rejections that the drafter's trees still reject, over recent trees of one kind of
    sequence (greedy or sampled): a tree's other guesses rescue the rest. A property of the drafter more than of a
    sequence's text, so it is learned across sequences, and a sequence's own text enters through its chain
    acceptance: a tree's per-position acceptance is 1 - share * (1 - alpha). One estimate per sequence, learned
    from its trees alone, was set by its first tree: one that accepted nothing made a chain look better for the
    rest of the request, and no tree was drafted again to correct it (through the gateway at one client, fp32
    target, the policy drafted 1 tree in 205 plans while a tree every step ran 7-11% faster).

    Each tree holds its own chain: the best-guess path (`Draft.best_guess_verdict`), tested on the same text up to
    its first rejection. The share is the trees' rejections per tested position over their best-guess paths', as
    ratios of sums decayed by TREE_WEIGHT a tree (about the last fifty count), each rate starting from its prior
    worth TREE_PRIOR_POSITIONS positions, which decays with them. Judged against the sequences' alpha instead, the
    first trees of sampled requests met the agnostic prior of 0.5 where their chains accepted 0.35-0.4, and a share
    of 1.27 after eight trees kept every later request on chains. Until MIN_TREES trees were verified the share is
    never worse than the prior, so that trees are tried before they are judged; and `SpecPolicy` still drafts one
    now and then where it is expected to cost little (TREE_EXPLORE_EVERY), so that an estimate that came out poor
    by chance is corrected."""

    tree_tested: float = 0.0  # decayed sums over the trees: positions tested and rejections met
    tree_rejected: float = 0.0
    best_tested: float = 0.0  # the same over their best-guess paths
    best_rejected: float = 0.0
    trees: int = 0
    passed_over: int = 0  # plans since a tree of this kind was verified where a sequence of it drafted a chain
    nodes: float = 0.0  # the nodes its trees scored, a moving average over about the last 1 / NODES_WEIGHT (0: none)

    def update(self, depth: int, num_accepted: int, best_drafted: int, best_accepted: int, nodes: int = 0) -> None:
        if nodes:
            self.nodes = nodes if not self.nodes else self.nodes + NODES_WEIGHT * (nodes - self.nodes)
        keep = 1.0 - TREE_WEIGHT
        self.tree_tested = keep * self.tree_tested + min(depth, num_accepted + 1)
        self.tree_rejected = keep * self.tree_rejected + (num_accepted < depth)
        self.best_tested = keep * self.best_tested + min(best_drafted, best_accepted + 1)
        self.best_rejected = keep * self.best_rejected + (best_accepted < best_drafted)
        self.trees += 1
        self.passed_over = 0

    @property
    def share(self) -> float:
        prior = TREE_PRIOR_POSITIONS * (1.0 - TREE_WEIGHT) ** self.trees  # old evidence: it decays as the trees'
        tree_rate = (self.tree_rejected + TREE_PRIOR_SHARE * TREE_PRIOR_REJECTION * prior) / (self.tree_tested + prior)
        best_rate = (self.best_rejected + TREE_PRIOR_REJECTION * prior) / (self.best_tested + prior)
        measured = tree_rate / best_rate
        return min(measured, TREE_PRIOR_SHARE) if self.trees < MIN_TREES else measured


@dataclass
class OwnWeight:
    """How far a sequence's own acceptance tells its next drafts' beyond its kind's (greedy or sampled): the slope of
    a decayed least-squares regression of each tested position's verdict (1 accepted, 0 rejected) on the sequence's
    alpha, both less its kind's acceptance (`population`, the policy's estimate of the kind), clamped to [0, 1].
    Shared by the sequences of a kind, as `TreeMisses` is, and learned from all their verdicts."""

    population: AcceptanceEstimate
    covariance: float = OWN_PRIOR_POSITIONS * OWN_PRIOR_SLOPE * OWN_PRIOR_SPREAD**2
    variance: float = OWN_PRIOR_POSITIONS * OWN_PRIOR_SPREAD**2

    @property
    def known(self) -> bool:
        """Whether the kind's acceptance rests on enough tested positions to draw towards (and to learn from)."""
        return self.population.tested >= MIN_POPULATION_POSITIONS

    @property
    def slope(self) -> float:
        return min(1.0, max(0.0, self.covariance / self.variance))

    def predicted(self, alpha: float) -> float:
        base = self.population.alpha
        return base + self.slope * (alpha - base)

    def observe(self, alpha: float, num_tested: int, num_accepted: int) -> None:
        """A verdict of a sequence whose own estimate was `alpha` as it drafted (its kind's not yet updated)."""
        base = self.population.alpha
        spread = alpha - base
        keep = (1.0 - OWN_DECAY) ** num_tested
        self.variance = keep * self.variance + num_tested * spread * spread
        hits = min(num_accepted, num_tested) - num_tested * base  # the tested positions' verdicts less the kind's
        self.covariance = keep * self.covariance + spread * hits


@dataclass
class AcceptanceEstimate:
    """An exponential moving average of one sequence's acceptance per chain position (`alpha`), and its kind's
    `TreeMisses`, for what a tree of the same depth would accept."""

    alpha: float = 0.5  # an agnostic prior: try drafting, then learn
    weight: float = 0.05  # about the last 20 tested positions: a few steps of a sequence's recent text
    tested: int = 0  # positions seen: the first ones count as a running mean (the prior is worth 2 of them)
    probed_at: int = -1  # the policy's probe count when a probe last drafted for this sequence (-1: never)
    prior_tested: int = 0  # positions behind the prior: those recent sequences of its kind tested (0: agnostic)
    tree_misses: TreeMisses = field(default_factory=TreeMisses)  # shared by the sequences of a kind
    own_weight: OwnWeight | None = None  # likewise; None: plan with alpha as it is (the kind's own estimate)

    @property
    def predicted(self) -> float:
        """The acceptance per position the policy plans with: alpha, drawn towards its kind's (`OwnWeight`) once
        the kind's rests on MIN_POPULATION_POSITIONS tested positions."""
        weight = self.own_weight
        return weight.predicted(self.alpha) if weight is not None and weight.known else self.alpha

    def update(self, num_drafted: int, num_accepted: int) -> None:
        # Positions past the first rejection were never tested: they carry no evidence.
        tested = min(num_drafted, num_accepted + 1)
        if self.own_weight is not None and self.own_weight.known:
            self.own_weight.observe(self.alpha, tested, num_accepted)
        for position in range(tested):
            accepted = 1.0 if position < num_accepted else 0.0
            self.tested += 1
            self.alpha += self._weight * (accepted - self.alpha)

    @property
    def _weight(self) -> float:
        return max(self.weight, 1.0 / (self.tested + 2))

    def update_tree(self, depth: int, num_accepted: int, best_drafted: int, best_accepted: int, nodes: int = 0) -> None:
        """A tree `depth` deep accepted `num_accepted` drafts; its best-guess path (`best_guess_path`), the chain the
        drafter would have sent, was `best_drafted` long and had its first `best_accepted` accepted: a chain's
        verdict for alpha, so that a sequence drafting trees still follows its text."""
        self.tree_misses.update(depth, num_accepted, best_drafted, best_accepted, nodes)
        self.update(best_drafted, best_accepted)

    def chain_gain(self, k: int) -> float:
        """Expected accepted drafts of a chain of k: a + a^2 + ... + a^k, at the acceptance planned with."""
        return _geometric(self.predicted, k)

    def expected_tree_gain(self, depth: int) -> float:
        """A tree's expected accepted drafts: a chain's of the same depth at the tree's per-position acceptance."""
        return _geometric(min(1.0, max(0.0, 1.0 - self.tree_misses.share * (1.0 - self.predicted))), depth)


def _geometric(alpha: float, k: int) -> float:
    return alpha * (1 - alpha**k) / (1 - alpha) if alpha != 1.0 else float(k)
