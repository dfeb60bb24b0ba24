"""Drafting ahead (proposer_service/draft_ahead.py): a cache hit returns exactly the draft on-demand drafting
returns for the same outcome (draft model and EAGLE head, greedy), a mismatched outcome is never served, and
the engine's output with drafting ahead on is the target's (greedy, a mixed batch, preemption, prefix cache),
its sampling law the target's (with a failing negative control) and its seeded text unchanged."""

from __future__ import annotations

import random

import pytest
import torch

from proposer_service.draft_ahead import Candidates, SpeculationCache
from proposer_service.eagle import make_eagle_drafter
from shared.drafting import Draft, DraftRequest
from shared.model.build import CacheConfig
from shared.sampling import SamplingParams
from specdec_local.builder import build_engine, make_draft_model_drafter
from tests.law import first_two_token_counts, law_pvalue, token_laws
from tests.tiny import hf_greedy, ours, tiny_hf_model, tiny_target, tiny_target_hf, tiny_weak_draft  # noqa: F401 (fixtures)
from tests.unit.test_eagle import embeddings, make_head_dir
from tests.unit.test_tree_engine import prompts, run
from verifier_service.engine import EngineConfig

VOCAB = 96


class Ahead:
    """A drafter as the proposer's servicer drives it with drafting ahead on: every answered round is followed
    by drafting the next one ahead (to completion: a test has no next message racing it)."""

    def __init__(self, inner, ahead: int = 4) -> None:
        self.inner = inner
        inner.cache.ahead = ahead

    def propose(self, requests):
        drafts = self.inner.propose(requests)
        self.inner.draft_ahead(requests, drafts, lambda: False)
        return drafts

    def release(self, seq_ids):
        self.inner.release(seq_ids)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def draft_model_drafter(model):
    config = EngineConfig(num_speculative_tokens=4, max_num_seqs=8, max_model_len=128)
    return make_draft_model_drafter(*model, config, CacheConfig(block_size=4))


def eagle_drafter(tmp_path, target):
    """A drafter on the head saved in tmp_path (made there on first use: every drafter of a test has one head)."""
    if not (tmp_path / "config.json").exists():
        make_head_dir(tmp_path, target[1], torch.arange(VOCAB))
    return make_eagle_drafter(str(tmp_path), *embeddings(target), num_blocks=512, block_size=4)


def features_for(target, tokens: list[int]) -> torch.Tensor:
    """The target's final hidden states of a sequence's positions (what the verifier sends an EAGLE proposer)."""
    from shared.kv.cache import KVCache
    from shared.model.runner import ForwardItem, ModelRunner

    model, arch = target
    runner = ModelRunner(model, KVCache(arch.num_layers, 64, 4, arch.num_kv_heads, arch.head_dim))
    _, hidden = runner.forward_with_hidden([ForwardItem(list(range(64)), 0, tokens, 1)])
    return hidden[0]


def test_acceptance_is_counted_from_the_committed_tokens():
    cache = SpeculationCache(ahead=3)
    cache.last_chains["s"] = [7, 8, 9]
    cache.observe(DraftRequest("s", 9, [7, 8, 5], 3))  # 2 accepted, the third rejected: 3 positions decided
    cache.last_chains["s"] = [1, 2]
    cache.observe(DraftRequest("s", 12, [1, 2, 4], 3))  # both accepted, then the target's own token
    cache.last_chains["s"] = [6]
    cache.observe(DraftRequest("s", 3, [6, 6, 6], 3))  # a full resend says nothing about the last chain
    assert (cache.verified, cache.accepted) == (1 + 3 + 2, 0.5 + 2 + 2)


