"""A model drafter's guesses joined by the request's own text (proposer_service/suffix_branches.py): the join by hand,
the rules on hand-made drafts (room reserved in the tree's budget, the model's best-guess path kept, the price, which
chains are swapped and which are left), then through the engine on tiny random models: greedy output equal to
transformers' with the branches firing (EAGLE head and draft model, trees and chains, batch 1 and a mixed batch of
8), and the sampled output law at output positions 1 and 2 on a prompt whose text the branches continue, with the
failing negative control of the tree tests."""

from __future__ import annotations

import random
import time

import pytest
import torch

from proposer_service.paged_drafter import PHASES
from proposer_service.suffix_branches import CHAIN_SHARE, SuffixBranches, join
from shared.drafting import Draft, DraftRequest, SparseProbs, best_guess_path, tree_depths
from shared.sampling import SamplingParams
from tests.law import first_two_token_counts, law_pvalue, token_laws
from tests.tiny import hf_greedy, tiny_target, tiny_target_hf, tiny_weak_draft  # noqa: F401 (fixtures)
from tests.unit.test_tree_engine import TEMPERATURE, VOCAB, eagle_drafter, engine_with, run
from verifier_service import tree_verify

GREEDY = SamplingParams(max_tokens=32)
SAMPLED = SamplingParams(temperature=0.8, max_tokens=32)
LOOP = [7, 8, 9, 10]
LOOPED = LOOP * 3  # its own text continues it for sure: 7 8 9 10 followed every 7 8 9 10 so far


def test_join_shares_what_the_tree_has_and_appends_the_rest_after_it():
    tokens, parents = [5, 6, 7, 8], [-1, -1, 0, 0]  # 5 -> (7, 8), 6
    assert join(tokens, parents, [5, 8, 9]) == 1  # 5 and 8 are there; 9 goes under 8
    assert (tokens, parents) == ([5, 6, 7, 8, 9], [-1, -1, 0, 0, 3])
    assert join(tokens, parents, [4, 5]) == 2  # a new root child, and its own 5 (not the other 5's)
    assert (tokens, parents) == ([5, 6, 7, 8, 9, 4, 5], [-1, -1, 0, 0, 3, -1, 5])
    assert best_guess_path(parents) == [0, 2]  # first children first: the model's path


class Model:
    """A model drafter's stand-in: records what it was asked, answers what the test gave it."""

    def __init__(self, answer) -> None:
        self.answer, self.asked, self.sent = answer, [], []

    def __call__(self, requests: list[DraftRequest]) -> list[Draft]:
        self.asked.extend(requests)
        self.sent.extend(self.answer(r) for r in requests)
        return self.sent[-len(requests) :]


def request(params=GREEDY, k=4, nodes=8, tokens=LOOPED, **kw) -> DraftRequest:
    return DraftRequest("s", len(tokens), list(tokens), k, params, max_tree_nodes=nodes, **kw)


def model_tree(r: DraftRequest) -> Draft:
    """A full tree the model would send: a path 1-2-3-4, and siblings 5, 6 ... up to the budget it was given."""
    tokens, parents = [1, 2, 3, 4][: r.k], [-1, 0, 1, 2][: r.k]
    while len(tokens) < r.max_tree_nodes:
        tokens.append(len(tokens) + 1)
        parents.append(-1)
    return Draft(r.seq_id, r.committed_len, tokens, parents=parents)


def test_a_tree_keeps_room_for_the_text_its_budget_and_the_model_s_path():
    model = Model(model_tree)
    (draft,) = SuffixBranches().propose([request()], model)
    assert model.asked[0].max_tree_nodes == 4  # 8 nodes less the text's 4 (7 8 9 10)
    assert len(draft.token_ids) <= 8 and max(tree_depths(draft.parents)) <= 4
    path = [draft.token_ids[i] for i in best_guess_path(draft.parents)]
    assert path == [1, 2, 3, 4]  # the model's guesses stay the best-guess path
    assert draft.token_ids[4:] == [7, 8, 9, 10] and draft.parents[4:] == [-1, 4, 5, 6]  # a branch of its own


def test_the_text_is_cut_at_the_node_price_and_at_the_budget_a_whole_path_leaves():
    ambiguous = [1, 2, 1, 3, 1, 4, 1]  # after "1": 2, 3 or 4, a third each
    model = Model(model_tree)
    (draft,) = SuffixBranches().propose([request(tokens=ambiguous, min_node_prob=0.5)], model)
    assert model.asked[0].max_tree_nodes == 8 and draft == model_tree(model.asked[0])
    model = Model(model_tree)
    (draft,) = SuffixBranches().propose([request(nodes=6)], model)  # room for 2 of the text's 4 beside a path
    assert model.asked[0].max_tree_nodes == 4 and draft.token_ids[4:] == [7, 8]


