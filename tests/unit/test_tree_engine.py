"""Token trees through the engine on tiny random models: greedy output equals transformers' with trees from the
draft model, the EAGLE head and a hostile random-tree drafter (batch 1 and a mixed batch, preemption, prefix
cache); the sampled output law at output positions 1 and 2 (0-based: the first tree step's root and the node
below it) with a failing negative control; seeded output identical with chains, trees and no drafter; output
formats valid and equal to target-only greedy; logprobs equal to plain decoding's."""

from __future__ import annotations

import random

import pytest
import torch

from proposer_service.eagle import make_eagle_drafter
from shared.drafting import Draft, DraftRequest
from shared.model.build import CacheConfig
from shared.sampling import SamplingParams
from specdec_local.builder import build_engine, make_draft_model_drafter
from tests.law import LAW_PROMPT, law_pvalue
from tests.tiny import hf_greedy, tiny_target, tiny_target_hf, tiny_weak_draft  # noqa: F401 (fixtures)
from tests.unit.test_eagle import FUSED, embeddings, make_head_dir
from verifier_service import tree_verify
from verifier_service.engine import EngineConfig

VOCAB = 96


def engine_with(target, drafter, k=3, nodes=8, max_num_seqs=4, num_blocks=None, **kw):
    config = EngineConfig(
        num_speculative_tokens=k,
        max_num_seqs=max_num_seqs,
        max_model_len=128,
        adaptive_k=False,
        max_tree_nodes=nodes,
        **kw,
    )
    if isinstance(drafter, tuple):  # a draft model
        drafter = make_draft_model_drafter(*drafter, config, CacheConfig(block_size=4))
    return build_engine(target, drafter, config, CacheConfig(block_size=4, num_blocks=num_blocks))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB - 1) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def run(engine, ps, params) -> dict[str, list[int]]:
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, params)
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o.output_ids for o in engine.step() if o.finished})
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return outs