def test_outcomes_are_ranked_by_their_probability():
    cache = SpeculationCache(ahead=4)
    cache.verified, cache.accepted = 10, 8  # acceptance 0.8
    draft = Draft("s", 5, [7, 8, 9])
    candidates = Candidates([[7, 1], [8, 2], [9, 3], [4, 5]], [[0.6, 0.3], [0.5, 0.4], [0.9, 0.05], [0.7, 0.2]])
    # all accepted, then 4: 0.8^3 * 0.7 = 0.358; 1 for 7: 0.2 / 0.4 * 0.3 = 0.15; 7, then 2 for 8: 0.8 * 0.2 / 0.5
    # * 0.4 = 0.128; all accepted, then 5: 0.8^3 * 0.2 = 0.102; (7, 8, then 3 for 9: 0.64 * 0.2 / 0.1 * 0.05 = 0.064)
    assert cache.outcomes(draft, candidates) == [[7, 8, 9, 4], [1], [7, 2], [7, 8, 9, 5]]
    cache.verified, cache.accepted = 10, 1  # a poor drafter: rejections first
    assert cache.outcomes(draft, candidates)[:2] == [[1], [7, 2]]


@pytest.mark.parametrize("kind", ["draft-model", "eagle"])
def test_a_hit_is_the_draft_on_demand_drafting_gives_and_a_miss_is_never_served(tmp_path, target, weak_draft, kind):
    rng = random.Random(3)
    tokens = [rng.randrange(1, VOCAB - 1) for _ in range(13)]

    def fresh():
        return draft_model_drafter(weak_draft) if kind == "draft-model" else eagle_drafter(tmp_path, target)

    def first_request() -> DraftRequest:
        features = features_for(target, tokens)[: len(tokens) - 1] if kind == "eagle" else None
        return DraftRequest("s", len(tokens), tokens, 4, features=features)

    ahead = fresh()
    ahead.cache.ahead = 16  # every outcome: 2 other guesses at each of the 4 draft positions, 3 after them
    first = first_request()
    (round_t,) = ahead.propose([first])
    ahead.draft_ahead([first], [round_t], lambda: False)
    entries = dict(ahead.cache.entries["s"])
    assert len(entries) == 2 * 4 + 3
    assert sum(len(outcome) == len(round_t.token_ids) + 1 for outcome in entries) == 3  # the chain accepted whole
    # every entry is the draft on-demand drafting gives once the verifier committed its outcome (a twin drafter,
    # sent no features of the outcome's positions, as the entry had none)
    for outcome, entry in entries.items():
        twin = fresh()
        twin.propose([first])
        (on_demand,) = twin.propose([DraftRequest("s", len(tokens) + len(outcome), list(outcome), 4)])
        assert entry.draft.token_ids == on_demand.token_ids, outcome
    outcome = list(next(iter(entries)))
    follow_up = DraftRequest("s", len(tokens) + len(outcome), outcome, 4)
    (hit,) = ahead.propose([follow_up])
    assert ahead.cache.stats.hits == 1
    assert hit.token_ids == entries[tuple(outcome)].draft.token_ids and hit.committed_len == follow_up.committed_len
    # an outcome that was not drafted ahead misses and is drafted on demand
    ahead.draft_ahead([follow_up], [hit], lambda: False)
    other = [t for t in range(1, VOCAB) if (t,) not in ahead.cache.entries["s"]][0]
    miss_request = DraftRequest("s", follow_up.committed_len + 1, [other], 4)
    (miss,) = ahead.propose([miss_request])
    twin = fresh()
    twin.propose([first])
    twin.propose([follow_up])
    (miss_twin,) = twin.propose([miss_request])
    assert ahead.cache.stats.misses == 1 and miss.token_ids == miss_twin.token_ids


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_hits_are_the_on_demand_drafts_while_the_head_trims_its_features(tmp_path, target, prefix_caching, monkeypatch):
    """The head keeps features only a window behind what its prefix cache was offered: an alias drafting ahead
    starts from the sequence's features and its cached head blocks, and must still compute what on-demand drafting
    computes (a trim behind the computed positions alone left an alias filling from guesses what the sequence's
    head had from real features: in the first round, and every round without the head's prefix cache)."""
    import proposer_service.eagle as eagle_module

    monkeypatch.setattr(eagle_module, "FEATURE_WINDOW", 4)  # 256 at a real model's scale
    rng = random.Random(5)
    tokens = [rng.randrange(1, VOCAB - 1) for _ in range(40)]
    make_head_dir(tmp_path, target[1], torch.arange(VOCAB), scale=3.0)

    def fresh():
        return make_eagle_drafter(
            str(tmp_path), *embeddings(target), num_blocks=512, block_size=4, enable_prefix_caching=prefix_caching
        )

    first = DraftRequest("s", len(tokens), tokens, 4, features=features_for(target, tokens)[: len(tokens) - 1])
    ahead = fresh()
    ahead.cache.ahead = 16
    (round_1,) = ahead.propose([first])
    step = [*round_1.token_ids[:1], 7]  # one draft accepted, then the target's own token
    full = tokens + step
    second = DraftRequest(
        "s", len(full), step, 4, features=features_for(target, full)[len(tokens) - 1 : len(full) - 1],
        feature_start=len(tokens) - 1,
    )  # fmt: skip
    for history, request, draft in [([], first, round_1), ([first], second, None)]:
        if draft is None:
            (draft,) = ahead.propose([request])
        ahead.draft_ahead([request], [draft], lambda: False)
        entries = dict(ahead.cache.entries["s"])
        assert entries
        for outcome, entry in entries.items():
            twin = fresh()
            for earlier in [*history, request]:
                twin.propose([earlier])
            committed = request.committed_len + len(outcome)
            (on_demand,) = twin.propose([DraftRequest("s", committed, list(outcome), 4)])
            assert entry.draft.token_ids == on_demand.token_ids, (request.committed_len, outcome)
        assert ahead.states["s"].features.end - ahead.states["s"].features.start < len(full) or not prefix_caching


