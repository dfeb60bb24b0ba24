"""The suffix drafter on hand-made token streams: its own text, earlier answers of the same tenant (and never of
another), confidence and match length, deltas and resyncs, and the global tree's token budget."""

from __future__ import annotations

import logging
import random

import pytest

from proposer_service.suffix import GLOBAL, LOCAL, SuffixDrafter
from proposer_service.suffix_tree import NODE_BYTES, TOKEN_BYTES
from shared.drafting import Draft, DraftRequest


class Session:
    """One request as the engine drives a drafter: the prompt, then each step's committed tokens."""

    def __init__(self, drafter: SuffixDrafter, seq_id: str, prompt: list[int], tenant: str = "") -> None:
        self.drafter, self.seq_id, self.tenant = drafter, seq_id, tenant
        self.tokens, self.sent, self.prompt_len = list(prompt), 0, len(prompt)

    def propose(self, k: int) -> list[int]:
        draft = self.draft(k)
        assert draft.parents is None
        return draft.token_ids

    def draft(self, k: int, max_tree_nodes: int = 0) -> Draft:
        req = DraftRequest(
            self.seq_id,
            len(self.tokens),
            self.tokens[self.sent :],
            k,
            draft_position=len(self.tokens) - self.prompt_len,
            tenant=self.tenant,
            max_tree_nodes=max_tree_nodes,
        )
        self.sent = len(self.tokens)
        (draft,) = self.drafter.propose([req])
        assert draft.committed_len == len(self.tokens) and not draft.needs_resync and draft.probs is None
        return draft

    def decode(self, output: list[int], k: int) -> tuple[int, int]:
        """Commit `output` as a verifier would with greedy drafts: each step accepts the draft's prefix that
        agrees with the output, plus one token. Returns (drafted, accepted)."""
        drafted = accepted = 0
        position = 0
        while position < len(output):
            draft = self.propose(k)
            n = 0
            while n < len(draft) and position + n < len(output) and draft[n] == output[position + n]:
                n += 1
            drafted, accepted = drafted + len(draft), accepted + n
            self.tokens += output[position : position + n + 1]
            position += n + 1
        return drafted, accepted

    def commit(self, output: list[int]) -> None:
        """All of `output` committed at once (a long step), then a draft asked."""
        self.tokens += output
        self.propose(4)

    def release(self) -> None:
        self.drafter.release([self.seq_id])


def distinct(*lengths: int, seed: int) -> list[list[int]]:
    tokens = random.Random(seed).sample(range(1000, 2000), sum(lengths))
    parts, start = [], 0
    for n in lengths:
        parts.append(tokens[start : start + n])
        start += n
    return parts


def test_drafts_what_followed_the_same_tokens_in_its_own_text():
    drafter = SuffixDrafter()
    prompt = [*range(1, 11), 50, 51, *range(1, 6)]  # ... then 1 2 3 4 5 again: 6 7 8 9 followed them before
    assert Session(drafter, "a", prompt).propose(k=4) == [6, 7, 8, 9]
    assert drafter.stats.drafts == {LOCAL: 1, GLOBAL: 0}


def test_a_short_match_earns_a_short_draft_and_an_unsure_one_none():
    drafter = SuffixDrafter(min_token_prob=0.4, max_spec_factor=1.0)
    # A match of m tokens drafts at most m * max_spec_factor (here 1) + max_spec_offset (-1) tokens: one token,
    # none; two tokens, one.
    assert Session(drafter, "a", [7, 8, 9, 10, 11, 12, 7]).propose(k=8) == []
    assert Session(drafter, "a2", [7, 8, 9, 10, 11, 12, 7, 8]).propose(k=8) == [9]
    # The defaults (2, -1): one token, one; two tokens, three.
    assert Session(SuffixDrafter(), "a3", [7, 8, 9, 10, 11, 12, 7]).propose(k=8) == [8]
    assert Session(SuffixDrafter(), "a4", [7, 8, 9, 10, 11, 12, 7, 8]).propose(k=8) == [9, 10, 11]
    # After "3 4", 5 and 6 followed once each: probability 1/3 each (this occurrence counts): under 0.4.
    assert Session(drafter, "b", [3, 4, 5, 20, 3, 4, 6, 21, 3, 4]).propose(k=8) == []
    # With a lower threshold the first of the equally frequent continuations is drafted.
    assert Session(
        SuffixDrafter(min_token_prob=0.3, max_spec_factor=1.0), "c", [3, 4, 5, 20, 3, 4, 6, 21, 3, 4]
    ).propose(k=8) == [5]
    assert Session(drafter, "d", [3, 4, 5]).propose(k=0) == []


def test_the_draft_grows_with_how_often_the_continuation_was_seen():
    drafter = SuffixDrafter(min_token_prob=0.5, max_spec_factor=1.0)
    once = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4]
    # One earlier occurrence: probability 1/2 (this occurrence counts), so the path may not fall further.
    assert Session(drafter, "a", once).propose(k=8) == [5, 6, 9]
    assert Session(drafter, "b", [11, 2, 3, 8, 12, 2, 3, 9, 13, 2, 3]).propose(k=8) == []  # 1/3 each


