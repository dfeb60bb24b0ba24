"""`--compile` (shared/model/compiled.py): the target's forward as one compiled graph. Its logits and features
stay within 1e-4 of the eager forward's on mixed steps (prefill chunks, decode rows, scoring rows, a token tree),
one graph serves every step size, a position gets bit for bit the same logits in a one-token step, among k + 1
scored rows and beside other sequences (eager and compiled, on an MLP as wide as the default target's, whose
one-row product oneDNN once summed in another order), and an engine on the compiled target decodes greedily what
transformers does, with and without a drafter."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from shared.model.attention import tree_of_parents
from shared.model.build import CacheConfig, load_paged_model, make_runner
from shared.model.compiled import has_cpp_compiler
from shared.model.runner import ForwardItem, ModelRunner
from shared.sampling import SamplingParams
from specdec_local.builder import build_engine, make_draft_model_drafter
from tests.tiny import assert_one_token_steps_equal_scored_rows, hf_greedy, ours, tiny_config, tiny_hf_model
from verifier_service.config import VerifierConfig
from verifier_service.engine import EngineConfig

# Inductor compiles its CPU kernels with the system's C++ compiler; the images and CI have one.
needs_compiler = pytest.mark.skipif(not has_cpp_compiler(), reason="no C++ compiler for torch.compile's CPU kernels")
BLOCK = 4
ATOL = 1e-4
PROMPTS = [[5, 17, 33, 2, 8, 61, 4], [9, 9, 40, 71, 3], [12, 50, 7, 19, 88, 23, 30, 6, 1, 44, 15]]


@pytest.fixture(scope="module")
def target_hf():
    return tiny_hf_model(seed=11, logit_scale=8.0)


@pytest.fixture(scope="module")
def pair(target_hf):
    """An eager model and a compiled one with the same weights (compiling changes the model object)."""
    eager, arch = ours(target_hf)
    compiled, _ = ours(target_hf)
    compiled.compile()
    return (eager, arch), (compiled, arch)


@pytest.fixture(scope="module")
def wide_pair():
    """Eager and compiled models whose MLP is 1536 wide, the default target's (its down projection's input)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(13)
    config = tiny_config()
    config.intermediate_size = 1536
    hf = LlamaForCausalLM(config).eval()
    eager, arch = ours(hf)
    compiled, _ = ours(hf)  # compiled by the test that uses it (not where no compiler is found)
    return (eager, arch), (compiled, arch)


def runner_of(model_arch) -> ModelRunner:
    model, arch = model_arch
    return make_runner(model, arch, num_blocks=64, cache=CacheConfig(block_size=BLOCK, attention_backend="torch"))


def mixed_steps(runner: ModelRunner, layers: tuple[int, ...] = (-1,)):
    """Logits and features of a prefill, then a step mixing a prefill chunk, a decode row, scoring rows and a
    token tree, then a one-token step."""
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    out = [runner.forward_with_hidden([ForwardItem(tables[0], 0, PROMPTS[0], 1)], layers)]
    out.append(runner.forward_with_hidden([ForwardItem(tables[1], 0, PROMPTS[1], 1)], layers))
    tokens, parents = [3, 4, 5, 6], [-1, 0, 0, 1]
    mixed = [
        ForwardItem(tables[2], 0, PROMPTS[2][:6], 0),  # a prefill chunk
        ForwardItem(tables[0], len(PROMPTS[0]), [7, 8, 9], 3),  # scoring rows
        ForwardItem(
            tables[1],
            len(PROMPTS[1]) - 1,
            [PROMPTS[1][-1], *tokens],
            5,
            tree=tree_of_parents(len(PROMPTS[1]) - 1, 1 + len(tokens), parents),
        ),  # fmt: skip
    ]
    out.append(runner.forward_with_hidden(mixed, layers))
    out.append(runner.forward_with_hidden([ForwardItem(tables[0], len(PROMPTS[0]) + 3, [10], 1)], layers))
    return out