def test_the_text_shares_the_nodes_the_model_s_tree_already_has():
    branches = SuffixBranches()
    (draft,) = branches.propose(
        [request()], Model(lambda r: Draft(r.seq_id, r.committed_len, [7, 8, 1], parents=[-1, 0, 1]))
    )
    assert draft.token_ids == [7, 8, 1, 9, 10] and draft.parents == [-1, 0, 1, 1, 3]  # 7 8 shared, 9 10 under them
    assert (branches.stats.trees, branches.stats.tree_tokens) == (1, 2)


def test_a_tree_request_answered_without_a_tree_is_left_as_the_model_sent_it():
    resync = Model(lambda r: Draft(r.seq_id, r.committed_len, [], needs_resync=True))
    (draft,) = SuffixBranches().propose([request()], resync)
    assert draft is resync.sent[0]
    with_probs = Model(sampled_chain)  # probabilities the ratio test reads: never joined by deterministic text
    (draft,) = SuffixBranches().propose([request()], with_probs)
    assert draft is with_probs.sent[0]
    no_room = Model(lambda r: Draft(r.seq_id, r.committed_len, []))  # the model had no cache room this round
    (draft,) = SuffixBranches().propose([request()], no_room)
    assert draft is no_room.sent[0]


def model_chain(r: DraftRequest) -> Draft:
    return Draft(r.seq_id, r.committed_len, [1, 2, 3, 4][: r.k])


def test_a_greedy_chain_is_swapped_only_where_the_text_is_sure():
    (draft,) = SuffixBranches().propose([request(nodes=0)], Model(model_chain))
    assert draft.token_ids == [7, 8, 9, 10] and draft.parents is None
    ambiguous = [1, 2, 1, 3, 1, 4, 1]  # a match of one token: one token drafted, a third or less expected
    branches = SuffixBranches()
    (draft,) = branches.propose([request(nodes=0, tokens=ambiguous)], Model(model_chain))
    _, text = branches.suffix.continuation("s", 4)
    assert 0 < text.score < CHAIN_SHARE * 4 and draft.token_ids == [1, 2, 3, 4]  # there was a text, unsure


def sampled_chain(r: DraftRequest) -> Draft:
    probs = SparseProbs(torch.tensor([[1, 2]] * r.k), torch.tensor([[0.5, 0.5]] * r.k))
    return Draft(r.seq_id, r.committed_len, [1, 2, 1, 2][: r.k], probs)


@pytest.mark.parametrize(
    ("req", "answer"),
    [
        (request(SAMPLED, nodes=0), sampled_chain),  # its distributions are what the verifier tests
        (request(SamplingParams(temperature=0.8, seed=3), nodes=0), model_chain),  # follows the target's noise
        (request(SamplingParams(temperature=0.8, seed=3)), model_chain),  # a seed drafts a chain, trees or not
        (request(k=0), lambda r: Draft(r.seq_id, r.committed_len, [])),
    ],
)
def test_drafts_the_text_may_not_join_are_left_as_the_model_sent_them(req, answer):
    model = Model(answer)
    (draft,) = SuffixBranches().propose([req], model)
    assert model.asked == [req] and draft is model.sent[0]


def test_the_text_s_time_is_its_own_phase(target, weak_draft, monkeypatch):
    """The proposer's phase metric (`phase_seconds`): the text's work, slowed by a sleep, shows as `text` and in
    no other phase; without the branches, `text` is 0."""
    slow = 0.2
    drafter = engine_with(target, weak_draft, k=4, nodes=8, max_num_seqs=1).drafter
    req = DraftRequest("s", len(LOOPED), LOOPED, 4, max_tree_nodes=8)
    drafter.propose([req])
    assert drafter.phase_seconds["text"] == 0.0
    drafter.branches = branches = SuffixBranches()
    original = branches._follow
    monkeypatch.setattr(branches, "_follow", lambda r: (time.sleep(slow), original(r))[1])
    drafter.propose([DraftRequest("s", len(LOOPED) + 1, [LOOPED[0]], 4, max_tree_nodes=8)])
    phases = drafter.phase_seconds
    assert set(phases) == set(PHASES)
    assert phases["text"] >= slow, phases
    assert all(seconds < slow for phase, seconds in phases.items() if phase != "text"), phases


def test_the_text_follows_every_request_and_forgets_released_sequences():
    branches = SuffixBranches()
    branches.propose([request(k=0, tokens=LOOP)], Model(lambda r: Draft(r.seq_id, r.committed_len, [])))
    more = DraftRequest("s", len(LOOPED), LOOPED[len(LOOP) :], 4, GREEDY, max_tree_nodes=8)
    (draft,) = branches.propose([more], Model(model_tree))
    assert draft.token_ids[4:] == [7, 8, 9, 10]  # it held the first request's tokens
    branches.release(["s"])
    model = Model(model_tree)
    (draft,) = branches.propose([more], model)  # a delta after a release fits nothing held: no text
    assert model.asked[0].max_tree_nodes == 8 and draft == model_tree(model.asked[0])


# ---- through the engine ---------------------------------------------------------------------------


