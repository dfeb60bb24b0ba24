"""Adaptive speculation: how deep each sequence drafts, and whether as a token tree, as far as it pays.

A step's throughput is its emitted tokens over its time, and the policy maximises it for the whole batch:

    tokens = sum_s (1 + gain_s)            gain_s: expected accepted drafts of sequence s (a chain of k at
                                            per-position acceptance a: a + a^2 + ... + a^k; a tree: the same at
                                            the acceptance its kind's trees showed: `TreeMisses`)
    time   = scoring(B, B + sum_s n_s)      the target's step, n_s draft tokens (a tree's nodes) scored for s
           + propose(B, D) if D > 0         the proposer call as the verifier waits for it, D = max_s k_s
           + rest(B, D)                     the rest of the step (commit, early ask, streaming, the
                                            proposer's work beside the verifier), measured start to start

Both times are the verifier's own measurements (`StepTimes`): scoring per batch size and query tokens (timed at
warm-up, then from every decode step; a curve through the measured sizes, not a line: products run in blocks
of rows, and the time can rise in steps), the propose call per batch size and draft depth, a per-call cost (round
trip, catch-up) plus a per-position cost, fitted apart for chains and trees (a drafting-ahead proposer's cache
hits cost what they took: about a round trip). Calls that carried a long catch-up (a prompt, a resend) are left
out: they are not what the next call costs; their time per caught-up position is kept apart, and a plan pays it
for every drafting sequence whose proposer lags (co-located, the proposer does not follow plain steps). The rest
of a step is the time from its start to the next step's minus those two: commit, the early ask, the serving
loop's streaming, and whatever the proposer's work beside the verifier costs it (co-located, they share the
cores); plain steps' is kept apart from drafting steps', which are fitted over depth like a propose call.
Through the gateway at 8 clients it was 3-9 ms a plain step and 7-10 ms a drafting one, against a 100-180 ms
step: small, but where drafting is predicted to win by 1-2% it decides.
Until a cost is measured it is taken as free (a drafting step's rest as a plain one's; a kind of propose call,
chain or tree, measured at no batch size as the other kind's), so the policy drafts, measures, and corrects.
Each part is a median, what a step usually costs; each kind of step (plain, a chosen drafting plan, a probe) is then
expected as much slower than its parts say as its recent steps ran, start to start (`Outcomes`), so that the odd
slow call and the catch-up a probe carries after plain steps count for what they cost.

For each D (0 = plain decoding) and each number n of draft tokens in all, the chains k_s <= D with the most
expected tokens take the n likeliest positions (a sequence's position j is reached and passed with probability
a^j); the time depends only on n and D, so the fastest (n, D) per token is the best chain plan under any scoring
curve. Where trees may be drafted, Dinkelbach's iteration on the throughput lambda also runs: a sequence drafts
position j while a^j is worth the marginal scoring time at the current throughput (a^j >= lambda * per-token
time, the line's slope), or its tree while the tree's gain beats the chain's by its extra nodes' time, and the
faster plan counts. The best D wins, and D = 0 whenever drafting would be slower than plain decoding
(Leviathan et al. 2023 give the chain's expectation; the scoring and call costs are what a CPU and a remote
proposer add to it). Plain decoding is timed again before a drafting plan runs on a plain time more than
FRESH_S seconds old: a shared machine's slow minute must not leave it looking dearer than it is. Only plans
that slow no sequence below FAIR_SHARE of its plain rate compete: one
forward serves the batch, and a request the drafter serves badly must not pay for the others' drafts. A sequence
kept at k = 0 learns nothing about its acceptance, and a plan kept at one size measures no slope: see `plan` for
the probes that keep both learning. A sequence's first tested positions move its estimate as a running mean would
(the prior counts as two), later ones as an average over about twenty. The prior is what recent sequences of the
same kind (greedy or sampled) achieved, once they tested enough positions (`SpecPolicy.new_estimate`), else an
agnostic 0.5: a request arriving where drafts are mostly rejected does not probe as if half were accepted. A
tree's verdict counts for alpha as its best-guess path's (the chain the drafter would have sent) does. The policy
plans with each sequence's alpha drawn towards its kind's as far as the kind's verdicts show a sequence's recent
acceptance to tell of its next (`AcceptanceEstimate.predicted`, `OwnWeight`): a run of accepted drafts raises alpha
more than it raises the next drafts' chances.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field, replace

from verifier_service.acceptance import MIN_POPULATION_POSITIONS, AcceptanceEstimate, OwnWeight, TreeMisses
from verifier_service.step_times import DRAFTING, FRESH_S, PLAIN, PROBE, DraftingRuns, Outcomes, StepCost, StepTimes

ITERATIONS = 4  # Dinkelbach converges in a few rounds on this concave ratio
PROBE_BUDGET = 0.01  # the share of the time probes may lose while plain decoding is the plan
# ... where the best drafting plan is expected about as fast as plain decoding. A probe is worth less the further
# drafting is from paying (the drafter must have got that much better for it to find something), so the budget
# falls linearly to PROBE_FAR_SHARE of PROBE_BUDGET where that plan is expected PROBE_FAR_GAP slower or more.
# Through the gateway at 8 clients, T = 0.8 (fp32 target, Zen 4 host), the best plan was 0.70-0.85 of plain
# decoding's rate once the requests' priors were their population's, and at the full budget 14 probes in 12 rounds
# took 0.2 s beyond plain steps' in 24 s (0.8%); with this rule, 3.
PROBE_FAR_SHARE = 0.2
PROBE_FAR_GAP = 0.2
# A drafting plan may slow no sequence that may draft below this share of its plain-decoding rate. A step is one
# forward for the whole batch: a sequence that drafts little pays for the others' drafts. Through the gateway at 8
# clients on two CPU cores, plans chosen for the batch's throughput alone kept the mean request about as fast as
# target-only's but made the unluckiest 15-20% slower (9.3-9.9 s against 8.1-8.4 s for 64 tokens, T = 0.8), and a
# batch is done when its last request is. 0.97: the floor a user who turns speculation on is owed.
FAIR_SHARE = 0.97
# A new sequence's prior is the acceptance recent sequences of its kind achieved, an average over about their
# last 100 tested positions, once there were this many. From 0.5, every new request probed as if half its drafts
# were accepted until its own estimate came down: at 8 clients, 64-token requests and acceptance 0.1, the
# policy's simulation (tests/unit/test_spec_policy.py) lost 2.1% to plain decoding, 1.1% from the population's.
POPULATION_WEIGHT = 0.01
# While plain decoding is clearly best (the best drafting plan PLAIN_MARGIN slower or more) and no sequence's
# estimate changed (none drafted), the plan is made again only every REPLAN_EVERY steps; between, each step counts
# towards the next probe at the last plan's probe loss. At batch 8 a plan took 0.3-0.5 ms of Python against a 21 ms
# step (bf16 target, Zen 4 host), most of what plain steps cost beyond a target-only verifier's.
REPLAN_EVERY = 8
PLAIN_MARGIN = 0.05
# A propose call that carries a catch-up (positions the proposer has not seen: a prompt, the tokens of plain steps it
# did not follow) costs its call plus a time per caught-up position, the median over about the last this many such
# calls. A plan is expected to pay it for every sequence that drafts and lags (`plan`'s `lags`). Co-located at 8
# clients (fp32 target, Zen 4 host) every call at batch 8 carried one (a prompt's 250-260 positions took 7-13 ms),
# none was counted, and the plan expected no propose time at all: probes ran on a cost they did not have.
CATCH_UP_WINDOW = 16
# A drafting plan is charged each sequence's catch-up spread over the steps that sequence may still run, at most
# this many: a lag is paid once, by whichever step drafts first, and only grows while the sequence decodes plainly.
# Charged over 4 steps, through the gateway at one client (fp32 target, tests/e2e/test_eagle_e2e.py), a new request's
# prompt (43 positions at ~0.25 ms: 2.7 ms a step on a 29 ms plain step, against 4 ms for a chain of one) kept every
# request whose prior (the population's acceptance) was at most about 0.25 plain for all its 48 tokens, as its lag
# grew, though a chain of one paid above 0.14 once caught up. A request about to end (fewer steps left than this)
# spreads it over its own: a lag is not worth paying for a token or two. Nor is one that drafting will not be kept
# up long enough to pay back: a catch-up is spread over no more steps than the drafting runs at that batch size
# lasted (`DraftingRuns`). Through the gateway at 8 clients (fp32 target, Zen 4 host, 2026-12-07) they lasted 1-3
# steps, and the steps that started them, charged a sixteenth of their catch-up, emitted 157 tokens in 622 ms
# where plain steps would have taken 549 (one propose call expected at 7.5 ms took 39.6).
CATCH_UP_HORIZON = 16

# A kind of sequence whose trees were passed over for this many of its chains drafts one, where that makes the
# step at most TREE_EXPLORE_LOSS longer: at most about 1% of the time (the probes' budget, PROBE_BUDGET), and an
# estimate that came out poor by chance, or a drafter whose trees got better, is noticed. At 10% no tree was
# explored after a poor estimate at one client: the tree's step (9 rows, 4 deep) was expected 12-44% longer than
# the chain of 2-3 the policy chose instead.
TREE_EXPLORE_EVERY = 32
TREE_EXPLORE_LOSS = 0.3

log = logging.getLogger("specdec.policy")


def _shape(plans: list[Plan]) -> tuple[int, int, int, bool]:
    """A step's batch size, draft tokens in all (a tree's nodes), deepest draft and whether any is a tree."""
    drafted, depth, tree = 0, 0, False
    for plan in plans:  # one loop, no calls: every plan weighed comes here
        drafted += plan.scored_nodes or plan.tree_nodes or plan.k
        if plan.k > depth:
            depth = plan.k
        if plan.tree_nodes:
            tree = True
    return len(plans), drafted, depth, tree


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{1e3 * seconds:.1f}"


def probe_budget(ratio: float) -> float:
    """The share of the time probes may lose, where the best drafting plan is expected at `ratio` of plain
    decoding's rate: PROBE_BUDGET at 1 or above, down to PROBE_FAR_SHARE of it at 1 - PROBE_FAR_GAP or below."""
    closeness = min(1.0, max(0.0, 1 - (1 - ratio) / PROBE_FAR_GAP))
    return PROBE_BUDGET * (PROBE_FAR_SHARE + (1 - PROBE_FAR_SHARE) * closeness)