def answered(prompt: list[int], answer: list[int], tenant: str) -> SuffixDrafter:
    """A drafter that followed one finished request of `tenant`."""
    drafter = SuffixDrafter()
    first = Session(drafter, "first", prompt, tenant=tenant)
    first.decode(answer, k=8)
    first.release()
    return drafter


def test_the_same_question_from_another_session_is_drafted_from_the_earlier_answer():
    prompt, answer = distinct(40, 60, seed=0)  # no token twice: nothing to draft from its own text
    drafter = answered(prompt, answer, "acme")
    assert not drafter.requests and len(drafter.cache) == 1  # its own tree went, its answer stayed
    second = Session(drafter, "s1/1", prompt, tenant="acme")
    assert second.propose(k=8) == answer[:8]  # from the first token on
    drafted, accepted = second.decode(answer, k=8)
    assert accepted == drafted >= len(answer) - 8
    assert drafter.stats.drafts[GLOBAL] >= 6 and drafter.stats.draft_tokens[GLOBAL] >= 48


def test_a_request_evicted_while_it_runs_still_drafts_from_its_tenants_tree():
    prompt, answer = distinct(40, 60, seed=4)
    drafter = answered(prompt, answer, "acme")
    second = Session(drafter, "second", prompt, tenant="acme")
    assert second.propose(k=8) == answer[:8]
    drafter.cache.remove(drafter.requests["second"].key)  # evicted by others' writes
    drafted, accepted = second.decode(answer, k=8)  # its suffixes are found from the root instead
    assert accepted == drafted >= len(answer) - 8
    assert not drafter.cache.holds("acme", drafter.requests["second"].key)  # and it is not added back


def test_a_request_evicted_between_its_steps_is_not_added_back_as_a_fragment():
    """Evicted while it runs, a request's next step carries new tokens: they must not enter the global tree as a
    new entry without the request's start (it would push out whole answers)."""
    prompt, answer = distinct(40, 60, seed=4)
    drafter = answered(prompt, answer, "acme")
    second = Session(drafter, "second", prompt, tenant="acme")
    second.propose(k=8)
    key = drafter.requests["second"].key
    assert drafter.cache.holds("acme", key)  # held while it runs
    drafter.cache.remove(key)
    held_tokens = drafter.cache.num_tokens
    second.tokens += answer[:3]  # the step's committed tokens
    second.propose(k=8)
    assert not drafter.cache.holds("acme", key) and drafter.cache.num_tokens == held_tokens
    assert not drafter.requests["second"].cached


def test_another_tenant_never_gets_a_draft_from_that_answer():
    prompt, answer = distinct(40, 60, seed=1)  # no token twice: nothing to draft from its own text
    drafter = answered(prompt, answer, "acme")
    other = Session(drafter, "b", prompt, tenant="globex")
    drafted, accepted = other.decode(answer, k=8)
    assert drafted == accepted == 0
    assert drafter.stats.drafts[GLOBAL] == 0
    anonymous = Session(drafter, "c", prompt)  # '' is a tenant of its own too
    assert anonymous.decode(answer, k=8) == (0, 0)


def test_requests_running_side_by_side_draft_from_each_other():
    """Outputs enter the global tree as they are committed: the leader's tokens draft for the follower."""
    prompt, answer = distinct(40, 30, seed=2)  # no token twice: nothing to draft from its own text
    drafter = SuffixDrafter()
    leader, follower = Session(drafter, "a", prompt), Session(drafter, "b", prompt)
    leader.decode(answer, k=4)
    assert follower.propose(k=8) == answer[:8]


def test_a_verifier_that_takes_trees_gets_the_best_matchs_frequent_continuations():
    # "1 2 3" was followed by "4 5" twice (then "9", then "8") and by "6 7" once before.
    prompt = [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5, 8, 1, 2, 3, 6, 7, 8, 10, 1, 2, 3]
    drafter = SuffixDrafter(min_token_prob=0.1)
    assert Session(drafter, "chain", prompt).propose(k=8) == [4, 5, 9, 1, 2]  # 9 or 8 or "6 7": 1/4 each
    # Best first by path probability (this occurrence counts: 4 in all); ties in the order they were reached.
    tree = Session(drafter, "a", prompt).draft(k=8, max_tree_nodes=6)
    assert tree.token_ids == [4, 5, 6, 9, 8, 7] and tree.parents == [-1, 0, -1, 1, 1, 2] and tree.probs is None
    source, continuation = drafter.continuation("a", k=8, tree_nodes=6)
    assert source == LOCAL and continuation.probs == pytest.approx([2 / 4, 2 / 4] + [1 / 4] * 4)
    assert drafter.stats.tree_drafts == 1
    small = Session(drafter, "b", prompt).draft(k=8, max_tree_nodes=3)
    assert small.token_ids == [4, 5, 6] and small.parents == [-1, 0, -1]
    # No deeper than k, nor than the match earns (a match of m tokens: 2m - 1).
    shallow = Session(drafter, "c", prompt).draft(k=2, max_tree_nodes=6)
    assert shallow.token_ids == [4, 5, 6, 7] and shallow.parents == [-1, 0, -1, 2]
    one = Session(drafter, "d", [*prompt[:-2], 3]).draft(k=8, max_tree_nodes=6)  # "3": a match of one token
    assert one.token_ids == [4, 6] and one.parents == [-1, -1]
    assert drafter.continuation("unknown", k=2)[1].token_ids == []


