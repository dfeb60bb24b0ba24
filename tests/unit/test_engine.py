"""Engine behaviour on tiny random models: exactness, stops, aborts, preemption, counters, seeds."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest
import torch

from proposer_service.ngram import NgramDrafter
from shared.errors import InvalidRequestError, QueueFullError
from shared.kv.block_manager import BlockManager
from shared.model.build import CacheConfig
from shared.sampling import SamplingParams
from specdec_local.builder import build_engine, make_draft_model_drafter
from tests.law import first_two_token_counts, law_pvalue, two_token_law
from tests.tiny import hf_greedy, tiny_target, tiny_target_hf, tiny_weak_draft  # noqa: F401 (fixtures)
from verifier_service.acceptance import AcceptanceEstimate
from verifier_service.engine import Engine, EngineConfig
from verifier_service.scheduler import Scheduler
from verifier_service.sequence import FinishReason, Sequence

VOCAB = 96
EOS = VOCAB - 1


def engine_with(target, drafter=None, k=3, max_num_seqs=4, num_blocks=None, block_size=4, max_model_len=128, **kw):
    kw.setdefault("adaptive_k", False)  # fixed k unless a test is about the adaptive policy
    config = EngineConfig(num_speculative_tokens=k, max_num_seqs=max_num_seqs, max_model_len=max_model_len, **kw)
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks)
    if drafter == "same":
        drafter = make_draft_model_drafter(*target, config, CacheConfig(block_size=block_size))
    elif isinstance(drafter, tuple):
        drafter = make_draft_model_drafter(*drafter, config, CacheConfig(block_size=block_size))
    return build_engine(target, drafter, config, cache)


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    outs: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.output_ids
        steps += 1
        assert steps < 10_000
    return outs


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, EOS) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


@pytest.mark.parametrize("drafter", [None, "same", "weak", "ngram"])
@pytest.mark.parametrize(("k", "max_num_seqs"), [(1, 1), (3, 4), (5, 3)])
def test_greedy_equals_transformers(target_hf, target, weak_draft, drafter, k, max_num_seqs):
    d = {"weak": weak_draft, "ngram": NgramDrafter()}.get(drafter, drafter)
    engine = engine_with(target, d, k=k, max_num_seqs=max_num_seqs)
    ps = prompts(6)
    outs = run(engine, ps, SamplingParams(max_tokens=24, ignore_eos=True))
    for i, p in enumerate(ps):
        assert outs[f"r{i}"] == hf_greedy(target_hf, p, 24, eos=False), f"prompt {i}"
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_draft_equal_to_target_accepts_everything(target):
    engine = engine_with(target, "same", k=4)
    run(engine, prompts(3), SamplingParams(max_tokens=30, ignore_eos=True))
    assert engine.stats.drafted_tokens > 0
    assert engine.stats.accepted_tokens == engine.stats.drafted_tokens


def test_counters_identities(target, weak_draft):
    engine = engine_with(target, weak_draft, k=3)
    run(engine, prompts(4), SamplingParams(max_tokens=20, ignore_eos=True))
    s = engine.stats
    assert 0 <= s.accepted_tokens <= s.drafted_tokens
    assert s.emitted_tokens == s.accepted_tokens + s.sequence_steps
    assert s.tokens_per_draft_round == pytest.approx(1 + s.accepted_tokens / s.draft_rounds)


def test_preemption_by_recompute_keeps_greedy_output(target_hf, target, weak_draft):
    # Each sequence needs up to (30 + 40 + 4) / 4 ~ 19 blocks; 24 blocks for 4 sequences forces preemption.
    engine = engine_with(target, weak_draft, k=3, num_blocks=24, max_model_len=90)
    ps = prompts(4, seed=3)
    outs = run(engine, ps, SamplingParams(max_tokens=40, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(ps):
        assert outs[f"r{i}"] == hf_greedy(target_hf, p, 40, eos=False)
    assert_all_released(engine)  # with the prefix cache on (the default): preempted blocks are reused or freed


def test_chunked_prefill_keeps_output(target_hf, target):
    engine = engine_with(target, "same", k=2, max_num_batched_tokens=7)
    ps = prompts(3, seed=5)
    outs = run(engine, ps, SamplingParams(max_tokens=12, ignore_eos=True))
    for i, p in enumerate(ps):
        assert outs[f"r{i}"] == hf_greedy(target_hf, p, 12, eos=False)


def test_stops_on_eos_stop_ids_and_max_tokens(target_hf, target):
    p = prompts(1, seed=7)[0]
    free_run = hf_greedy(target_hf, p, 30, eos=False)
    stop_token = free_run[10]
    first = free_run.index(stop_token)
    engine = engine_with(target, "same", k=4)
    engine.add_request("stop", p, SamplingParams(max_tokens=30, stop_token_ids=(stop_token,), ignore_eos=True))
    engine.add_request("len", p, SamplingParams(max_tokens=7, ignore_eos=True))
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    assert results["stop"].output_ids == free_run[: first + 1]
    assert results["stop"].finish_reason == FinishReason.STOP
    assert results["len"].output_ids == free_run[:7]
    assert results["len"].finish_reason == FinishReason.LENGTH


def test_drafts_accepted_past_the_finishing_token_are_not_counted(target_hf, target):
    """A draft equal to the target accepts all k drafts; a stop token among them ends the request there, and the
    drafts after it were never emitted: the counts (usage, engine stats, spans) are of what the client got, and
    emitted = accepted + sequence steps still holds (a step that ended on a draft counts it as its own token)."""
    p = prompts(1, seed=7)[0]
    free_run = hf_greedy(target_hf, p, 30, eos=False)
    engine = engine_with(target, "same", k=4)
    emitted = 0
    mid_draft = 0
    for stop_at in range(4, 14):  # some land on a bonus token, most among the drafts
        stop_token = free_run[stop_at]
        params = SamplingParams(max_tokens=30, stop_token_ids=(stop_token,), ignore_eos=True)
        engine.add_request(f"s{stop_at}", p, params)
        while engine.has_unfinished():
            for out in engine.step():
                emitted += len(out.new_token_ids)
                # every draft is accepted: all the emitted tokens but the step's own one are drafts' gains
                assert out.num_accepted == len(out.new_token_ids) - 1
                if out.finished and 0 < len(out.new_token_ids) <= out.num_drafted:
                    mid_draft += 1  # it ended on a draft, before the bonus token
        assert out.output_ids == free_run[: free_run.index(stop_token) + 1]
    assert mid_draft > 0
    stats = engine.stats
    assert stats.emitted_tokens == emitted == stats.accepted_tokens + stats.sequence_steps


def test_eos_stops_unless_ignored(target):
    engine = engine_with(target, None, k=0)
    # A target whose EOS is forced: every token is EOS when its logit dominates, so use the model's own
    # EOS id as a stop test through eos_token_ids.
    engine.eos_token_ids = frozenset(range(VOCAB))
    outs = run(engine, prompts(1), SamplingParams(max_tokens=10))
    assert len(outs["r0"]) == 1
    outs = run(engine, prompts(1, seed=1), SamplingParams(max_tokens=10, ignore_eos=True))
    assert len(outs["r0"]) == 10


def test_context_limit_finishes_with_length(target):
    engine = engine_with(target, "same", k=4, max_model_len=40)
    p = prompts(1)[0]
    outs = run(engine, [p], SamplingParams(max_tokens=100, ignore_eos=True))
    assert len(p) + len(outs["r0"]) == 40


def test_abort_frees_blocks_and_drafter_state(target, weak_draft):
    engine = engine_with(target, weak_draft, k=3)
    for i, p in enumerate(prompts(3)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.blocks.num_free_blocks < engine.blocks.num_blocks
    for i in range(3):
        assert engine.abort(f"r{i}")
    assert not engine.abort("r0")  # twice is harmless
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not engine.has_unfinished()
    drafter = engine.drafter
    assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks
    assert not drafter.states


def test_abort_one_leaves_others_exact(target_hf, target, weak_draft):
    engine = engine_with(target, weak_draft, k=3)
    ps = prompts(3, seed=11)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    engine.abort("r1")
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.output_ids
    assert set(outs) == {"r0", "r2"}
    for i in (0, 2):
        assert outs[f"r{i}"] == hf_greedy(target_hf, ps[i], 20, eos=False)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "empty"),
        ([1] * 200, SamplingParams(), "context limit"),
        ([1, VOCAB], SamplingParams(), "outside the vocabulary"),
        ([1, 2], SamplingParams(temperature=-1), "temperature"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p"),
        ([1, 2], SamplingParams(top_k=-1), "top_k"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(stop_token_ids=(VOCAB + 3,)), "stop_token_ids"),
    ],
)
def test_invalid_requests_are_refused_clearly(target, prompt, params, message):
    engine = engine_with(target, None, k=0)
    engine.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=3))
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request("bad", prompt, params)
    outs = run(engine, [], SamplingParams())
    assert len(outs["ok"]) == 3


def test_queue_full(target):
    engine = engine_with(target, None, k=0, max_num_seqs=1, max_waiting=1)
    engine.add_request("a", [1, 2], SamplingParams())
    engine.add_request("b", [1, 2], SamplingParams())  # a burst within one step: "a" takes the free slot
    with pytest.raises(QueueFullError):
        engine.add_request("c", [1, 2], SamplingParams())
    engine.step()  # "a" runs, "b" waits
    with pytest.raises(QueueFullError):
        engine.add_request("c", [1, 2], SamplingParams())
    engine.abort("a")
    engine.add_request("c", [1, 2], SamplingParams())  # a slot is free again


def test_cache_smaller_than_one_sequence_is_refused(target):
    with pytest.raises(ValueError, match="KV cache"):
        engine_with(target, None, k=0, num_blocks=4, max_model_len=128)


@pytest.mark.parametrize("drafter", [None, "weak"])
def test_seeded_sampling_is_reproducible(target, weak_draft, drafter):
    d = weak_draft if drafter else None
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    first = run(engine_with(target, d, k=3), prompts(2), params)
    second = run(engine_with(target, d, k=3), prompts(2), params)
    other = run(engine_with(target, d, k=3), prompts(2), SamplingParams(temperature=1.0, seed=99, max_tokens=20))
    assert first == second
    assert first != other


def test_sampled_output_law_matches_target(target_hf, target, weak_draft):
    """Sampling through speculative decoding (sampled drafts with truncated sparse probabilities) gives
    the target's distribution: the first two emitted tokens' marginals against the exact law. The second
    token comes from a speculative step (k = 2 since 3 tokens remain after the prefill)."""
    temperature = 1.5
    first, second = two_token_law(target_hf, lambda logits: torch.softmax(logits / temperature, -1), VOCAB)
    engine = engine_with(target, weak_draft, k=3, max_num_seqs=64, max_waiting=5000, max_model_len=16)
    engine.drafter.top_n = 8  # truncated drafts: the draft sends only its top 8 tokens
    n = 3000
    params = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True)
    counts = first_two_token_counts(engine, n, lambda i: params, VOCAB)
    for observed, law in ((counts[0], first), (counts[1], second)):
        assert law_pvalue(observed, law, n) > 1e-4
    # Drafts were really sampled and both accepted and rejected, so the check covered both paths.
    assert 0 < engine.stats.accepted_tokens < engine.stats.drafted_tokens


@pytest.mark.parametrize("drafter", ["same", "weak"])
def test_adaptive_k_keeps_output_and_follows_acceptance(target_hf, target, weak_draft, drafter):
    d = weak_draft if drafter == "weak" else "same"
    ps = prompts(3, seed=21)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    fixed = engine_with(target, d, k=4)
    run(fixed, ps, params)
    engine = engine_with(target, d, k=4, adaptive_k=True)
    # Pin the times (wall time is noisy in tests): a step of 1.0 plus 0.05 per scored token, a call of 0.1 plus
    # 0.3 per drafted position (here the "draft" costs as much as the target).
    policy = engine.scheduler.policy
    for batch in range(1, 5):
        for query in range(batch, 6 * batch + 1):
            policy.record_step(batch, query, 1.0 + 0.05 * query)
        for depth in range(1, 5):
            policy.record_propose(batch, depth, False, 0.1 + 0.3 * depth)
    policy.record_step = policy.record_propose = policy.record_rest = lambda *args: None
    outs = run(engine, ps, params)
    for i, p in enumerate(ps):
        assert outs[f"r{i}"] == hf_greedy(target_hf, p, 40, eos=False)
    drafted_share = engine.stats.drafted_tokens / fixed.stats.drafted_tokens
    if drafter == "same":
        assert drafted_share > 0.9  # everything is accepted: keep drafting the full k
    else:
        assert drafted_share < 0.35  # a draft the target rarely agrees with is mostly switched off


def test_a_new_request_starts_from_the_acceptance_earlier_requests_of_its_kind_achieved(target):
    engine = engine_with(target, "same", k=3, adaptive_k=True)
    policy = engine.scheduler.policy
    # The draft is the target itself: on a slow machine its measured cost rightly makes plain decoding the plan
    # after a step or two (CI tested 12 positions), and then the population learns nothing more. This test is
    # about the prior, not the costs: a step costs the same whatever it scores, and drafting costs nothing.
    policy.record_step = lambda batch, query_tokens, seconds: policy.scoring.add(batch, query_tokens, 0.01)
    policy.record_propose = lambda batch, depth, tree, seconds: None
    policy.record_rest = lambda batch, depth, seconds: None
    assert policy.population == {}
    run(engine, prompts(2, seed=5), SamplingParams(max_tokens=24, ignore_eos=True))  # the target as draft
    greedy = policy.population[True]
    assert greedy.tested >= 20 and greedy.alpha > 0.9 and False not in policy.population
    engine.add_request("next", prompts(1, seed=6)[0], SamplingParams(max_tokens=4))
    engine.add_request("sampled", prompts(1, seed=7)[0], SamplingParams(max_tokens=4, temperature=0.8))
    assert engine.seqs["next"].acceptance.alpha == greedy.alpha and engine.seqs["next"].acceptance.tested == 0
    assert engine.seqs["sampled"].acceptance.alpha == 0.5  # no sampled request was seen: the agnostic prior


class EarlyAskDrafter(NgramDrafter):
    """Takes early asks as the remote proposer does (send now, collect later); records every call as (sequence,
    tokens it carried, asked early)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, bool]] = []

    def propose(self, requests, early=False):
        self.calls.extend((r.seq_id, len(r.new_token_ids), early) for r in requests)
        return super().propose(requests)

    def send(self, requests):
        return self.propose(requests, early=True)

    def collect(self, drafts):
        return drafts


