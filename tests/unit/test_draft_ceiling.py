"""The repeat workload's ceiling (specdec_bench/draft_ceiling.py): hand-made drafts and step times."""

from __future__ import annotations

import pytest

from proposer_service.suffix import SuffixDrafter
from shared.drafting import Draft
from specdec_bench.draft_ceiling import accepted_runs, interpolate, oracle


class FixedDrafter:
    """Drafts drafts[p] at output position p, and records what it was sent."""

    def __init__(self, drafts: list[list[int]]) -> None:
        self.drafts, self.requests, self.released = drafts, [], []

    def propose(self, requests):
        (req,) = requests
        self.requests.append(req)
        return [Draft(req.seq_id, req.committed_len, self.drafts[req.draft_position][: req.k])]

    def release(self, seq_ids):
        self.released += seq_ids


def test_accepted_runs_count_the_draft_prefix_the_output_continues_with():
    output = [5, 6, 7, 8]
    drafter = FixedDrafter([[5, 6, 9], [6, 7, 8, 1], [1], [8, 2]])
    assert accepted_runs(drafter, "s", [1, 2], output, k=2) == [2, 2, 0, 1]  # k=2 caps the second
    sent = [(r.committed_len, r.new_token_ids) for r in drafter.requests]
    assert sent == [(2, [1, 2]), (3, [5]), (4, [6]), (5, [7])] and drafter.released == ["s"]


def test_a_repeated_answer_is_drafted_whole_from_the_first_one():
    prompt, answer = [1, 2, 3], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    drafter = SuffixDrafter()
    first = accepted_runs(drafter, "a", prompt, answer, k=16, tenant="t")
    again = accepted_runs(drafter, "b", prompt, answer, k=16, tenant="t")
    assert first == [0] * len(answer)  # nothing seen yet: nothing to draft from
    # Every token drafted is the answer's; how many follows the drafter's trust in a match of m tokens
    # (2m - 1, suffix.py), m = the prompt and the output so far, up to the first answer's end less its last
    # token (no request drafts after it, so, as from a verifier, the drafter is never sent it).
    n = len(answer)
    assert again == [min(2 * (len(prompt) + p) - 1, n - 1 - p) for p in range(n)]
    other = accepted_runs(drafter, "c", prompt, answer, k=16, tenant="u")
    assert other == first  # another tenant's answers are not drafted from


def test_oracle_drafts_exactly_what_is_accepted():
    step = interpolate({1: 1.0, 3: 1.2})  # 0.1 s per scored token beyond the first
    result = oracle([2, 0, 0, 1, 0, 0], step)
    # p=0 drafts 2 (3 tokens scored) -> p=3 drafts 1 -> p=5 drafts 0 -> done: 3 steps for 6 tokens
    assert result.steps == 3 and result.tokens_per_step == 2.0
    assert result.speedup == pytest.approx(6.0 / (1.2 + 1.1 + 1.0))
    assert oracle([0, 0, 0], step).speedup == pytest.approx(1.0)


def test_interpolate_is_linear_between_points_and_beyond_the_last():
    at = interpolate({1: 1.0, 5: 1.4, 9: 2.2})
    assert [at(1), at(3), at(5), at(7), at(11)] == pytest.approx([1.0, 1.2, 1.4, 1.8, 2.6])
