"""The draft-model drafter: rollback to the committed prefix, batched drafting, exact reported probs."""

from __future__ import annotations

import random
import time

import pytest
import torch

from proposer_service.paged_drafter import PHASES
from shared.drafting import DraftRequest
from shared.model.build import CacheConfig
from shared.sampling import SamplingParams, logits_to_probs, params_to_tensors
from specdec_local.builder import make_draft_model_drafter
from tests.tiny import hf_greedy, ours, tiny_hf_model
from verifier_service.engine import EngineConfig


@pytest.fixture(scope="module")
def draft_hf():
    return tiny_hf_model(seed=4, logit_scale=8.0)


def new_drafter(draft_hf, max_num_seqs=4, block_size=4, num_seqs_budget=None):
    config = EngineConfig(num_speculative_tokens=5, max_num_seqs=num_seqs_budget or max_num_seqs, max_model_len=128)
    return make_draft_model_drafter(*ours(draft_hf), config, CacheConfig(block_size=block_size))


def test_greedy_drafts_follow_the_draft_model_across_rollbacks(draft_hf):
    rng = random.Random(0)
    drafter = new_drafter(draft_hf)
    tokens = [rng.randrange(1, 90) for _ in range(9)]
    sent = 0
    for _ in range(8):
        draft = drafter.propose([DraftRequest("s", len(tokens), tokens[sent:], 4)])[0]
        sent = len(tokens)
        assert draft.token_ids == hf_greedy(draft_hf, tokens, 4, eos=False)
        assert draft.probs is None
        # The verifier accepts a random prefix and adds one token of its own: a rollback next round.
        accepted = rng.randrange(0, 5)
        tokens += draft.token_ids[:accepted] + [rng.randrange(1, 90)]


def test_batched_drafting_equals_one_at_a_time(draft_hf):
    rng = random.Random(1)
    seqs = {f"s{i}": [rng.randrange(1, 90) for _ in range(rng.randrange(2, 20))] for i in range(4)}
    ks = {"s0": 1, "s1": 3, "s2": 5, "s3": 0}
    batched = new_drafter(draft_hf).propose([DraftRequest(s, len(t), t, ks[s]) for s, t in seqs.items()])
    for draft in batched:
        alone = new_drafter(draft_hf).propose(
            [DraftRequest(draft.seq_id, len(seqs[draft.seq_id]), seqs[draft.seq_id], ks[draft.seq_id])]
        )[0]
        assert draft.token_ids == alone.token_ids
        assert len(draft.token_ids) == ks[draft.seq_id]


def test_sampled_drafts_report_the_truncated_distribution_they_came_from(draft_hf):
    drafter = new_drafter(draft_hf)
    drafter.top_n = 5
    params = SamplingParams(temperature=0.7)  # unseeded: seeded drafts use the target's noise (test_seeded.py)
    tokens = [3, 14, 15, 2, 65]
    draft = drafter.propose([DraftRequest("s", len(tokens), tokens, 3, params)])[0]
    assert draft.probs is not None and draft.probs.token_ids.shape == (3, 5)
    with torch.no_grad():
        ctx = tokens
        for pos, token in enumerate(draft.token_ids):
            logits = draft_hf(torch.tensor([ctx])).logits[0, -1:].float()
            full = logits_to_probs(logits, **params_to_tensors([params]))[0]
            top_probs, top_ids = full.topk(5)
            assert draft.probs.token_ids[pos].tolist() == top_ids.tolist()
            assert torch.allclose(draft.probs.probs[pos], top_probs / top_probs.sum(), atol=1e-5)
            assert float(draft.probs.probs[pos].sum()) == pytest.approx(1.0, abs=1e-5)
            assert token in draft.probs.token_ids[pos].tolist()
            ctx = ctx + [token]


def test_eviction_under_a_small_cache_keeps_drafts_correct(draft_hf):
    rng = random.Random(2)
    drafter = new_drafter(draft_hf, num_seqs_budget=1)  # room for about one sequence
    seqs = {f"s{i}": [rng.randrange(1, 90) for _ in range(30)] for i in range(3)}
    for _ in range(2):
        for seq_id, tokens in seqs.items():  # each request evicts the idle others
            draft = drafter.propose([DraftRequest(seq_id, len(tokens), tokens, 3)])[0]
            assert draft.token_ids == hf_greedy(draft_hf, tokens, 3, eos=False)
            drafter.history.release(seq_id)  # resend in full next time
    drafter.release(list(seqs))
    assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks


def test_unknown_history_asks_for_resync(draft_hf):
    drafter = new_drafter(draft_hf)
    draft = drafter.propose([DraftRequest("s", 10, [1, 2], 3)])[0]
    assert draft.needs_resync and draft.token_ids == []