def test_a_call_that_carries_the_prompt_is_not_a_propose_cost(target):
    """The first request after the prefill carries the whole prompt and its features: a catch-up that costs what
    the prompt is long, never what a drafting round costs. Counted as one, it priced drafting at a
    batch size out of the plan for good (402 ms a call at batch 8 in the gateway benchmark)."""

    class EarlyFeatureDrafter(EarlyAskDrafter):
        """Wants the features, as an EAGLE head does."""

        needs_target_features = True
        rows: list[int] = []  # feature rows per request, asked early or not

        def propose(self, requests, early=False):
            self.rows.extend(0 if r.features is None else r.features.shape[0] for r in requests)
            return super().propose(requests, early)

    engine = engine_with(target, EarlyFeatureDrafter(), k=2)
    recorded: list[int] = []
    caught: list[int] = []  # a catch-up call's positions: its time per position is learned apart
    policy = engine.scheduler.policy
    policy.record_propose = lambda batch, depth, tree, seconds: recorded.append(depth)
    policy.record_catch_up = lambda batch, depth, tree, seconds, positions: caught.append(positions)
    prompt = prompts(1, seed=3)[0] * 3  # longer than a step commits
    engine.add_request("r", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    rows = EarlyFeatureDrafter.rows
    assert rows[0] == len(prompt) and max(rows[1:]) <= 3  # the first call after the prefill, with the prompt
    assert len(recorded) == len(rows) - 1  # every drafting round counted but that one
    assert caught == [len(prompt) + 1]  # the prompt and the token its prefill sampled


def test_a_prompt_that_arrives_after_a_step_does_not_wait_for_a_catch_up_asked_early(target):
    """A call that would carry a catch-up (here the prompt, prefilled alone) is not asked early: a prompt that
    arrives before the next step would wait for it, and once it was sent the scheduler no longer saw the lag that
    makes it decode plainly beside new prompts. Through the gateway at 8 clients a burst's first request was asked
    early with its prompt and drafted while the other seven prompts waited for their first tokens."""
    drafter = EarlyAskDrafter()
    engine = engine_with(target, drafter, k=2, adaptive_k=True)
    prompt = prompts(1, seed=3)[0] * 3  # longer than a step commits: its first call is a catch-up
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request("old", prompt, params)
    engine.seqs["old"].acceptance = AcceptanceEstimate(alpha=0.95, tested=1000)  # the policy wants it to draft
    engine.step()  # its prefill
    assert drafter.calls == []  # its catch-up was not asked early
    engine.add_request("new", prompts(1, seed=4)[0], params)
    outputs = {out.request_id: out for out in engine.step()}
    assert outputs["old"].draft_depth == 0 and "new" in outputs  # plain beside the prompt, and nobody waited
    assert drafter.calls == []
    while engine.has_unfinished():
        engine.step()
    old_calls = [(n, early) for seq, n, early in drafter.calls if seq == "old"]
    assert old_calls[0] == (len(prompt) + 2, False)  # caught up at the step's start, with both sampled tokens
    assert any(early for _, early in old_calls[1:])  # and asked early once it had caught up


def test_the_plan_is_told_what_each_sequence_s_call_would_catch_up(target):
    """Adaptive k: the policy gets, per sequence, the positions its proposer has not seen beyond what one step
    commits (a new request's whole prompt, nothing once it drafts every step), and the tokens it may still emit
    (what a catch-up is spread over)."""
    engine = engine_with(target, NgramDrafter(), k=2, adaptive_k=True)
    policy = engine.scheduler.policy
    plan, lags_seen, horizons_seen = policy.plan, [], []

    def recording(seqs, vary=False, lags=None, horizons=None):
        lags_seen.append(list(lags))
        horizons_seen.append(list(horizons))
        return plan(seqs, vary, lags, horizons)

    policy.plan = recording
    prompt = prompts(1, seed=3)[0] * 3
    engine.add_request("r", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    horizons_seen = [h for h, lags in zip(horizons_seen, lags_seen, strict=True) if lags]
    lags_seen = [lags for lags in lags_seen if lags]  # plans of the one sequence
    assert lags_seen[0][0] >= len(prompt), lags_seen
    assert horizons_seen[0][0] in (11, 12), horizons_seen  # its prompt's last chunk, or its first decode
    assert all(0 < h[0] <= 12 for h in horizons_seen) and horizons_seen == sorted(horizons_seen, reverse=True)
    assert [0] in lags_seen[1:], lags_seen  # once its tokens went with a draft request every step


def test_a_steps_rest_is_timed_start_to_start_and_never_across_an_idle_wait(target):
    """What the serving loop does between steps (here a 50 ms sleep) is part of a decode step's cost to the policy:
    recorded as its rest at the next step's start, at the step's batch size and depth. A step that leaves nothing
    running records none: the loop may then wait for requests, and a wait is no step's cost."""
    engine = engine_with(target, NgramDrafter(), k=2)
    recorded: list[tuple[int, int, float]] = []
    engine.scheduler.policy.record_rest = lambda batch, depth, seconds: recorded.append((batch, depth, seconds))
    engine.add_request("a", prompts(1, seed=4)[0], SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        time.sleep(0.05)
    assert len(recorded) >= 2
    assert all(batch == 1 and depth in (1, 2) and 0.05 <= seconds < 1.0 for batch, depth, seconds in recorded), recorded
    before = len(recorded)
    time.sleep(0.2)  # idle: nothing to run
    engine.add_request("b", prompts(1, seed=5)[0], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    assert len(recorded) == before


def test_each_decode_step_is_compared_whole_with_what_its_parts_said(target):
    """At the next step's start the policy gets the step's expectation (its parts' medians, this step's own among
    them) and what it took start to start, the serving loop's 30 ms between steps included (as its rest). Every
    decode step is counted once, by its kind; a step that drafted nothing is never a probe."""
    engine = engine_with(target, NgramDrafter(), k=2, adaptive_k=True)
    policy = engine.scheduler.policy
    seen = []
    record = policy.record_outcome
    policy.record_outcome = lambda *args: (seen.append(args), record(*args))
    engine.add_request("a", prompts(1, seed=6)[0] * 2, SamplingParams(max_tokens=12, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        time.sleep(0.03)
    assert len(seen) == steps - 2  # not the prefill, and the last step has no next start
    for batch, depth, predicted, realised, _, probe in seen:
        assert batch == 1 and realised.rest >= 0.03 and 1 <= realised.tokens <= depth + 1
        assert predicted is not None and predicted.scoring > 0 and predicted.tokens >= 1
        assert not (probe and depth == 0)
    for drafting in (True, False):  # a kind's first step knew no rest of its kind yet; the next ones did
        rests = [predicted.rest for _, depth, predicted, *_ in seen if (depth > 0) == drafting]
        assert all(rest >= 0.03 for rest in rests[1:]), rests
    assert sum(len(steps) for steps in policy.outcomes.steps.values()) == len(seen)


def test_sequences_at_k_0_are_followed_k_tokens_at_a_time(target_hf, target):
    """A drafter told without waiting (`notify`, the remote proposer) follows a sequence that does not draft in
    messages of k committed tokens, not one per step (a message costs the proposer CPU beside the verifier), and
    every committed token reaches the drafter, in order, once."""

    class Following(NgramDrafter):
        def __init__(self) -> None:
            super().__init__()
            self.told: list[list[int]] = []
            self.asked: list[list[int]] = []

        def notify(self, requests):
            self.told.extend(r.new_token_ids for r in requests)
            self.propose(requests)

        def propose(self, requests):
            self.asked.extend(r.new_token_ids for r in requests if r.k > 0)
            return super().propose(requests)

    k = 4
    drafter = Following()
    engine = engine_with(target, drafter, k=k)
    prompt = prompts(1, seed=6)[0]
    engine.add_request("plain", prompt, SamplingParams(max_tokens=23, ignore_eos=True), max_draft_tokens=0)
    outs = run(engine, [], SamplingParams())
    assert outs["plain"] == hf_greedy(target_hf, prompt, 23, eos=False)
    # the first message carries the prompt, the others k tokens each; in order, none twice, at most k - 1 left over
    assert all(len(told) == k for told in drafter.told[1:]) and len(drafter.told) >= 23 // k
    followed = [t for told in drafter.told for t in told]
    assert followed == (prompt + outs["plain"])[: len(followed)]
    assert len(followed) > len(prompt) + 23 - k and not drafter.asked


def test_max_draft_tokens_caps_one_requests_k(target_hf, target):
    engine = engine_with(target, "same", k=4)
    ps = prompts(2, seed=31)
    engine.add_request("capped", ps[0], SamplingParams(max_tokens=20, ignore_eos=True), max_draft_tokens=1)
    engine.add_request("off", ps[1], SamplingParams(max_tokens=20, ignore_eos=True), max_draft_tokens=0)
    outs, drafted = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            drafted[out.request_id] = max(drafted.get(out.request_id, 0), out.num_drafted)
            if out.finished:
                outs[out.request_id] = out.output_ids
    assert drafted == {"capped": 1, "off": 0}
    assert outs["capped"] == hf_greedy(target_hf, ps[0], 20, eos=False)
    assert outs["off"] == hf_greedy(target_hf, ps[1], 20, eos=False)


def test_each_request_reaches_the_drafter_with_its_tenant(target):
    class Recording(NgramDrafter):
        tenants: dict[str, set[str]] = {}

        def propose(self, requests):
            for r in requests:
                self.tenants.setdefault(r.seq_id, set()).add(r.tenant)
            return super().propose(requests)

    drafter = Recording()
    engine = engine_with(target, drafter, k=2)
    ps = prompts(2, seed=5)
    engine.add_request("a", ps[0], SamplingParams(max_tokens=6), tenant="alice")
    engine.add_request("b", ps[1], SamplingParams(max_tokens=6))
    while engine.has_unfinished():
        engine.step()
    assert drafter.tenants == {"a": {"alice"}, "b": {""}}


# ---- prefix caching -----------------------------------------------------------------------------


def assert_all_released(engine: Engine) -> None:
    """Every block is free or evictable (refcount 0) and the books agree, in the target and draft caches."""
    managers = [engine.blocks]
    if hasattr(engine.drafter, "blocks"):
        managers.append(engine.drafter.blocks)
    for bm in managers:
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks
        assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))


def run_one(engine: Engine, request_id: str, prompt: list[int], max_tokens: int, stop_token_ids=()):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=tuple(stop_token_ids))
    engine.add_request(request_id, prompt, params)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final = out
    assert final is not None
    assert_all_released(engine)
    return final


def conversation(target_hf, engine: Engine, turns: int = 3, seed: int = 0, max_tokens: int = 12) -> list[int]:
    """Multi-turn: each prompt is the previous prompt, its output and a new user turn. Returns cached counts."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1, EOS) for _ in range(23)]
    cached = []
    for turn in range(turns):
        out = run_one(engine, f"turn{turn}", prompt, max_tokens)
        assert out.output_ids == hf_greedy(target_hf, prompt, max_tokens, eos=False), f"turn {turn}"
        cached.append(out.num_cached_prompt)
        prompt = prompt + out.output_ids + [rng.randrange(1, EOS) for _ in range(rng.randrange(1, 9))]
    return cached


@pytest.mark.parametrize("drafter", [None, "weak", "ngram", "same"])
@pytest.mark.parametrize("k", [1, 4])
def test_prefix_cache_across_turns_keeps_greedy_output(target_hf, target, weak_draft, drafter, k):
    d = {"weak": weak_draft, "ngram": NgramDrafter()}.get(drafter, drafter)
    engine = engine_with(target, d, k=k)
    cached = conversation(target_hf, engine)
    assert cached[0] == 0
    # Turn 2's prompt starts with turn 1's prompt and output, whose full blocks (minus the last,
    # never computed token) are reused: 23 + 12 - 1 = 34 tokens -> 8 blocks of 4.
    assert cached[1] >= 32
    assert cached[2] > cached[1]
    assert engine.scheduler.prefix_cache.hit_tokens == sum(cached)
    assert engine.blocks.num_cached_blocks > 0


def test_prefix_cache_disabled_computes_everything(target_hf, target):
    config = EngineConfig(num_speculative_tokens=2, max_model_len=128, adaptive_k=False)
    engine = build_engine(target, NgramDrafter(), config, CacheConfig(block_size=4, enable_prefix_caching=False))
    assert conversation(target_hf, engine) == [0, 0, 0]
    assert engine.blocks.num_cached_blocks == 0


def test_shared_system_prompt_is_computed_once(target_hf, target, weak_draft):
    engine = engine_with(target, weak_draft, k=3, max_num_seqs=4)
    rng = random.Random(5)
    system = [rng.randrange(1, EOS) for _ in range(18)]  # 4 full blocks of 4 and 2 tokens
    ps = [system + [rng.randrange(1, EOS) for _ in range(rng.randrange(1, 6))] for _ in range(5)]
    assert run_one(engine, "first", ps[0], 8).num_cached_prompt == 0
    for i, p in enumerate(ps[1:]):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=8, ignore_eos=True))
    first_block = engine.blocks.match_prefix(system).blocks[0]
    outs, max_sharers = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        max_sharers = max(max_sharers, engine.blocks.ref_count(first_block))
    assert max_sharers == 4  # the four running requests read one copy of the system prompt
    for i, p in enumerate(ps[1:]):
        assert outs[f"r{i}"].output_ids == hf_greedy(target_hf, p, 8, eos=False)
        assert outs[f"r{i}"].num_cached_prompt == 16
    assert_all_released(engine)


def test_eviction_under_tiny_block_budget_keeps_output(target_hf, target, weak_draft):
    # 18 blocks of 4 hold one full-length sequence (64 + 3 + 1 tokens) and little else: conversations
    # interleaved with unrelated prompts must evict cached blocks, least recently used first.
    engine = engine_with(target, weak_draft, k=3, num_blocks=18, max_model_len=64, max_num_seqs=2)
    for seed in range(3):
        cached = conversation(target_hf, engine, turns=2, seed=seed, max_tokens=10)
        assert cached[1] > 0
        for i, p in enumerate(prompts(2, seed=seed + 10)):
            out = run_one(engine, f"other{seed}-{i}", p, 10)
            assert out.output_ids == hf_greedy(target_hf, p, 10, eos=False)
    assert engine.blocks.num_evictions > 0


def test_draft_cache_reuses_prefix_across_turns(target_hf, target):
    engine = engine_with(target, "same", k=3)
    drafter = engine.drafter
    fed: list[int] = []
    forward = drafter.runner.forward

    def counting_forward(items):
        fed.append(sum(len(it.token_ids) for it in items))
        return forward(items)

    drafter.runner.forward = counting_forward
    first = run_one(engine, "t0", prompts(1, seed=9)[0], 12)
    first_fed = sum(fed)
    fed.clear()
    prompt = prompts(1, seed=9)[0] + first.output_ids + [7]
    second = run_one(engine, "t1", prompt, 12)
    assert second.output_ids == hf_greedy(target_hf, prompt, 12, eos=False)
    # Without reuse the draft would prefill the whole longer prompt again; with it only the tail.
    assert drafter.blocks.num_cached_blocks > 0
    assert sum(fed) < first_fed


def test_cached_blocks_hold_exactly_their_tokens_kv(target, weak_draft):
    """After every turn, each cached block's K/V equals a fresh prefill of the tokens it claims to hold.

    A block registered with a rejected draft's K/V (or a never-computed last token) fails this at once,
    even where the output happens not to change. Stop tokens end steps early, at a recovered token
    whose slot still holds a rejected draft's K/V: the case that must never be cached."""
    engine = engine_with(target, weak_draft, k=4)
    stops = range(0, VOCAB, 5)
    reference = engine_with(target, None, k=0)
    rng = random.Random(2)
    prompt = [rng.randrange(1, EOS) for _ in range(21)]
    bs = engine.blocks.block_size
    for turn in range(10):
        out = run_one(engine, f"t{turn}", prompt, 13, stops)
        history = prompt + out.output_ids
        run_one(reference, f"ref{turn}", history, 1)  # prefills all of `history`, then caches its full blocks
        ours, theirs = engine.blocks.match_prefix(history).blocks, reference.blocks.match_prefix(history).blocks
        assert len(ours) >= (len(history) - 1) // bs and len(theirs) == len(history) // bs
        for a, b in zip(ours, theirs, strict=False):
            for (k_ours, v_ours), (k_ref, v_ref) in zip(
                engine.runner.cache.layers, reference.runner.cache.layers, strict=True
            ):
                torch.testing.assert_close(k_ours[a], k_ref[b], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(v_ours[a], v_ref[b], atol=1e-4, rtol=1e-4)
        prompt = history + [rng.randrange(1, EOS) for _ in range(rng.randrange(1, 6))]
    assert engine.stats.drafted_tokens > engine.stats.accepted_tokens  # drafts were rejected along the way


def test_a_prompt_prefilled_in_chunks_is_ingested_by_the_drafter_alongside(target_hf, target):
    """The drafter gets each prefill chunk's tokens with k = 0 as the target computes them, so its first draft
    round has only the last chunk to catch up on (a long prompt no longer lands on it all at once)."""
    engine = engine_with(target, "same", k=3, max_num_seqs=2, max_num_batched_tokens=8)
    drafter = engine.drafter
    seen, forwards = [], []
    propose, forward = drafter.propose, drafter.runner.forward

    def recording_propose(requests):
        seen.extend((r.k, r.committed_len, len(r.new_token_ids)) for r in requests)
        return propose(requests)

    def recording_forward(items):
        forwards.append(max(len(item.token_ids) for item in items))
        return forward(items)

    drafter.propose = recording_propose  # type: ignore[method-assign]
    drafter.runner.forward = recording_forward  # type: ignore[method-assign]
    prompt = prompts(1, seed=9)[0] + prompts(1, seed=10)[0]  # longer than several chunks of 8
    assert len(prompt) > 24
    outs = run(engine, [prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    assert outs["r0"] == hf_greedy(target_hf, prompt, 12, eos=False)
    ingests = [s for s in seen if s[0] == 0]
    first_draft = next(s for s in seen if s[0] > 0)
    assert len(ingests) >= 3 and all(n <= 8 for _, _, n in ingests)
    assert sum(n for _, _, n in ingests) + first_draft[2] == len(prompt)  # each token sent once
    assert first_draft[2] <= 8 and max(forwards) <= 8  # no forward over the whole prompt


def test_a_new_proposer_stream_gets_each_sequence_whole_and_uncharged(target_hf, target):
    """A remote proposer's new stream (its `connections` counter) holds nothing: each sequence's next request
    carries its whole history, so no step waits for the proposer to ask, and no resend is charged to it."""

    class Reconnecting(NgramDrafter):
        connections = 1
        asked: list[tuple[int, int, int]] = []  # (stream, committed, tokens sent)

        def propose(self, requests):
            self.asked += [(self.connections, r.committed_len, len(r.new_token_ids)) for r in requests]
            return super().propose(requests)

    drafter = Reconnecting()
    engine = engine_with(target, drafter, k=2)
    prompt = prompts(1, seed=9)[0]
    engine.add_request("a", prompt, SamplingParams(max_tokens=20))
    outputs, steps = [], 0
    while engine.has_unfinished():
        steps += 1
        if steps == 4:
            drafter.connections = 2  # the proposer restarted: a new stream
        outputs += [t for out in engine.step() for t in out.new_token_ids]
    assert outputs == hf_greedy(target_hf, prompt, 20)
    by_stream = {s: [(c, n) for t, c, n in drafter.asked if t == s] for s in (1, 2)}
    assert by_stream[1] and by_stream[2]
    assert by_stream[1][0][0] == by_stream[1][0][1]  # the first request is whole: the prompt
    assert by_stream[1][-1][1] < by_stream[1][-1][0]  # then deltas
    assert by_stream[2][0][0] == by_stream[2][0][1]  # whole again on the new stream
    assert all(n < c for c, n in by_stream[2][1:])  # and deltas after it


def _prefilled(scheduler: Scheduler, prompts: dict[str, list[int]]) -> None:
    """The sequences admitted and prefilled, one token sampled each (as the engine commits a step)."""
    for arrival, (seq_id, prompt) in enumerate(prompts.items()):
        seq = Sequence(seq_id, prompt, SamplingParams(max_tokens=20), arrival)
        seq.tokens = list(prompt)
        scheduler.add(seq)
    for item in scheduler.schedule():
        item.seq.num_computed += item.num_feed
        item.seq.tokens.append(9)


def test_a_step_that_prefills_a_prompt_drafts_for_no_sequence_whose_call_would_catch_up():
    """Adaptive k, a sequence the drafter serves well: it drafts, but not in a step that feeds a prompt while its
    propose call would carry a catch-up (its own prompt, never sent: a proposer on the verifier's cores is not
    told of prompts): that call would hold up the new prompt's first token, also where the step's plan was made
    before the prompt arrived. Caught up, it drafts beside a prompt."""
    config = EngineConfig(num_speculative_tokens=4, max_num_seqs=4, max_model_len=64)

    def arrive(scheduler: Scheduler, arrivals: dict[str, list[int]]) -> None:
        for arrival, (seq_id, prompt) in enumerate(arrivals.items(), start=1):
            seq = Sequence(seq_id, prompt, SamplingParams(max_tokens=20), arrival)
            seq.tokens = list(prompt)
            scheduler.add(seq)

    def scheduler_with(arrivals: dict[str, list[int]]) -> Scheduler:
        scheduler = Scheduler(config, BlockManager(32, 4))
        _prefilled(scheduler, {"old": [1] * 12})
        scheduler.running[0].acceptance = AcceptanceEstimate(alpha=0.95, tested=1000)
        arrive(scheduler, arrivals)
        return scheduler

    def ks(scheduler: Scheduler) -> dict[str, tuple[int, int]]:
        return {item.seq.seq_id: (item.num_feed, item.k) for item in scheduler.schedule()}

    assert ks(scheduler_with({}))["old"][1] > 0  # alone it drafts
    assert ks(scheduler_with({"new": [2] * 10})) == {"old": (1, 0), "new": (10, 0)}
    caught_up = scheduler_with({"new": [2] * 10})
    caught_up.running[0].num_sent_to_proposer = len(caught_up.running[0].tokens)
    step = ks(caught_up)
    assert step["old"][1] > 0 and step["new"] == (10, 0)
    full = scheduler_with({"new": [2] * 10})
    full.config = replace(config, max_num_seqs=1)  # no room to admit it: nobody's first token waits
    assert ks(full)["old"][1] > 0
    # The engine plans the next step as soon as a step ends (its early ask); a prompt that arrives meanwhile is
    # added between the steps, and the plan made before it is made again
    ahead = scheduler_with({})
    assert ahead.plan_ahead()["old"].k > 0
    arrive(ahead, {"new": [2] * 10})
    assert ks(ahead) == {"old": (1, 0), "new": (10, 0)}


def test_after_a_new_proposer_stream_a_sequences_history_is_not_asked_early(target):
    """A new proposer stream (a reconnect: the drafter's `connections` counter) holds nothing of a sequence, so its
    next call carries its whole history: a catch-up, not asked early, though no lag shows in what was sent."""
    drafter = EarlyAskDrafter()
    drafter.connections = 0
    engine = engine_with(target, drafter, k=2, adaptive_k=True)
    prompt = prompts(1, seed=3)[0]
    engine.add_request("r", prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    engine.seqs["r"].acceptance = AcceptanceEstimate(alpha=0.95, tested=1000)
    steps = 0
    while not any(early for _, _, early in drafter.calls):  # caught up, then asked early
        engine.step()
        steps += 1
        assert steps < 10
    drafter.connections = 1  # the proposer restarted
    before = len(drafter.calls)
    for _ in range(2):
        engine.step()
    after = drafter.calls[before:]
    history = len(engine.seqs["r"].tokens) if "r" in engine.seqs else None
    assert after and not any(early and n > 3 for _, n, early in after)  # no early call carried the history
    assert any(n > 3 and not early for _, n, early in after), (after, history)  # it went at a step's start


def test_kept_features_are_copies_in_a_slab_per_sequence():
    """A step's feature rows are copied into the sequence's slab (one allocation per FEATURE_SLAB_ROWS rows, not
    one per step: small long-lived tensors fragmented the heap under the sampler's large buffers): each copy holds
    the rows it was given, later rows never touch it, and a slab full, or rows of another width, start a new one."""
    from verifier_service import engine as engine_module

    seq = Sequence("s", [1, 2, 3], SamplingParams(max_tokens=200), 0)
    rows = engine_module.FEATURE_SLAB_ROWS
    first = torch.randn(3, 8)
    kept = engine_module._in_slab(seq, first)
    slab = seq.feature_slab
    assert torch.equal(kept, first) and kept.data_ptr() != first.data_ptr() and slab is not None
    steps = [torch.randn(1, 8) for _ in range(rows - 3)]
    copies = [engine_module._in_slab(seq, step) for step in steps]
    assert seq.feature_slab is slab  # the same slab until it is full
    assert torch.equal(kept, first) and all(torch.equal(c, s) for c, s in zip(copies, steps, strict=True))
    engine_module._in_slab(seq, torch.randn(1, 8))
    assert seq.feature_slab is not slab and seq.feature_slab_used == 1  # full: a new one
    wide = engine_module._in_slab(seq, torch.ones(2, 16))
    assert seq.feature_slab.shape == (rows, 16) and torch.equal(wide, torch.ones(2, 16))
    big = engine_module._in_slab(seq, torch.zeros(rows + 5, 16))  # a long prefill chunk: a slab its size
    assert big.shape == (rows + 5, 16) and seq.feature_slab.shape == (rows + 5, 16)


def test_under_memory_pressure_an_older_sequences_draft_goes_before_a_newer_sequence():
    """The scheduler's order (scheduler.py): draft slots are given back before any sequence is preempted. Two
    sequences, one free block: the older one's k = 4 draft would take it, and the newer one could not decode."""
    config = EngineConfig(num_speculative_tokens=4, max_num_seqs=4, max_model_len=64, adaptive_k=False)
    blocks = BlockManager(5, 4)
    scheduler = Scheduler(config, blocks)
    _prefilled(scheduler, {"older": [1] * 7, "newer": [2] * 8})
    step = {item.seq.seq_id: item.k for item in scheduler.schedule()}
    assert step == {"older": 0, "newer": 0} and scheduler.num_preemptions == 0
    blocks.check_invariants()
    roomy = Scheduler(config, BlockManager(16, 4))  # with room for it, the draft is kept
    _prefilled(roomy, {"older": [1] * 7, "newer": [2] * 8})
    assert {item.seq.seq_id: item.k for item in roomy.schedule()} == {"older": 4, "newer": 4}