def test_an_unfinished_round_is_not_served_and_stale_drafting_ahead_stops(target, weak_draft):
    ahead = draft_model_drafter(weak_draft)
    ahead.cache.ahead = 4
    tokens = [5, 6, 7, 8, 9]
    first = DraftRequest("s", 5, tokens, 3)
    (round_t,) = ahead.propose([first])
    ahead.draft_ahead([first], [round_t], lambda: True)  # the next message already arrived
    assert "s" not in ahead.cache.entries
    ahead.draft_ahead([first], [round_t], lambda: False)
    outcome = list(next(iter(ahead.cache.entries["s"])))
    # the same outcome asked with another k, or other sampling parameters: drafted on demand
    (draft_k2,) = ahead.propose([DraftRequest("s", 5 + len(outcome), outcome, 2)])
    assert ahead.cache.stats.hits == 0 and len(draft_k2.token_ids) == 2


def test_a_sequence_released_after_a_hit_leaves_nothing_behind(target, weak_draft):
    """A hit's tokens are applied at the drafter's next call; a sequence released before then (it finished) must
    not come back as an empty history by that late apply, nor leave an alias of drafting ahead."""
    ahead = draft_model_drafter(weak_draft)
    ahead.cache.ahead = 4
    tokens = [5, 6, 7, 8, 9, 10, 11]
    first = DraftRequest("s", len(tokens), tokens, 3)
    (round_t,) = ahead.propose([first])
    ahead.draft_ahead([first], [round_t], lambda: False)
    outcome = list(next(iter(ahead.cache.entries["s"])))
    ahead.propose([DraftRequest("s", len(tokens) + len(outcome), outcome, 3)])
    assert ahead.cache.stats.hits == 1
    ahead.release(["s"])
    ahead.propose([DraftRequest("t", 5, [1, 2, 3, 4, 5], 3)])  # the next message
    assert set(ahead.history.tokens) == set(ahead.states) == {"t"}
    assert ahead.blocks.has_seq("t") and not any(ahead.blocks.has_seq(s) for s in ("s", "s\x00ahead0", "s\x00peek"))


# ---- through the engine ---------------------------------------------------------------------------


def engine_with(target, drafter, k=3, max_num_seqs=4, num_blocks=None, adaptive=False, **kw):
    config = EngineConfig(
        num_speculative_tokens=k, max_num_seqs=max_num_seqs, max_model_len=128, adaptive_k=adaptive, **kw
    )
    return build_engine(target, drafter, config, CacheConfig(block_size=4, num_blocks=num_blocks))