def looping_prompts(n: int, seed: int) -> list[list[int]]:
    """Random prompts, each with a stretch of its own text repeated: text the branches continue."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        stretch = [rng.randrange(1, VOCAB - 1) for _ in range(rng.randrange(3, 7))]
        head = [rng.randrange(1, VOCAB - 1) for _ in range(rng.randrange(0, 8))]
        out.append(head + stretch * rng.randrange(2, 4))
    return out


@pytest.mark.parametrize("drafter", ["eagle", "weak"])
@pytest.mark.parametrize(("k", "nodes", "max_num_seqs"), [(3, 8, 1), (4, 10, 8), (4, 0, 8)])
def test_greedy_with_the_text_beside_the_model_equals_transformers(
    tmp_path, target_hf, target, weak_draft, drafter, k, nodes, max_num_seqs
):
    model = eagle_drafter(tmp_path, target) if drafter == "eagle" else weak_draft
    engine = engine_with(target, model, k=k, nodes=nodes, max_num_seqs=max_num_seqs)
    engine.drafter.branches = SuffixBranches()
    ps = looping_prompts(8 if max_num_seqs > 1 else 3, seed=k + nodes)
    outs = run(engine, ps, SamplingParams(max_tokens=24, ignore_eos=True))
    for i, p in enumerate(ps):
        assert outs[f"r{i}"] == hf_greedy(target_hf, p, 24, eos=False), f"prompt {i}"
    stats = engine.drafter.branches.stats
    assert (stats.tree_tokens if nodes else stats.chains) > 0  # the text did join the drafts
    assert engine.stats.accepted_tokens > 0


# Every token once, in a random order: whatever the first output token is, the prompt says what followed it, and
# that token joins the first tree step's tree
LAW_TEXT = random.Random(7).sample(range(VOCAB), VOCAB)
# After this prompt the control's p-values at 3000 samples were 5e-4 to 1e-3 in one seed of two; at 6000, 9e-15 and
# 3e-8 alone (seeds 0 and 1) but 6e-6 in a whole-suite run (other float orders); at 12000, 1e-13 to 1e-29 (seeds 0-3)
LAW_SAMPLES = 12000


def law_pvalues_with_text(target_hf, target, n: int = LAW_SAMPLES) -> tuple[list[float], SuffixBranches]:
    """The target drafts for itself (its top guesses cover most of the mass, so the text's branch is often a
    rejected sibling, and the residual after it is sampled); output tokens 1 and 2 (0-based) against their law."""
    laws = token_laws(target_hf, lambda logits: torch.softmax(logits / TEMPERATURE, -1), VOCAB, 3, LAW_TEXT)
    engine = engine_with(target, target, k=2, nodes=6, max_num_seqs=64, max_waiting=n)
    engine.drafter.branches = branches = SuffixBranches()
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=4, ignore_eos=True)
    counts = first_two_token_counts(engine, n, lambda _: params, VOCAB, num=3, prompt=LAW_TEXT)
    return [law_pvalue(counts[1], laws[1], n), law_pvalue(counts[2], laws[2], n)], branches


def test_sampled_output_law_with_the_text_s_branches(target_hf, target):
    pvalues, branches = law_pvalues_with_text(target_hf, target)
    assert min(pvalues) > 1e-4, pvalues
    assert branches.stats.tree_tokens > LAW_SAMPLES // 2  # the text joined most of the first steps' trees


def test_negative_control_the_text_s_branches_without_the_residual_update_fail(monkeypatch, target_hf, target):
    from tests.unit.test_tree_verify import _sample_without_residual

    monkeypatch.setattr(tree_verify, "_sample", _sample_without_residual)
    torch.manual_seed(0)
    pvalues, _ = law_pvalues_with_text(target_hf, target)
    assert min(pvalues) < 1e-6, pvalues


def test_drafting_ahead_guesses_from_the_chain_sent_and_greedy_output_stays_exact(target_hf, target, weak_draft):
    from tests.unit.test_draft_ahead import Ahead, draft_model_drafter

    drafter = draft_model_drafter(weak_draft)
    drafter.cache.ahead = 2
    drafter.branches = SuffixBranches()
    req = request(nodes=0)
    (draft,) = drafter.propose([req])
    assert draft.token_ids == [7, 8, 9, 10]  # the weak model's chain, swapped for the text's
    assert drafter.cache.last_chains["s"] == draft.token_ids and "s" not in drafter.candidates
    drafter.draft_ahead([req], [draft], lambda: False)  # nothing to guess from: the model's guesses were dropped
    drafter.release(["s"])

    model = Ahead(draft_model_drafter(weak_draft))
    model.inner.branches = SuffixBranches()
    engine = engine_with(target, model, k=4, nodes=0, max_num_seqs=8)
    ps = looping_prompts(8, seed=11)
    outs = run(engine, ps, SamplingParams(max_tokens=24, ignore_eos=True))
    for i, p in enumerate(ps):
        assert outs[f"r{i}"] == hf_greedy(target_hf, p, 24, eos=False), f"prompt {i}"
    assert model.inner.branches.stats.chains > 0 and model.inner.cache.stats.hits > 0
