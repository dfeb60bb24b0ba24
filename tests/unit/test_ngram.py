from __future__ import annotations

import random

from proposer_service.ngram import NgramDrafter
from shared.drafting import DraftRequest


def propose(drafter: NgramDrafter, seq_id: str, tokens: list[int], sent: int, k: int):
    return drafter.propose([DraftRequest(seq_id, len(tokens), tokens[sent:], k)])[0]


def naive_lookup(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # latest earlier occurrence first
            if tokens[end - n : end] == suffix:
                return tokens[end : end + k]
    return []


def test_continues_latest_earlier_match_of_longest_ngram():
    d = NgramDrafter(max_ngram=3)
    tokens = [7, 1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    draft = propose(d, "s", tokens, 0, k=3)
    assert draft.token_ids == [4, 5, 0]  # the latest "1 2 3" before the suffix is followed by 4 5 0
    assert draft.probs is None  # deterministic: one-hot
    assert draft.committed_len == len(tokens)


def test_no_match_gives_empty_draft_and_continuation_stops_at_end():
    d = NgramDrafter(max_ngram=2)
    assert propose(d, "a", [1, 2, 3, 4], 0, k=4).token_ids == []
    assert propose(d, "b", [5, 6, 5], 0, k=4).token_ids == [6, 5]  # cut at the end of the sequence


def test_incremental_index_equals_naive_scan():
    rng = random.Random(0)
    d = NgramDrafter(max_ngram=4, min_ngram=1)
    tokens: list[int] = [rng.randrange(6) for _ in range(5)]
    sent = 0
    for _ in range(200):
        draft = propose(d, "s", tokens, sent, k=3)
        sent = len(tokens)
        assert draft.token_ids == naive_lookup(tokens, 3, 4, 1)
        tokens.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))


def test_out_of_sync_delta_asks_for_resync_and_full_resend_recovers():
    d = NgramDrafter()
    tokens = [1, 2, 3, 1, 2]
    propose(d, "s", tokens, 0, k=2)
    gap = DraftRequest("s", len(tokens) + 3, [9], 2)  # starts past what the drafter holds
    assert d.propose([gap])[0].needs_resync
    rewritten = [4, 4, 4, 5, 4, 4]
    assert propose(d, "s", rewritten, 0, k=2).token_ids == [5, 4]  # latest earlier "4 4" ends at index 3


def test_release_forgets_the_sequence():
    d = NgramDrafter()
    propose(d, "s", [1, 2, 1], 0, k=1)
    d.release(["s"])
    assert "s" not in d.index and "s" not in d.history.tokens


def test_matches_of_several_lengths_become_the_branches_of_a_tree():
    from proposer_service.ngram import trie
    from shared.drafting import tree_depths

    drafter = NgramDrafter(max_ngram=3)
    # "7 8 9" was followed by 1 2; "8 9" later by 3 4; the suffix "7 8 9" matches at n = 3 and "8 9" at n = 2.
    tokens = [7, 8, 9, 1, 2, 5, 8, 9, 3, 4, 6, 7, 8, 9]
    (draft,) = drafter.propose([DraftRequest("s", len(tokens), tokens, 2, max_tree_nodes=6)])
    assert draft.parents is not None and max(tree_depths(draft.parents)) <= 2
    paths = {(draft.token_ids[i], draft.token_ids[c]) for c, i in enumerate(draft.parents) if i >= 0}
    assert paths == {(1, 2), (3, 4)}
    assert trie([[1, 2, 3], [1, 2, 4], [5]], 4) == ([1, 2, 3, 4], [-1, 0, 1, 1])  # shared prefix, budget
    # a chain where one continuation is all there is, or no tree was asked for
    (chain,) = NgramDrafter(max_ngram=3).propose([DraftRequest("s", len(tokens), tokens, 2)])
    assert chain.parents is None and chain.token_ids == [1, 2]