@pytest.mark.parametrize("kind", ["draft-model", "eagle"])
def test_greedy_with_drafting_ahead_equals_transformers(tmp_path, target_hf, target, kind):
    if kind == "draft-model":  # the target as its own draft: chains accepted whole, the bonus token guessed
        inner, ahead = draft_model_drafter(target), 4
    else:  # a random head is rejected at its first token: guess it among many, so that some rounds hit
        inner, ahead = eagle_drafter(tmp_path, target), 8
        inner.ahead_width = VOCAB
    engine = engine_with(target, Ahead(inner, ahead), k=3, max_num_seqs=8)
    ps = prompts(8, seed=5)
    outs = run(engine, ps, SamplingParams(max_tokens=24, ignore_eos=True))
    for i, p in enumerate(ps):
        assert outs[f"r{i}"] == hf_greedy(target_hf, p, 24, eos=False), f"prompt {i}"
    assert inner.cache.stats.hits > 0  # some rounds really were answered from the cache


def test_preemption_and_the_prefix_cache_with_drafting_ahead_keep_greedy_output(target_hf, target, weak_draft):
    system = prompts(1, seed=40)[0]
    ps = [system + p for p in prompts(6, seed=41)]
    engine = engine_with(target, Ahead(draft_model_drafter(weak_draft)), k=4, max_num_seqs=6, num_blocks=48)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    first = run(engine, ps[:1], params)["r0"]
    outs = run(engine, ps[1:], params)
    assert first == hf_greedy(target_hf, ps[0], 32, eos=False)
    for i, p in enumerate(ps[1:]):
        assert outs[f"r{i}"] == hf_greedy(target_hf, p, 32, eos=False)
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.prefix_cache.hit_tokens > 0


def test_seeded_text_is_the_same_with_and_without_drafting_ahead(target, weak_draft):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=77, max_tokens=20, ignore_eos=True)
    ps = prompts(3, seed=50)
    without = run(engine_with(target, draft_model_drafter(weak_draft)), ps, params)
    with_ahead = run(engine_with(target, Ahead(draft_model_drafter(weak_draft))), ps, params)
    assert without == with_ahead


LAW_VOCAB = 24  # the law of output token 4 is summed over LAW_VOCAB^3 contexts
LAW_TOP_N = 12


@pytest.fixture(scope="module")
def law_target_hf():
    return tiny_hf_model(seed=4, vocab_size=LAW_VOCAB, logit_scale=6.0)


def law_run(law_target_hf, n: int, corrupt_hits: bool = False):
    """k = 1, the target drafting for itself from its 12 likeliest tokens: round 1 (drafted on demand) commits
    tokens 2 and 3 when accepted; round 2, drafting token 4, is then often a hit (token 3 guessed ahead)."""
    target = ours(law_target_hf)
    inner = draft_model_drafter(target)
    inner.top_n, inner.ahead_width = LAW_TOP_N, LAW_VOCAB
    if corrupt_hits:  # the negative control: a hit's tokens are its distributions' likeliest, not samples of them
        lookup = inner.cache.lookup

        def corrupted(req):
            entry = lookup(req)
            if entry is not None and entry.draft.probs is not None:
                support = entry.draft.probs
                likeliest = support.token_ids.gather(-1, support.probs.argmax(-1, keepdim=True))  # [k, 1]
                entry.draft.token_ids[:] = likeliest[:, 0].tolist()
            return entry

        inner.cache.lookup = corrupted
    engine = engine_with(target, Ahead(inner, 4), k=1, max_num_seqs=64, max_waiting=5000)
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    prompt = [5, 17, 3]
    counts = first_two_token_counts(engine, n, lambda i: params, LAW_VOCAB, num=4, prompt=prompt)
    laws = token_laws(law_target_hf, lambda logits: torch.softmax(logits, -1), LAW_VOCAB, 4, prompt)
    return [law_pvalue(counts[i], laws[i], n) for i in range(4)], inner.cache.stats


def test_the_sampling_law_holds_with_drafting_ahead(law_target_hf):
    n = 3000
    pvalues, stats = law_run(law_target_hf, n)
    assert min(pvalues) > 1e-4, pvalues
    assert stats.hits > n // 5, stats  # token 4 was often drafted ahead


def test_negative_control_cached_drafts_with_a_false_distribution_fail_the_law(law_target_hf):
    torch.manual_seed(0)
    pvalues, stats = law_run(law_target_hf, 2000, corrupt_hits=True)
    assert pvalues[3] < 1e-6, (pvalues, stats)