def test_a_repeated_answer_goes_as_a_chain_even_when_trees_are_taken():
    prompt, answer = distinct(40, 60, seed=5)
    drafter = answered(prompt, answer, "acme")
    draft = Session(drafter, "second", prompt, tenant="acme").draft(k=8, max_tree_nodes=12)
    assert draft.token_ids == answer[:8] and draft.parents is None


def test_a_delta_that_does_not_fit_asks_for_a_resync_and_a_rewrite_starts_over():
    drafter = SuffixDrafter()
    (draft,) = drafter.propose([DraftRequest("a", 10, [1, 2, 3], 4)])  # 7 tokens we never saw
    assert draft.needs_resync
    session = Session(drafter, "b", [4, 5, 6, 7, 8, 4, 5, 6])
    assert session.propose(k=4) == [7, 8, 4, 5]
    # The verifier resends tokens we hold (a reconnect): nothing changes.
    (draft,) = drafter.propose([DraftRequest("b", 8, [7, 8, 4, 5, 6], 4, draft_position=0)])
    assert draft.token_ids == [7, 8, 4, 5]
    # Committed tokens rewritten: the sequence starts over from the resent text (7 8 is gone).
    (draft,) = drafter.propose([DraftRequest("b", 8, [9, 9, 4, 5, 6], 4, draft_position=0)])
    assert draft.token_ids == [9, 9, 4, 5] and list(drafter.requests["b"].tokens) == [4, 5, 6, 9, 9, 4, 5, 6]


def test_the_global_trees_keep_their_token_budget_over_10000_requests():
    budget = 20_000
    drafter = SuffixDrafter(cache_tokens=budget, max_depth=16)
    rng = random.Random(3)
    peak_nodes = 0
    for i in range(10_000):
        prompt = [rng.randrange(500) for _ in range(rng.randrange(5, 30))]
        output = [rng.randrange(500) for _ in range(rng.randrange(1, 25))]
        session = Session(drafter, f"r{i}", prompt, tenant=f"t{i % 37}")
        session.propose(4)
        session.commit(output)
        session.release()
        assert drafter.cache.num_tokens <= budget
        peak_nodes = max(peak_nodes, drafter.cache.num_nodes)
    cache = drafter.cache
    assert cache.num_tokens == sum(len(t.tokens(k)) for t in cache.trees.values() for k in t.sequences)
    assert cache.evicted_requests > 5_000 and not drafter.requests
    # Nodes are bounded by the tokens (a compressed tree holds fewer than two per token, plus a root per tenant).
    assert peak_nodes <= 2 * budget + 37
    assert cache.memory_bytes() <= (2 * budget + 37) * NODE_BYTES + budget * TOKEN_BYTES


def test_a_request_larger_than_the_budget_is_not_kept_and_budget_zero_keeps_none():
    drafter = SuffixDrafter(cache_tokens=50)
    session = Session(drafter, "a", list(range(40)))
    session.decode(list(range(100, 130)), k=4)  # 32 prompt-context tokens + 30 > 50
    assert len(drafter.cache) == 0 and drafter.cache.num_tokens == 0
    off = SuffixDrafter(cache_tokens=0)
    Session(off, "a", [1, 2, 3]).decode([4, 5, 6], k=2)
    assert off.cache.num_tokens == 0


@pytest.mark.parametrize("bad", [dict(max_spec_factor=0.0), dict(min_token_prob=1.5), dict(cache_tokens=-1)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        SuffixDrafter(**bad)


def test_the_proposer_metrics_of_the_suffix_kind_read_without_errors(caplog):
    """The suffix drafter has a cache of its own, not drafting ahead's: no drafting-ahead series, and no
    metric callback fails when the metrics are read."""
    from types import SimpleNamespace

    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from proposer_service.telemetry import ProposerTelemetry
    from shared.telemetry import setup_telemetry

    reader = InMemoryMetricReader()
    telemetry = setup_telemetry("specdec-proposer", metric_readers=[reader])
    servicer = SimpleNamespace(drafter=SuffixDrafter(), messages=0, open_streams=0)
    ProposerTelemetry(telemetry, servicer)
    with caplog.at_level(logging.WARNING):
        data = reader.get_metrics_data()
    names = {m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert "specdec_proposer_suffix_proposals" in names
    assert not {n for n in names if n.startswith("specdec_proposer_draft_ahead_")}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