class RandomTrees:
    """A hostile drafter: a random tree per sequence and step (random shape, random tokens, now and then the
    target's own next token so that some paths are accepted)."""

    def __init__(self, target_hf, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.history: dict[str, list[int]] = {}
        self.target_hf = target_hf

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = []
        for r in requests:
            tokens = self.history.setdefault(r.seq_id, [])
            del tokens[r.committed_len - len(r.new_token_ids) :]
            tokens.extend(r.new_token_ids)
            n = min(r.max_tree_nodes, self.rng.randrange(1, 9)) if r.max_tree_nodes and r.k else 0
            parents = [self.rng.randrange(-1, i) for i in range(n)]
            depth: list[int] = []
            for p in parents:
                depth.append(1 if p < 0 else depth[p] + 1)
            keep = [i for i in range(n) if depth[i] <= r.k]
            remap = {old: new for new, old in enumerate(keep)}
            parents = [remap[parents[i]] if parents[i] >= 0 else -1 for i in keep]
            guess = hf_greedy(self.target_hf, tokens, 1, eos=False)[0]
            node_tokens = [guess if self.rng.random() < 0.5 else self.rng.randrange(VOCAB) for _ in keep]
            drafts.append(Draft(r.seq_id, r.committed_len, node_tokens, parents=parents if keep else None))
        return drafts

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self.history.pop(seq_id, None)


def eagle_drafter(tmp_path, target, layers=(-1,)):
    folder = str(make_head_dir(tmp_path, target[1], torch.arange(VOCAB), layers=layers))
    return make_eagle_drafter(folder, *embeddings(target), num_blocks=512, block_size=4)


@pytest.mark.parametrize("drafter", ["weak", "same", "eagle", "eagle3", "random"])
@pytest.mark.parametrize(("k", "nodes", "max_num_seqs"), [(3, 8, 1), (4, 10, 8)])
def test_greedy_with_trees_equals_transformers(
    tmp_path, target_hf, target, weak_draft, drafter, k, nodes, max_num_seqs
):
    d = {
        "weak": lambda: weak_draft,
        "same": lambda: target,
        "eagle": lambda: eagle_drafter(tmp_path, target),
        "eagle3": lambda: eagle_drafter(tmp_path, target, FUSED),
        "random": lambda: RandomTrees(target_hf),
    }[drafter]()
    engine = engine_with(target, d, k=k, nodes=nodes, max_num_seqs=max_num_seqs)
    ps = prompts(8 if max_num_seqs > 1 else 3, seed=k)
    outs = run(engine, ps, SamplingParams(max_tokens=24, ignore_eos=True))
    for i, p in enumerate(ps):
        assert outs[f"r{i}"] == hf_greedy(target_hf, p, 24, eos=False), f"prompt {i}"
    assert engine.stats.drafted_tokens > 0 and engine.stats.accepted_tokens > 0


@pytest.mark.parametrize("drafter", ["weak", "random"])
def test_trees_under_preemption_and_the_prefix_cache_keep_greedy_output(target_hf, target, weak_draft, drafter):
    d = weak_draft if drafter == "weak" else RandomTrees(target_hf, seed=3)
    system = prompts(1, seed=40)[0]
    ps = [system + p for p in prompts(6, seed=41)]
    engine = engine_with(target, d, k=4, nodes=10, max_num_seqs=6, num_blocks=48)  # tight: preemptions happen
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    first = run(engine, ps[:1], params)["r0"]  # leaves the system prompt's blocks in the prefix cache
    outs = run(engine, ps[1:], params)
    assert first == hf_greedy(target_hf, ps[0], 32, eos=False)
    for i, p in enumerate(ps[1:]):
        assert outs[f"r{i}"] == hf_greedy(target_hf, p, 32, eos=False), f"prompt {i + 1}"
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.prefix_cache.hit_tokens > 0


def test_trees_are_really_trees(target, weak_draft):
    engine = engine_with(target, weak_draft, k=3, nodes=8, max_num_seqs=1)
    shapes = []
    draft = engine.drafter
    propose = draft.propose

    def spy(requests):
        drafts = propose(requests)
        shapes.extend(d.parents for d in drafts if d.token_ids)
        return drafts

    draft.propose = spy
    run(engine, prompts(1, seed=9), SamplingParams(max_tokens=12, ignore_eos=True))
    assert shapes and all(p is not None and p.count(-1) >= 2 for p in shapes)  # branches under the root
    assert max(len(p) for p in shapes) == 8  # as big as the engine allowed (the last steps allow less)


class SecondGuessRight:
    """A tree of two guesses under the root: a wrong best guess first, the target's next token second."""

    def __init__(self, target_hf) -> None:
        self.history = RandomTrees(target_hf)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = []
        for r, d in zip(requests, self.history.propose(requests), strict=True):
            guess = hf_greedy(self.history.target_hf, self.history.history[r.seq_id], 1, eos=False)[0]
            tokens = [(guess + 1) % VOCAB, guess]
            drafts.append(Draft(d.seq_id, d.committed_len, tokens, parents=[-1, -1]))
        return drafts

    def release(self, seq_ids: list[str]) -> None:
        self.history.release(seq_ids)


def test_a_tree_s_verdict_teaches_the_policy_its_best_guesses_and_what_the_tree_added(target_hf, target):
    engine = engine_with(target, SecondGuessRight(target_hf), k=3, nodes=8, max_num_seqs=2)
    ps = prompts(2, seed=5)
    outs = run(engine, ps, SamplingParams(max_tokens=12, ignore_eos=True))
    for i, p in enumerate(ps):
        assert outs[f"r{i}"] == hf_greedy(target_hf, p, 12, eos=False)
    misses = engine.scheduler.policy.tree_misses[True]
    assert misses.trees == engine.stats.draft_rounds > 0
    # Every best guess rejected at once; every tree accepted its second guess, then met its end 1 of 3 deep
    assert misses.best_rejected == pytest.approx(misses.best_tested)
    assert misses.tree_tested == pytest.approx(2 * misses.tree_rejected)
    # From the prior's 0.8 toward the 0.5 these trees show: after a dozen trees the prior still counts (its 16
    # positions decay with the trees' evidence, acceptance.TREE_PRIOR_POSITIONS)
    assert misses.share < 0.7
    assert engine.scheduler.policy.population[True].alpha < 0.1  # the chains' estimate: best guesses fail


# ---- the sampled law ----------------------------------------------------------------------------

TEMPERATURE = 1.5


def three_token_law(target_hf) -> tuple[torch.Tensor, torch.Tensor]:
    """The laws of output tokens 1 and 2 (0-based) after LAW_PROMPT at TEMPERATURE: exact, from all contexts."""
    with torch.no_grad():
        first = torch.softmax(target_hf(torch.tensor([LAW_PROMPT])).logits[0, -1] / TEMPERATURE, -1)
        ctx = torch.tensor([LAW_PROMPT + [a] for a in range(VOCAB)])
        second_given = torch.softmax(target_hf(ctx).logits[:, -1] / TEMPERATURE, -1)  # [a, b]
        law1 = first @ second_given
        pairs = torch.tensor([LAW_PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
        third_given = torch.cat(
            [torch.softmax(target_hf(chunk).logits[:, -1] / TEMPERATURE, -1) for chunk in pairs.split(2048)]
        ).view(VOCAB, VOCAB, VOCAB)
        joint = first.view(-1, 1) * second_given  # [a, b]
        law2 = torch.einsum("ab,abc->c", joint, third_given)
    return law1, law2


def token_counts(engine, n: int) -> torch.Tensor:
    """[2, vocab] counts of output tokens 1 and 2 (0-based) over n requests on LAW_PROMPT."""
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=4, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"s{i}", LAW_PROMPT, params)
    counts = torch.zeros(2, VOCAB)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                counts[0, out.output_ids[1]] += 1
                counts[1, out.output_ids[2]] += 1
    return counts


def law_pvalues(target_hf, target, n: int = 3000) -> tuple[list[float], object]:
    law1, law2 = three_token_law(target_hf)
    engine = engine_with(target, target, k=2, nodes=6, max_num_seqs=64, max_waiting=5000)
    counts = token_counts(engine, n)
    return [law_pvalue(counts[0], law1, n), law_pvalue(counts[1], law2, n)], engine


def test_sampled_output_law_with_trees(target_hf, target):
    """The target drafts for itself: its top guesses cover most of the mass, so output token 2 often comes from an
    accepted node's row, and sometimes from a residual after rejected siblings."""
    pvalues, engine = law_pvalues(target_hf, target)
    assert min(pvalues) > 1e-4, pvalues
    assert 0 < engine.stats.accepted_tokens < engine.stats.drafted_tokens


def test_negative_control_trees_without_the_residual_update_fail(monkeypatch, target_hf, target):
    from tests.unit.test_tree_verify import _sample_without_residual

    monkeypatch.setattr(tree_verify, "_sample", _sample_without_residual)
    torch.manual_seed(0)
    # As many samples as the law test: at 1500 the control's p-value fell between 1e-5 and 1e-8 by seed (CI's
    # 2-core float order drew 3e-6); at 3000 seeds 0-3 gave 1e-12 to 1e-28, far from the bar.
    pvalues, _ = law_pvalues(target_hf, target, n=3000)
    assert min(pvalues) < 1e-6, pvalues


# ---- seeds, formats, logprobs ---------------------------------------------------------------------


def test_seeded_output_is_the_same_with_chains_trees_and_no_drafter(target_hf, target, weak_draft):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    ps = prompts(3, seed=50)
    plain = run(build_engine(target, None, EngineConfig(max_model_len=128), CacheConfig(block_size=4)), ps, params)
    chains = run(engine_with(target, weak_draft, k=3, nodes=0), ps, params)
    trees = run(engine_with(target, RandomTrees(target_hf, seed=5), k=3, nodes=8), ps, params)
    assert plain == chains == trees


def test_sampled_random_trees_keep_running_and_stay_in_the_targets_support(target_hf, target):
    """Unseeded sampled rows with hostile trees: every emitted token has positive probability under top-k."""
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=16, ignore_eos=True)
    engine = engine_with(target, RandomTrees(target_hf, seed=6), k=3, nodes=8, max_num_seqs=4)
    ps = prompts(4, seed=51)
    outs = run(engine, ps, params)
    with torch.no_grad():
        for i, p in enumerate(ps):
            full = torch.tensor([p + outs[f"r{i}"]])
            logits = target_hf(full).logits[0, len(p) - 1 : -1]  # the rows that decided each output token
            top3 = logits.topk(3).indices
            assert all(t in row.tolist() for t, row in zip(outs[f"r{i}"], top3, strict=True))


def test_logprobs_with_trees_equal_plain_decodings(target_hf, target):
    ps = prompts(2, seed=52)
    for i, p in enumerate(ps):
        engine = engine_with(target, RandomTrees(target_hf, seed=7), k=3, nodes=8, max_num_seqs=1)
        engine.add_request("r", p, SamplingParams(max_tokens=12, ignore_eos=True), num_logprobs=2)
        got = []
        while engine.has_unfinished():
            for out in engine.step():
                got.extend(out.logprobs or [])
        ids = p + [lp.token_id for lp in got]
        with torch.no_grad():
            want = torch.log_softmax(target_hf(torch.tensor([ids])).logits[0, len(p) - 1 : -1].float(), -1)
        for j, lp in enumerate(got):
            assert abs(lp.logprob - float(want[j, lp.token_id])) < 1e-4, (i, j)


def test_output_formats_with_trees_equal_target_only_greedy_with_the_mask(target_hf, target):
    """Hostile trees for constrained requests: each node is masked along its own path; the output equals
    transformers' greedy run with the grammar engine's processor, and is in the format's language."""
    import json

    import llguidance
    from llguidance._tokenizer import TokenizerWrapper

    from shared.grammar import GrammarCompiler, GrammarLogitsProcessor
    from tests.unit.test_structured_engine import FORMATS, _CharTokenizer, char_text, run_params  # noqa: F401

    eos = VOCAB - 1
    compiler = GrammarCompiler(llguidance.LLTokenizer(TokenizerWrapper(_CharTokenizer()), n_vocab=VOCAB), VOCAB, (eos,))
    engine = engine_with(target, RandomTrees(target_hf, seed=8), k=4, nodes=8, max_num_seqs=6)
    engine.grammar = compiler
    ps = prompts(6, seed=53)
    formats = list(FORMATS.values())
    requests, refs = {}, {}
    for i, p in enumerate(ps):
        fmt = formats[i % 3]
        requests[f"r{i}"] = (p, SamplingParams(max_tokens=40, structured_output=fmt))
        processor = GrammarLogitsProcessor(compiler, [fmt], len(p))
        out = target_hf.generate(
            torch.tensor([p]), max_new_tokens=40, do_sample=False, pad_token_id=0, logits_processor=[processor]
        )
        refs[f"r{i}"] = out[0, len(p) :].tolist()
    outs = run_params(engine, requests)
    assert outs == refs
    assert engine.stats.accepted_tokens > 0
    assert json.loads(char_text(outs["r0"])).keys() == {"id", "tag"}