@dataclass(frozen=True)
class PlainMemo:
    key: tuple  # per sequence: its estimate (which object, its values) and its largest k
    probe_every: float  # plain steps between probes: the probe's loss over its budget
    steps_left: int


@dataclass(frozen=True)
class Plan:
    k: int  # chain length (a tree's depth)
    tree_nodes: int = 0  # > 0: a tree of this many nodes instead of a chain
    # A tree's nodes less likely than this (the drafter's own path probability) are not worth their scored row:
    # what one costs, in tokens at the plan's rate (`SpecPolicy._priced`). 0: any.
    min_node_prob: float = 0.0
    scored_nodes: int = 0  # a tree's rows as expected (its kind's recent trees: TreeMisses.nodes); 0: tree_nodes


@dataclass
class SpecPolicy:
    max_tree_nodes: int = 0  # 0: chains only
    scoring: StepTimes = field(default_factory=lambda: StepTimes(stepwise=True))  # batch -> query tokens -> seconds
    propose_chain: StepTimes = field(default_factory=lambda: StepTimes(scales_with_batch=False))  # batch -> depth
    propose_tree: StepTimes = field(default_factory=lambda: StepTimes(scales_with_batch=False))  # -> call seconds
    # The rest of a step: plain ones (depth 0) apart from drafting ones, a line over depth like a propose call's
    rest_plain: StepTimes = field(default_factory=lambda: StepTimes(scales_with_batch=False))  # batch -> 0 -> seconds
    rest_drafting: StepTimes = field(default_factory=lambda: StepTimes(scales_with_batch=False))  # batch -> depth
    _probes: int = 0  # varied plans
    _probes_run: int = 0  # probes run while plain decoding is best
    _times: dict[tuple[int, int, int, bool, str], float] = field(default_factory=dict)  # _time's, within one plan()
    _parts_seen: dict[tuple[int, int, int, bool], StepCost] = field(default_factory=dict)  # _parts', likewise
    _chain_lists: dict[int, tuple[list[float], list[float], list[float]]] = field(default_factory=dict)  # likewise
    _positions_at: dict[int, tuple[list[tuple[float, int]], float]] = field(default_factory=dict)  # of _positions_of
    _positions_of: list | None = None
    _plain_steps: int = 0  # steps at plain decoding since the last probe
    _plain_timed_at: dict[int, float] = field(default_factory=dict)  # batch -> when a plain step was run to time it
    probed: bool = False  # the last plan was a probe of drafting while plain decoding is best
    # The chain acceptance of all sequences' drafts, greedy (True) apart from sampled: a new sequence's prior
    population: dict[bool, AcceptanceEstimate] = field(default_factory=dict)
    tree_misses: dict[bool, TreeMisses] = field(default_factory=dict)  # likewise: what trees add to chains
    own_weights: dict[bool, OwnWeight] = field(default_factory=dict)  # likewise: how far a sequence's own tells
    outcomes: Outcomes = field(default_factory=Outcomes)
    _plain_memo: PlainMemo | None = None  # the last plan, while plain decoding is clearly best
    _probe_every: float = 0.0  # the last plan's: plain steps between probes
    # Seconds per caught-up position of recent calls that carried a catch-up (beyond their call's own time)
    catch_up: deque[float] = field(default_factory=lambda: deque(maxlen=CATCH_UP_WINDOW))
    _per_position: float = 0.0  # their median (0 until one was measured)
    _lags: list[int] | None = None  # this plan's: per sequence, the positions its next call would catch up
    _spreads: list[float] = field(default_factory=list)  # this plan's, set with _lags: per sequence, the steps its
    # catch-up is spread over
    runs: DraftingRuns = field(default_factory=lambda: DraftingRuns(CATCH_UP_HORIZON))

    def new_estimate(self, greedy: bool) -> AcceptanceEstimate:
        """A new sequence's estimate: the recent acceptance of its kind where known (greedy and sampled drafts
        differ most: a sampled token matches the target's less often), else the agnostic prior; its trees are
        judged with its kind's."""
        seen = self._population(greedy)
        trees = self.tree_misses.setdefault(greedy, TreeMisses())
        own = self.own_weights.setdefault(greedy, OwnWeight(seen))
        if not own.known:
            return AcceptanceEstimate(tree_misses=trees, own_weight=own)
        return AcceptanceEstimate(alpha=seen.alpha, prior_tested=seen.tested, tree_misses=trees, own_weight=own)

    def _population(self, greedy: bool) -> AcceptanceEstimate:
        return self.population.setdefault(greedy, AcceptanceEstimate(weight=POPULATION_WEIGHT))

    def record_acceptance(self, greedy: bool, num_drafted: int, num_accepted: int) -> None:
        """A chain's verdict (or a tree's best-guess path's), for the population's estimate (a sequence's own is
        updated by the engine)."""
        self._population(greedy).update(num_drafted, num_accepted)

    def plan(
        self,
        seqs: list[tuple[AcceptanceEstimate, int]],
        vary: bool = False,
        lags: list[int] | None = None,
        horizons: list[int] | None = None,
    ) -> list[Plan]:
        """Per sequence (its acceptance, its largest allowed k): the batch's best plan. `lags`: per sequence, the
        positions its propose call would have to catch up (0 where it would carry no more than a step's tokens);
        `horizons`: per sequence, the tokens it may still emit (None: at least CATCH_UP_HORIZON each).

        A drafting plan is a candidate only if it slows no sequence that may draft below FAIR_SHARE of its plain
        rate; a sequence it would slow is first given a chain as deep as the plan allows. While plain decoding is
        best, a drafting plan is still run now and then (every sequence that may draft drafts at least one token):
        the best one, or where none is fair the one whose run costs least (one token a sequence, or a plan that
        slows someone), or that plan for one sequence alone where that loses less (`_cheapest_probe`); how often
        follows from how much it is expected to lose (the batch's throughput or its slowest sequence's rate,
        whichever loses more), so that probes cost at most PROBE_BUDGET of the time, less the further drafting is
        from paying (`probe_budget`), and a drafter that got better, or an estimate that dipped by chance, is
        noticed soonest where it matters most: near the break-even. `vary`
        (every probe_interval steps): a drafting plan drafts one token more or less, in turn, so that each cost is
        measured at more than one size and has a slope."""
        batch = len(seqs)
        plain = [Plan(0)] * batch
        if not any(k_max for _, k_max in seqs):  # no plan but plain: its rate is not needed (0.08 ms a step at 8)
            self.probed = False
            return plain
        self._lags = lags if lags and any(lags) else None
        run = self.runs.steps(len(seqs))
        self._spreads = [max(1.0, min(h, run)) for h in horizons or [CATCH_UP_HORIZON] * len(seqs)]
        key = tuple((id(acc), acc.predicted, acc.tree_misses.share, k_max) for acc, k_max in seqs)
        memo, self._plain_memo = self._plain_memo, None
        due = memo is None or self._plain_steps + 1 >= memo.probe_every  # a probe
        if memo is not None and memo.key == key and memo.steps_left > 0 and not due:
            self._plain_steps += 1
            self._plain_memo = replace(memo, steps_left=memo.steps_left - 1)
            self.probed = False
            return plain
        self._times.clear()  # the costs may have been measured since the last plan
        self._parts_seen.clear()
        self._chain_lists.clear()
        self._positions_at.clear()
        plain_rate = self._rate(plain, seqs)
        drafting, drafting_rate = None, 0.0  # the best plan that slows no sequence below FAIR_SHARE
        unfair = [[Plan(1 if k_max else 0) for _, k_max in seqs]]  # plans that do: only ever run as probes
        for depth in range(1, max((k_max for _, k_max in seqs), default=0) + 1):
            plans, _ = self._plan_at(depth, seqs)
            if not any(p.k for p in plans):
                continue
            fair = self._lift_slowed(plans, seqs, depth)
            if fair is None:
                unfair.append(plans)
            elif (rate := self._rate(fair, seqs)) > drafting_rate:
                drafting, drafting_rate = fair, rate
        self.probed = False
        if drafting is None and any(k_max for _, k_max in seqs):  # the probe that costs least: probed most often
            drafting = min(unfair, key=lambda plans: self._probe_loss(self._lifted(plans, seqs), seqs, plain_rate))
            drafting_rate = self._rate(drafting, seqs)
        chosen = self._priced(
            self._explore_trees(self._choose(seqs, plain, plain_rate, drafting, drafting_rate, vary), seqs), seqs
        )
        clearly = drafting is not None and drafting_rate < plain_rate * (1 - PLAIN_MARGIN)
        if chosen is plain and clearly and self.scoring.measured(batch, batch):  # not on a guessed plain time
            self._plain_memo = PlainMemo(key, self._probe_every, REPLAN_EVERY - 1)
        if log.isEnabledFor(logging.DEBUG):
            self._explain(seqs, chosen, plain_rate, drafting_rate)
        return chosen

    def _choose(
        self,
        seqs: list[tuple[AcceptanceEstimate, int]],
        plain: list[Plan],
        plain_rate: float,
        drafting: list[Plan] | None,
        drafting_rate: float,
        vary: bool,
    ) -> list[Plan]:
        if drafting is None:  # no sequence may draft
            return plain
        if drafting_rate <= plain_rate * (1 + 1e-9) or self._slowest_share(drafting, seqs) < FAIR_SHARE:
            self._plain_steps += 1
            probe, loss = self._cheapest_probe(self._lifted(drafting, seqs), seqs, plain_rate)
            known = plain_rate and self._judged_on_measurements(probe, seqs)
            self._probe_every = loss / probe_budget(drafting_rate / plain_rate if known else 1.0)
            if self._plain_steps < self._probe_every:
                return plain
            self._plain_steps, self.probed = 0, True
            for p, (acc, _) in zip(probe, seqs, strict=True):
                if p.k:
                    acc.probed_at = self._probes_run
            self._probes_run += 1
            return self._vary(probe, seqs) if vary else probe
        self._plain_steps = 0
        batch, now = len(seqs), self.scoring.clock()
        # The time drafting is judged against, measured again: at most once in FRESH_S seconds, even where the
        # step then goes unmeasured (a prompt's chunk beside the decodes)
        if self.scoring.stale(batch, batch) and now - self._plain_timed_at.get(batch, float("-inf")) > FRESH_S:
            self._plain_timed_at[batch] = now
            return plain
        return self._vary(drafting, seqs) if vary else drafting

    def _priced(self, chosen: list[Plan], seqs: list[tuple[AcceptanceEstimate, int]]) -> list[Plan]:
        """The plan, its trees told what a node must be worth: the scoring time a node adds at the plan's expected
        rate, in tokens (Dinkelbach's price, as `_best_for` prices a chain's positions). A node whose path the
        drafter puts below it emits less than its row costs: with the committed head a greedy node is accepted
        about 1.2 times as often as its path probability, a sampled one (T = 0.8) about half as often, so the price
        is taken as the probability itself. What the price saves is learned, not assumed: a tree is costed at the
        rows its kind's recent trees scored (`_tree`), and scoring is recorded by the rows a step scored.

        A node's time is what the plan's trees add to their best-guess paths (always sent, so the only rows the
        price can save), per node, on the scoring curve, with each tree at its bound: rows cost little within a
        block of the products and much across one. At the rows its recent trees scored instead, a kind whose
        price cut its trees down to their paths would read no added rows, price nothing, send whole trees next,
        and price again: on and off. At one client (fp32 target, Zen 4 host) a chain of 4 scored in 28.0 ms and a
        tree of 8 nodes in 29-30 ms, where the scoring line's slope over every size (0.5-1.3 ms a row, the step
        from one row to several in it) priced out nodes that cost almost nothing."""
        if not any(p.tree_nodes for p in chosen):
            return chosen
        paths = sum(p.k for p in chosen)
        added = sum(max(0, p.tree_nodes - p.k) for p in chosen)
        if added <= 0:
            return chosen
        batch = len(chosen)
        per_node = (self._scoring_part(batch, paths + added) - self._scoring_part(batch, paths)) / added
        price = self._rate(chosen, seqs) * per_node
        if price <= 0:
            return chosen
        return [replace(p, min_node_prob=min(price, 1.0)) if p.tree_nodes else p for p in chosen]

    def _explore_trees(self, chosen: list[Plan], seqs: list[tuple[AcceptanceEstimate, int]]) -> list[Plan]:
        """The plan, or where a sequence drafts a chain whose kind's trees were passed over TREE_EXPLORE_EVERY times,
        that sequence's tree instead, if its step is expected to take at most TREE_EXPLORE_LOSS longer: a tree holds
        the chain of its best guesses and accepts at least what that accepts, so the time is all it can lose."""
        nodes = self.max_tree_nodes
        if not nodes:
            return chosen
        for i, (p, (acc, k_max)) in enumerate(zip(chosen, seqs, strict=True)):
            if p.tree_nodes or not p.k or not 1 <= k_max < nodes:
                continue
            misses = acc.tree_misses
            misses.passed_over += 1
            if misses.passed_over < TREE_EXPLORE_EVERY:
                continue
            explored = [*chosen[:i], self._tree(acc, k_max), *chosen[i + 1 :]]
            if self._time(explored) <= (1 + TREE_EXPLORE_LOSS) * self._time(chosen):
                misses.passed_over = 0
                return explored
        return chosen

    def _judged_on_measurements(self, probe: list[Plan], seqs: list[tuple[AcceptanceEstimate, int]]) -> bool:
        """Whether what a probe would learn is known well enough to spend less on it far from the break-even: its
        rows' scoring was timed live and each of its sequences' acceptance rests on MIN_POPULATION_POSITIONS tested
        positions (its own, or those behind its prior). Else a probe's budget is the full one: a pessimistic guess
        (an agnostic prior, a scoring time read off other sizes) is what probes are there to correct."""
        batch, drafted, _, _ = _shape(probe)
        return self.scoring.measured(batch, batch + drafted) and all(
            acc.tested + acc.prior_tested >= MIN_POPULATION_POSITIONS
            for p, (acc, _) in zip(probe, seqs, strict=True)
            if p.k
        )

    @staticmethod
    def _lifted(plans: list[Plan], seqs: list[tuple[AcceptanceEstimate, int]]) -> list[Plan]:
        """A plan as a probe runs it: every sequence that may draft drafts at least one token."""
        return [replace(p, k=max(p.k, 1)) if k else p for p, (_, k) in zip(plans, seqs, strict=True)]

    def _cheapest_probe(
        self, probe: list[Plan], seqs: list[tuple[AcceptanceEstimate, int]], plain_rate: float
    ) -> tuple[list[Plan], float]:
        """The probe, or its plan for the one sequence probed longest ago alone (the others decoding plainly),
        whichever is expected to lose less, with its loss. Where drafting is far from paying, a batch's probe for
        every sequence scores a token more for each and carries each one's catch-up: at 8 clients (fp32 target,
        Zen 4 host) such probes took 106 ms against a 31 ms plain step (64 ms of scoring, 39 ms of a propose call
        that carried every prompt). One sequence at a time, in turn, each probe costs a fraction of that, so the
        budget runs more of them, and they keep the batch learning as the population's estimate does."""
        loss = self._probe_loss(probe, seqs, plain_rate)
        drafting = [i for i, p in enumerate(probe) if p.k]
        if len(drafting) < 2:
            return probe, loss
        pick = min(drafting, key=lambda i: seqs[i][0].probed_at)
        alone = [p if i == pick else Plan(0) for i, p in enumerate(probe)]
        alone_loss = self._probe_loss(alone, seqs, plain_rate)
        return (alone, alone_loss) if alone_loss < loss else (probe, loss)

    def _probe_loss(self, plans: list[Plan], seqs: list[tuple[AcceptanceEstimate, int]], plain_rate: float) -> float:
        """What running `plans` once as a probe costs, in plain steps: it loses (1 - its rate / plain's) of its own
        time, T_probe / T_plain plain steps, or for its slowest sequence what that one loses, whichever is more
        (its time as probes took: a catch-up)."""
        plain_time, probe_time = self._time([Plan(0)] * len(plans)), self._time(plans, PROBE)
        rate = self._rate(plans, seqs, PROBE)
        shortfall = max(1 - rate / plain_rate if plain_rate else 0.0, 1 - self._slowest_share(plans, seqs, PROBE))
        return shortfall * (probe_time / plain_time if plain_time else 1.0)

    def _gain(self, plan: Plan, acc: AcceptanceEstimate) -> float:
        return acc.expected_tree_gain(plan.k) if plan.tree_nodes else acc.chain_gain(plan.k)

    def _shares(
        self, plans: list[Plan], seqs: list[tuple[AcceptanceEstimate, int]], kind: str | None = None
    ) -> list[float]:
        """Per sequence, its expected rate under `plans` as a share of its rate decoding plainly (1 + gain over the
        step's time, against 1 over a plain step's); 1 while a time is unknown, and for a sequence that may not draft
        (its own max_draft_tokens of 0, no room left): it is not counted, or it would veto everyone's drafts."""
        batch = len(plans)
        plain_time, time = self._time([Plan(0)] * batch), self._time(plans, kind)
        if plain_time <= 0 or time <= 0:
            return [1.0] * batch
        return [
            (1 + self._gain(p, acc)) * plain_time / time if k_max else 1.0
            for p, (acc, k_max) in zip(plans, seqs, strict=True)
        ]

    def _slowest_share(
        self, plans: list[Plan], seqs: list[tuple[AcceptanceEstimate, int]], kind: str | None = None
    ) -> float:
        return min(self._shares(plans, seqs, kind), default=1.0)

    def _lift_slowed(
        self, plans: list[Plan], seqs: list[tuple[AcceptanceEstimate, int]], depth: int
    ) -> list[Plan] | None:
        """The plan, with every sequence it slows below FAIR_SHARE drafting a chain as deep as the plan allows (its
        best chance to gain what the step costs it); None when that does not bring every sequence up to it."""
        shares = self._shares(plans, seqs)
        if min(shares, default=1.0) >= FAIR_SHARE:
            return plans
        lifted = [
            Plan(min(depth, k_max)) if share < FAIR_SHARE else p
            for p, (_, k_max), share in zip(plans, seqs, shares, strict=True)
        ]
        return lifted if self._slowest_share(lifted, seqs) >= FAIR_SHARE else None

    def _explain(self, seqs, chosen: list[Plan], plain_rate: float, drafting_rate: float) -> None:
        """Why this plan (the DEBUG log: `--log-level DEBUG` on the verifier)."""
        batch = len(seqs)
        depth = max((p.k for p in chosen), default=0) or 1
        calls = self.propose_tree if any(p.tree_nodes for p in chosen) else self.propose_chain
        trees = [self._tree(acc, k_max) if k_max else Plan(0) for acc, k_max in seqs]
        parts = self._measured_parts(*_shape(trees))
        log.debug(
            "plan batch=%d alpha (own, planned)=%s tree gain=%s (misses %s) chosen=%s node price=%.3f probe=%s "
            "rate plain/drafting=%.1f/%.1f tok/s "
            "scoring(1 token)=%.1f ms +%.2f ms/token propose(k=%d)=%s ms rest(k=0/%d)=%s/%s ms "
            "slower than expected plain/drafting/probe=%.2fx/%.2fx/%.2fx step chosen/trees=%s/%s ms "
            "(trees: scoring/propose/rest=%s) catch-ups spread over %.1f steps; scoring by draft tokens=%s ms",
            batch, [(round(acc.alpha, 2), round(acc.predicted, 2)) for acc, _ in seqs[:8]],
            [round(acc.expected_tree_gain(k_max), 2) for acc, k_max in seqs[:8]] if self.max_tree_nodes else "-",
            [(round(a.tree_misses.share, 2), a.tree_misses.trees, round(a.tree_misses.nodes, 1)) for a, _ in seqs[:8]],
            [(p.k, p.tree_nodes) for p in chosen[:8]], max((p.min_node_prob for p in chosen), default=0.0),
            self.probed, plain_rate, drafting_rate, 1e3 * (self.scoring.estimate(batch, batch) or 0.0),
            1e3 * self.scoring.slope(batch), depth, _ms(calls.estimate(batch, depth)), depth,
            _ms(self._rest(batch, 0)), _ms(self._rest(batch, depth)),
            *(self.outcomes.slowdown(batch, kind) for kind in (PLAIN, DRAFTING, PROBE)),
            _ms(self._time(chosen)), _ms(self._time(trees)) if self.max_tree_nodes else "-",
            "/".join(_ms(t) for t in (parts.scoring, parts.propose, parts.rest)) if self.max_tree_nodes else "-",
            self.runs.steps(batch),
            "/".join(_ms(self.scoring.estimate(batch, batch + n)) for n in range(self._most_drafted(batch, depth) + 1)),
        )  # fmt: skip

    def _most_drafted(self, batch: int, depth: int) -> int:
        """The most draft tokens a plan `depth` deep could score: the DEBUG line's scoring curve goes that far."""
        return batch * (depth + self.max_tree_nodes)

    def _vary(self, plans: list[Plan], seqs: list[tuple[AcceptanceEstimate, int]]) -> list[Plan]:
        self._probes += 1
        step = 1 if self._probes % 2 else -1
        return [
            replace(p, k=min(k_max, max(1, p.k + step))) if p.k else p
            for p, (_, k_max) in zip(plans, seqs, strict=True)
        ]

    def _plan_at(self, depth: int, seqs: list[tuple[AcceptanceEstimate, int]]) -> tuple[list[Plan], float]:
        """The best plan at most `depth` deep: the best filled chain plan, or where trees may be drafted
        Dinkelbach's (each draft token at the line's marginal price, a tree where it pays) or the better of those
        two with every drafting sequence's chain grown into its tree (`_grown`), whichever is fastest. For chains
        the filled plan is never slower: it has the most expected tokens for its number of draft tokens."""
        filled, filled_rate = self._filled(depth, seqs)
        if filled is not None and self._lags is not None and self._per_position:
            filled_rate = self._rate(filled, seqs)  # with the catch-ups its drafting sequences carry
        if filled is not None and not any(self._tree_fits(k_max, depth) for _, k_max in seqs):
            # No sequence may draft a tree this deep: the filled plan is the candidate, as with chains only (running
            # Dinkelbach here instead dropped the depth whenever plain decoding beat its chains)
            return filled, filled_rate
        batch = len(seqs)
        per_token = self.scoring.slope(batch)
        rate = self._rate([Plan(0)] * batch, seqs)
        plans = [Plan(0)] * batch
        for _ in range(ITERATIONS):
            candidate = [self._best_for(acc, min(depth, k_max), k_max, rate * per_token) for acc, k_max in seqs]
            if not any(p.k for p in candidate):
                break  # keeps the last plan that drafted, with its own rate
            plans, rate = candidate, self._rate(candidate, seqs)
        best, best_rate = (filled, filled_rate) if filled is not None and filled_rate > rate else (plans, rate)
        grown = self._grown(best, depth, seqs)
        if grown is None or (grown_rate := self._rate(grown, seqs)) <= best_rate:
            return best, best_rate
        # Judged as `plan` will run them, lifted to FAIR_SHARE (where a plan cannot be, `plan` drops the depth): a
        # grown tree's rows may slow a sequence that drafts little below its share
        fair_best, fair_grown = self._lift_slowed(best, seqs, depth), self._lift_slowed(grown, seqs, depth)
        if fair_grown is None or (
            fair_best is not None and self._rate(fair_best, seqs) >= self._rate(fair_grown, seqs)
        ):
            return best, best_rate
        return grown, grown_rate

    def _grown(self, plans: list[Plan], depth: int, seqs: list[tuple[AcceptanceEstimate, int]]) -> list[Plan] | None:
        """The plan with each sequence that drafts a chain, may draft a tree this deep (at its full depth, as
        `_best_for`) and whose tree is expected to add to its chain drafting that tree instead (None where none
        may), to be judged on the step times measured. Dinkelbach weighs a tree's nodes at
        the scoring line's slope over every size, and rows cost little within a block of the products and much
        across one: at one client (fp32 target, Zen 4 host) the slope swung between 0.1 and 2.2 ms a row as the
        times of one row and of several moved, where a tree of 8 nodes scored in 29-30 ms against 28 for a chain
        of 4, and 38% of the plans drafted chains, most of them at the steep slopes (a mean of 1.1 ms a row
        against 0.7 where it drafted trees)."""
        grown = [
            self._tree(acc, k_max)
            if p.k and not p.tree_nodes and self._tree_fits(k_max, depth) and self._tree_adds(p, acc, k_max)
            else p
            for p, (acc, k_max) in zip(plans, seqs, strict=True)
        ]
        return None if grown == plans else grown

    def _tree_fits(self, k_max: int, depth: int) -> bool:
        """Whether a sequence may draft a tree in a plan at most `depth` deep: trees are drafted at a sequence's
        full depth only, and only where it allows fewer tokens than a tree's nodes."""
        return 1 <= k_max <= depth and k_max < self.max_tree_nodes

    @staticmethod
    def _tree_adds(chain: Plan, acc: AcceptanceEstimate, k_max: int) -> bool:
        """Whether the sequence's tree is expected to emit more than its chain: one whose trees add nothing would
        only add rows to the grown plan, and could sink it for the sequences whose trees pay."""
        return acc.expected_tree_gain(k_max) > acc.chain_gain(chain.k)

    def _filled(self, depth: int, seqs: list[tuple[AcceptanceEstimate, int]]) -> tuple[list[Plan] | None, float]:
        """Of the chain plans drafting n tokens in all, the one with the most expected tokens takes the n likeliest
        positions among every sequence's first `depth` (position j of a sequence is reached with probability
        alpha^j, so each sequence's are taken in order); the n whose step is fastest per token wins (with its
        rate; None where no sequence may draft). Where the scoring time rises in steps, filling the rows a step
        costs anyway is what pays, and a marginal price per token (a line's slope) cannot see it. Its lists of
        positions and parts are kept from `plan`'s start to the next one's: called outside `plan`, clear them first."""
        batch = len(seqs)
        values, remaining = self._positions(depth, seqs)
        ks, tokens, deepest = [0] * batch, float(batch), 0
        best, best_rate = None, 0.0
        # `_step_time`'s parts, read by index: at 8 sequences and k <= 16 there are a thousand plans to weigh. Past
        # the best, no later n can win once even all the remaining tokens at the time the step takes now (scoring
        # only grows with n: StepTimes.estimate) would not beat it.
        scoring, propose, rest = self._chain_parts(batch, depth)
        slowdown = self.outcomes.slowdown(batch, DRAFTING)
        least_extra = min(propose[d] + rest[d] for d in range(1, depth + 1)) if depth else 0.0
        for n, (value, i) in enumerate(values, start=1):
            ks[i] += 1
            tokens += value
            remaining -= value
            if ks[i] > deepest:
                deepest = ks[i]
            if n == len(scoring):
                scoring.append(self._scoring_part(batch, n))
            seconds = (scoring[n] + propose[deepest] + rest[deepest]) * slowdown
            rate = tokens / seconds if seconds > 0 else tokens
            if rate > best_rate:
                best, best_rate = list(ks), rate
            elif tokens + remaining < best_rate * (scoring[n] + least_extra) * slowdown * (1 - 1e-9):
                break
        if best is None:
            return None, 0.0
        return [Plan(k) for k in best], best_rate

    def _positions(
        self, depth: int, seqs: list[tuple[AcceptanceEstimate, int]]
    ) -> tuple[list[tuple[float, int]], float]:
        """(alpha^j, sequence) for every sequence's positions j <= min(depth, k_max), likeliest first, and their sum;
        kept for the rest of the plan, each depth's made from the one above it."""
        if depth <= 0:
            return [], 0.0
        if self._positions_of is not seqs:
            self._positions_at.clear()
            self._positions_of = seqs
        if depth not in self._positions_at:
            above, total = self._positions(depth - 1, seqs)
            new = [(acc.predicted**depth, i) for i, (acc, k_max) in enumerate(seqs) if k_max >= depth]
            self._positions_at[depth] = (sorted(above + new, reverse=True), total + sum(v for v, _ in new))
        return self._positions_at[depth]

    def _chain_parts(self, batch: int, depth: int) -> tuple[list[float], list[float], list[float]]:
        """A chain step's parts as `_measured_parts` gives them, as lists kept for the rest of the plan: scoring by
        the draft tokens in all (from 0, extended by the caller as it goes), the propose call and the rest by the
        deepest draft (0..depth)."""
        if batch not in self._chain_lists:
            self._chain_lists[batch] = ([self._scoring_part(batch, 0)], [], [])
        scoring, propose, rest = self._chain_lists[batch]
        while len(propose) <= depth:
            propose.append(self._propose_part(batch, len(propose), False))
            rest.append(self._rest(batch, len(rest)) or 0.0)
        return scoring, propose, rest

    def _best_for(self, acc: AcceptanceEstimate, depth: int, k_max: int, token_price: float) -> Plan:
        """The sequence's plan at a price (in emitted tokens) per scored draft token, at most `depth` deep. A tree
        is drafted at the sequence's full depth only."""
        k, alpha = 0, acc.predicted
        while k < depth and alpha ** (k + 1) >= token_price:
            k += 1
        if self._tree_fits(k_max, depth):  # `depth` is at most k_max here: the sequence's full depth
            tree = self._tree(acc, k_max)
            tree_value = acc.expected_tree_gain(k_max) - token_price * (tree.scored_nodes or self.max_tree_nodes)
            if tree_value > acc.chain_gain(k) - token_price * k:
                return tree
        return Plan(k)

    def _tree(self, acc: AcceptanceEstimate, k_max: int) -> Plan:
        """A tree at the sequence's full depth, expected to score as many rows as its kind's recent trees."""
        nodes = self.max_tree_nodes
        return Plan(k_max, nodes, scored_nodes=min(nodes, round(acc.tree_misses.nodes)))

    def _rate(self, plans: list[Plan], seqs: list[tuple[AcceptanceEstimate, int]], kind: str | None = None) -> float:
        """Expected tokens per second of a plan (0 when a time is unknown and the plan is plain decoding: any
        measured plan beats it)."""
        batch = len(plans)
        tokens = batch + sum(self._gain(p, acc) for p, (acc, _) in zip(plans, seqs, strict=True))
        seconds = self._time(plans, kind)
        return tokens / seconds if seconds > 0 else float(tokens)

    def _time(self, plans: list[Plan], kind: str | None = None) -> float:
        """A plan's expected step time: scoring, the propose call and the rest of the step (0 where not measured
        yet), as much slower as steps of its kind ran than so expected."""
        batch, drafted, depth, tree = _shape(plans)
        seconds = self._step_time(batch, drafted, depth, tree, kind or (DRAFTING if depth else PLAIN))
        return seconds + self._catch_up_of(plans, kind) if depth else seconds

    def _catch_up_of(self, plans: list[Plan], kind: str | None = None) -> float:
        """What the plan's propose call is expected to take beyond its call: every drafting sequence's lag, in
        full for a probe (what running it once costs), else spread over the steps it may still run (at most
        CATCH_UP_HORIZON, and at most as many as drafting runs at this batch size lasted): a lag is paid once, by
        whichever step drafts first, and only grows while the sequence decodes plainly."""
        lags = self._lags
        if lags is None or not self._per_position:
            return 0.0
        if kind == PROBE:
            return self.catch_up_seconds(sum(lag for p, lag in zip(plans, lags, strict=True) if p.k))
        steps = zip(plans, lags, self._spreads, strict=True)
        return self.catch_up_seconds(sum(lag / spread for p, lag, spread in steps if p.k))

    def catch_up_seconds(self, positions: float) -> float:
        """A catch-up of `positions` as recent ones took (0 before any was measured: a cheap guess, corrected)."""
        return self._per_position * positions

    def _step_time(self, batch: int, drafted: int, depth: int, tree: bool, kind: str) -> float:
        """A step of `drafted` draft tokens in all, `depth` deep; kept for the rest of the plan."""
        key = (batch, drafted, depth, tree, kind)
        seconds = self._times.get(key)
        if seconds is None:
            seconds = self._parts(batch, drafted, depth, tree).seconds * self.outcomes.slowdown(batch, kind)
            self._times[key] = seconds
        return seconds

    def _parts(self, batch: int, drafted: int, depth: int, tree: bool) -> StepCost:
        """`_measured_parts`, kept for the rest of the plan."""
        key = (batch, drafted, depth, tree)
        parts = self._parts_seen.get(key)
        if parts is None:
            parts = self._parts_seen[key] = self._measured_parts(batch, drafted, depth, tree)
        return parts

    def _measured_parts(self, batch: int, drafted: int, depth: int, tree: bool) -> StepCost:
        """Scoring, the propose call when it drafts and the rest, each as measured (0 where not measured yet)."""
        return StepCost(
            tokens=0.0,
            scoring=self._scoring_part(batch, drafted),
            propose=self._propose_part(batch, depth, tree),
            rest=self._rest(batch, depth) or 0.0,
        )

    def _scoring_part(self, batch: int, drafted: int) -> float:
        return self.scoring.estimate(batch, batch + drafted) or 0.0

    def _propose_part(self, batch: int, depth: int, tree: bool) -> float:
        if not depth:
            return 0.0
        calls, other = (self.propose_tree, self.propose_chain) if tree else (self.propose_chain, self.propose_tree)
        estimate = calls.estimate(batch, depth)
        if estimate is None:
            # A kind of call measured at no batch size: the other kind's is the nearest guess, not a free call. At 8
            # clients, co-located, every call at batch 8 carried a catch-up (left out) and the stack's calls at one
            # client were trees: a free chain call made one sequence's chain look like it paid (304 against 285
            # tok/s expected), and it lost each time it ran.
            estimate = other.estimate(batch, depth)
        return estimate or 0.0

    def predict(self, steps: list[tuple[AcceptanceEstimate, Plan]], scored: int | None = None) -> StepCost | None:
        """A step's expected tokens and times by its parts' measurements, per sequence its acceptance and the plan
        it ran (`scored`: the draft tokens it scored, where fewer came than were asked for); None while scoring
        was never measured at its batch size (nothing to compare the step with). A propose call or a rest never
        measured counts as free, as in plans: a probe's calls that all carried a catch-up (left out of the propose
        times) then show as its slowdown. Not from the plan's cache: the step's own parts were recorded since."""
        batch, drafted, depth, tree = _shape([plan for _, plan in steps])
        drafted = drafted if scored is None else scored
        if self.scoring.estimate(batch, batch + drafted) is None:
            return None
        tokens = batch + sum(self._gain(plan, acc) for acc, plan in steps)
        return replace(self._measured_parts(batch, drafted, depth, tree), tokens=tokens)

    def record_outcome(
        self,
        batch: int,
        depth: int,
        predicted: StepCost | None,
        realised: StepCost,
        catch_up: bool = False,
        probe: bool = False,
    ) -> None:
        """A decode step's emitted tokens and times (its rest up to the next step's start) against what was
        expected of it."""
        self.runs.add(batch, depth > 0 and not probe)
        if predicted is None:
            return
        kind = PROBE if probe else DRAFTING if depth else PLAIN
        self.outcomes.add(batch, kind, predicted.seconds, realised.seconds)
        if not log.isEnabledFor(logging.DEBUG):  # every decode step: no formatting unless asked for
            return
        log.debug(
            "outcome batch=%d depth=%d tokens=%.2f/%.0f scoring=%.1f/%.1f propose=%.1f/%.1f rest=%.1f/%.1f "
            "(predicted/realised)%s%s",
            batch, depth, predicted.tokens, realised.tokens, 1e3 * predicted.scoring, 1e3 * realised.scoring,
            1e3 * predicted.propose, 1e3 * realised.propose, 1e3 * predicted.rest, 1e3 * realised.rest,
            " catch-up" if catch_up else "", " probe" if probe else "",
        )  # fmt: skip

    def record_step(self, batch: int, query_tokens: int, seconds: float) -> None:
        """A decode step's scoring time (every sequence fed one token plus its drafts)."""
        self.scoring.add(batch, query_tokens, seconds)

    def record_calibration(self, batch: int, query_tokens: int, seconds: float) -> None:
        """A scoring time measured before serving (calibration.py)."""
        self.scoring.calibrate(batch, query_tokens, seconds)

    def _rest(self, batch: int, depth: int) -> float | None:
        """Until a drafting step's rest is measured it is taken as a plain one's."""
        plain = self.rest_plain.estimate(batch, 0)
        drafting = self.rest_drafting.estimate(batch, depth) if depth else None
        return plain if drafting is None else drafting

    def record_rest(self, batch: int, depth: int, seconds: float) -> None:
        """A decode step's time beyond scoring and the propose call, up to the next step's start."""
        (self.rest_drafting if depth else self.rest_plain).add(batch, depth, seconds)

    def record_catch_up(self, batch: int, depth: int, tree: bool, seconds: float, positions: int) -> None:
        """A propose call that carried a catch-up of `positions`: its time beyond what such a call costs without
        one, per position (not a sample of the call's own cost: the next call may carry none). A call that took
        less than such a call is expected to cost without a catch-up is a sample of that cost all the same (it
        can cost no more): co-located, every probe after plain steps carries a catch-up, and at one client
        (bf16 target, 2026-12-05) two slow early calls (11-16 ms) left a call at k = 1 expected at 11.3 ms while
        the probes' calls took 0.1-5.8 ms: the policy decoded plainly (0.98x target-only) for the whole run."""
        if positions <= 0:
            return
        expected = self._propose_part(batch, depth, tree)
        self.catch_up.append(max(0.0, seconds - expected) / positions)
        self._per_position = statistics.median(self.catch_up)
        if seconds < expected:
            self.record_propose(batch, depth, tree, seconds)

    def record_propose(self, batch: int, depth: int, tree: bool, seconds: float) -> None:
        """A propose call's time on the critical path, `depth` its deepest draft request."""
        (self.propose_tree if tree else self.propose_chain).add(batch, depth, seconds)
