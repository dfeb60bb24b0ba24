"""An EAGLE head follows a sequence that decodes plainly (issue 24, point 4: no probe carries a stale catch-up).

The verifier sends a k = 0 sequence's committed tokens and features k at a time, off its critical path. A head
that drafted for the sequence before computes those positions as they come, so the round that resumes drafting
computes one step's positions instead of all since the last draft; a prompt that never drafted stays deferred,
and a follower never evicts another sequence's cache.
"""

from __future__ import annotations

import pytest
import torch

from proposer_service.eagle import EagleDrafter, make_eagle_drafter
from shared.drafting import DraftRequest
from shared.sampling import SamplingParams
from tests.tiny import ours, tiny_hf_model
from tests.unit.test_eagle import VOCAB, embeddings, make_head_dir


@pytest.fixture(scope="module")
def target():
    return ours(tiny_hf_model(seed=1, logit_scale=8.0))


def drafter_for(tmp_path, target, num_blocks: int = 64) -> EagleDrafter:
    """A drafter with the head in `tmp_path` (made there first: the same folder gives the same head)."""
    if not (tmp_path / "config.json").exists():
        make_head_dir(tmp_path, target[1], torch.arange(VOCAB), scale=20.0)
    return make_eagle_drafter(str(tmp_path), *embeddings(target), num_blocks=num_blocks, block_size=4)


def rows_forwarded(drafter: EagleDrafter) -> list[int]:
    """Head positions each forward computes from now on."""
    counts: list[int] = []
    forward = drafter._forward

    def counted(rows):
        counts.append(sum(len(row[3]) for row in rows))
        return forward(rows)

    drafter._forward = counted  # type: ignore[method-assign]
    return counts


def conversation(hidden: int, length: int = 40, seed: int = 0) -> tuple[list[int], torch.Tensor]:
    """Tokens and the target's features of every position but the last (the last token is unread)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB - 1, (length,), generator=gen).tolist()
    return tokens, torch.randn(length - 1, hidden, generator=gen)


def message(seq_id: str, tokens, features, sent: int, upto: int, k: int) -> DraftRequest:
    """The request that brings the proposer from `sent` committed tokens to `upto`, with their new features."""
    start = max(0, sent - 1)
    return DraftRequest(seq_id, upto, tokens[sent:upto], k, SamplingParams(), features[start : upto - 1], start)


def drive(drafter: EagleDrafter, tokens, features, plain: range, k: int = 3) -> tuple[list[int], list[int]]:
    """Draft at 8 committed tokens, follow the plain stretch k tokens at a time, draft again. Returns the last
    draft and the head positions computed per message (catch-up and drafts)."""
    counts = rows_forwarded(drafter)
    per_message = []

    def send(req: DraftRequest) -> list[int]:
        before = len(counts)
        (draft,) = drafter.propose([req])
        per_message.append(sum(counts[before:]))
        return draft.token_ids

    assert send(message("a", tokens, features, 0, 8, k))
    sent = 8
    for upto in plain:
        assert send(message("a", tokens, features, sent, upto, 0)) == []
        sent = upto
    return send(message("a", tokens, features, sent, sent + 1, k)), per_message


def test_a_plain_stretch_is_followed_and_the_round_that_resumes_computes_one_step(tmp_path, target):
    hidden = target[1].hidden_size
    tokens, features = conversation(hidden)
    following = drafter_for(tmp_path, target)
    plain = range(11, 33, 3)  # 24 tokens decoded plainly, sent 3 at a time
    drafts, computed = drive(following, tokens, features, plain)
    # Each message computed its real features' positions; the resuming round one catch-up position (32: the
    # token the target read this step) and its two fed drafts.
    assert computed == [7 + 2, *[3] * len(plain), 1 + 2]
    state = following.states["a"]
    assert state.num_done == state.num_exact == 32  # every committed position but the unread last
    # Catching up on all of it in the resuming round (the deferred way) reaches the same head state and drafts.
    deferred = drafter_for(tmp_path, target)
    deferred._prepare_follow = lambda req, tokens: False  # type: ignore[method-assign]
    deferred_drafts, deferred_computed = drive(deferred, tokens, features, plain)
    assert deferred_computed == [7 + 2, *[0] * len(plain), 1 + 3 * len(plain) + 2]  # the stale catch-up
    assert deferred_drafts == drafts
    torch.testing.assert_close(state.last_hidden, deferred.states["a"].last_hidden, rtol=1e-5, atol=1e-5)


def test_a_prompt_that_never_drafted_is_not_computed_while_it_decodes_plainly(tmp_path, target):
    hidden = target[1].hidden_size
    tokens, features = conversation(hidden, seed=1)
    drafter = drafter_for(tmp_path, target)
    counts = rows_forwarded(drafter)
    drafter.propose([message("a", tokens, features, 0, 8, 0)])
    drafter.propose([message("a", tokens, features, 8, 12, 0)])
    assert counts == [] and not drafter.blocks.has_seq("a")
    (draft,) = drafter.propose([message("a", tokens, features, 12, 13, 3)])  # drafts at last: catches up on all
    assert counts == [12, 1, 1] and len(draft.token_ids) == 3


def test_a_follower_never_evicts_another_sequences_cache(tmp_path, target):
    hidden = target[1].hidden_size
    tokens_a, features_a = conversation(hidden, seed=2)
    tokens_b, features_b = conversation(hidden, seed=3)
    drafter = drafter_for(tmp_path, target, num_blocks=6)  # 24 head positions
    drafter.propose([message("a", tokens_a, features_a, 0, 8, 3)])  # a: 7 positions + 2 drafts: 3 blocks
    drafter.propose([message("b", tokens_b, features_b, 0, 8, 3)])  # b: the other 3
    before = drafter.blocks.block_table("b")
    drafter.propose([message("a", tokens_a, features_a, 8, 16, 0)])  # a would need 4 blocks: waits
    assert drafter.blocks.block_table("b") == before
    assert drafter.states["a"].num_done == 7  # not followed, and its drafts rolled back
    (draft,) = drafter.propose([message("b", tokens_b, features_b, 8, 9, 3)])
    assert len(draft.token_ids) == 3