@needs_compiler
def test_compiled_forward_is_close_to_eager_on_mixed_steps(pair):
    eager, compiled = pair
    for layers in ((-1,), (0, 1, -1)):
        got = mixed_steps(runner_of(compiled), layers)
        want = mixed_steps(runner_of(eager), layers)
        for (got_logits, got_features), (want_logits, want_features) in zip(got, want, strict=True):
            for a, b in zip(got_logits + got_features, want_logits + want_features, strict=True):
                assert a.shape == b.shape
                torch.testing.assert_close(a, b, rtol=0, atol=ATOL)


@needs_compiler
def test_one_graph_serves_every_step_size(pair):
    _, compiled = pair
    runner = runner_of(compiled)
    table = list(range(16))
    runner.forward([ForwardItem(table, 0, PROMPTS[2], 1)])  # compiled here, if no test did before
    graphs = counters["stats"]["unique_graphs"]
    position = len(PROMPTS[2])
    for size in (1, 2, 5, 1, 9, 3):
        runner.forward([ForwardItem(table, position, [7] * size, size)])
        position += size
    assert counters["stats"]["unique_graphs"] == graphs


@needs_compiler
def test_a_row_scored_beside_others_gets_what_it_gets_alone(pair):
    """What speculative decoding's exactness leans on: k + 1 rows of one sequence get the same logits, bit for bit,
    whatever else the step scores."""
    _, compiled = pair
    runner = runner_of(compiled)
    tables = [list(range(0, 8)), list(range(8, 16))]
    for table, prompt in zip(tables, PROMPTS, strict=False):
        runner.forward([ForwardItem(table, 0, prompt, 1)])
    alone = runner.forward([ForwardItem(tables[0], len(PROMPTS[0]), [7, 8, 9], 3)])[0]
    together = runner.forward(
        [ForwardItem(tables[0], len(PROMPTS[0]), [7, 8, 9], 3), ForwardItem(tables[1], len(PROMPTS[1]), [1, 2], 2)]
    )[0]
    assert torch.equal(alone, together)


@pytest.mark.parametrize("which", ["eager", pytest.param("compiled", marks=needs_compiler)])
def test_a_position_gets_the_same_logits_in_a_one_token_step_and_among_scored_rows(wide_pair, which):
    model, arch = wide_pair[0] if which == "eager" else wide_pair[1]
    if which == "compiled" and model.compiled is None:
        model.compile()
    assert_one_token_steps_equal_scored_rows(runner_of((model, arch)), beside=[1, 2])


@needs_compiler
@pytest.mark.parametrize("k", [0, 3])
def test_engine_on_a_compiled_target_decodes_as_transformers(target_hf, pair, k):
    _, compiled = pair
    config = EngineConfig(num_speculative_tokens=k, adaptive_k=False, max_num_seqs=4, max_model_len=96)
    cache = CacheConfig(block_size=BLOCK)
    drafter = None
    if k:
        draft, arch = ours(tiny_hf_model(seed=12, layers=1, logit_scale=8.0))
        drafter = make_draft_model_drafter(draft, arch, config, cache)
    engine = build_engine(compiled, drafter, config, cache)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    for i, prompt in enumerate(PROMPTS):
        assert outputs[f"r{i}"] == hf_greedy(target_hf, prompt, 24, eos=False)


def test_compile_is_refused_where_it_cannot_run(target_hf, monkeypatch):
    model, _ = ours(target_hf)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ValueError, match="--compile needs a C\\+\\+ compiler"):
        model.compile()
    monkeypatch.undo()
    with pytest.raises(ValueError, match="--compile needs --tensor-parallel-size 1"):
        VerifierConfig(compile=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="--compile needs --tensor-parallel-size 1"):
        load_paged_model("any/model", 2, 64, 0, CacheConfig(), compile=True, tensor_parallel_size=2)