def test_a_long_catch_up_runs_in_chunks_and_drafts_the_same(draft_hf, monkeypatch):
    import proposer_service.draft_model as draft_model

    rng = random.Random(5)
    seqs = {"long": [rng.randrange(1, 90) for _ in range(45)], "short": [rng.randrange(1, 90) for _ in range(3)]}
    monkeypatch.setattr(draft_model, "CATCH_UP_CHUNK", 8)
    drafter = new_drafter(draft_hf)
    forwards: list[list[int]] = []
    forward = drafter.runner.forward

    def recording(items):
        forwards.append([len(item.token_ids) for item in items])
        return forward(items)

    drafter.runner.forward = recording  # type: ignore[method-assign]
    drafts = drafter.propose([DraftRequest(s, len(t), t, 3) for s, t in seqs.items()])
    assert max(n for sizes in forwards for n in sizes) <= 8  # no forward over the whole prompt
    assert len(forwards) > 3
    for draft in drafts:
        assert draft.token_ids == hf_greedy(draft_hf, seqs[draft.seq_id], 3, eos=False)


def test_a_catch_up_of_many_sequences_feeds_a_bounded_number_of_tokens_per_forward(draft_hf, monkeypatch):
    """Many sequences resent whole at once (a restarted verifier): no forward feeds more than CATCH_UP_TOKENS
    (plus one drafted token per sequence), and the drafts are the same."""
    import proposer_service.draft_model as draft_model

    rng = random.Random(6)
    seqs = {f"s{i}": [rng.randrange(1, 90) for _ in range(30)] for i in range(6)}
    monkeypatch.setattr(draft_model, "CATCH_UP_TOKENS", 40)
    drafter = new_drafter(draft_hf)
    forwards: list[int] = []
    forward = drafter.runner.forward

    def recording(items):
        forwards.append(sum(len(item.token_ids) for item in items))
        return forward(items)

    drafter.runner.forward = recording  # type: ignore[method-assign]
    drafts = drafter.propose([DraftRequest(s, len(t), t, 3) for s, t in seqs.items()])
    assert max(forwards) <= 40 + len(seqs)
    assert sum(forwards) >= 6 * 30
    for draft in drafts:
        assert draft.token_ids == hf_greedy(draft_hf, seqs[draft.seq_id], 3, eos=False)


@pytest.mark.parametrize("fail_at", [0, 1, 2])  # the catch-up's chunk, the root's row, the first expansion
def test_a_forward_that_raises_offers_nothing_unwritten_to_the_prefix_cache(draft_hf, monkeypatch, fail_at):
    """A forward that fails (a GPU out of memory) writes no K/V: on release, the drafter must not register the
    blocks of tokens it only meant to feed, or a later sequence with that prefix would draft from them."""
    drafter = new_drafter(draft_hf)
    runner, calls = drafter.runner, [0]
    forward = runner.forward

    def failing(items):
        calls[0] += 1
        if calls[0] > fail_at:
            raise RuntimeError("out of memory (simulated)")
        return forward(items)

    monkeypatch.setattr(runner, "forward", failing)
    monkeypatch.setattr("proposer_service.draft_model.CATCH_UP_CHUNK", 8)  # the catch-up in chunks of 8
    tokens = [random.Random(3).randrange(1, 90) for _ in range(21)]
    with pytest.raises(RuntimeError):
        drafter.propose([DraftRequest("s", len(tokens), tokens, 3)])
    written = 8 * min(fail_at, 2)  # tokens fed by the forwards that ran
    drafter.release(["s"])
    match = drafter.blocks.match_prefix(tokens[:-1])
    assert len(match.blocks) * drafter.blocks.block_size <= written


def test_a_round_s_time_is_told_by_phase(draft_hf, monkeypatch):
    """What the proposer's phase metric reads (`phase_seconds`): each phase slowed in turn by a sleep in the
    drafter's own method shows in that phase and in no other; a round that only follows tokens drafts nothing."""
    slow, tokens = 0.2, [3, 14, 15, 2, 65]
    for slowed, method in (("catch_up", "_catch_up"), ("draft", "_draft")):
        drafter = new_drafter(draft_hf)
        original = getattr(drafter, method)

        def slower(*args, original=original):
            time.sleep(slow)
            return original(*args)

        monkeypatch.setattr(drafter, method, slower)
        draft = drafter.propose([DraftRequest("s", len(tokens), tokens, 4)])[0]
        assert len(draft.token_ids) == 4
        phases = drafter.phase_seconds
        assert set(phases) == set(PHASES)
        assert phases[slowed] >= slow, phases
        assert all(seconds < slow for phase, seconds in phases.items() if phase != slowed), phases
    drafter.propose([DraftRequest("s", len(tokens) + 1, [7], 0)])
    assert drafter.phase_seconds["draft"] == 0.0
