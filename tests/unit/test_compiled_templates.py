"""`--compile` with bf16 weights on a CPU with AMX (shared/model/compiled.py, `products_in_graph`): the
layers' products (and the LM head's, in a graph of its own) are made by Inductor's C++ GEMM templates over the
frozen weights. What must hold, forced on here whatever the CPU: the graph calls none of our products, a position
gets bit for bit the same logits in a one-token step, among scored rows and beside other sequences (a prefill
too), the logits stay those of the eager bf16 forward up to bf16 rounding, and an engine speculating on it decodes
what it decodes plainly."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import LlamaForCausalLM

from shared.model import compiled
from shared.model.build import CacheConfig, make_runner
from shared.model.compiled import CompiledForward, _unpack_layers, products_in_graph
from shared.model.config import ModelArch
from shared.model.loader import build_model
from shared.model.runner import ForwardItem
from shared.sampling import SamplingParams
from specdec_local.builder import build_engine, make_draft_model_drafter
from tests.tiny import assert_one_token_steps_equal_scored_rows, tiny_config
from verifier_service.engine import EngineConfig

needs_compiler = pytest.mark.skipif(
    not compiled.has_cpp_compiler(), reason="no C++ compiler for torch.compile's CPU kernels"
)
BLOCK = 4


@pytest.fixture(scope="module")
def state_and_arch():
    """Two layers at the default target's widths (576 hidden, 1536 MLP, 9 heads on 3 KV heads), bf16 values."""
    torch.manual_seed(21)
    config = tiny_config(vocab_size=256)
    config.hidden_size, config.intermediate_size = 576, 1536
    config.num_attention_heads, config.num_key_value_heads = 9, 3
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)  # clear greedy margins, as the tiny models' logit_scale
    state = {name: tensor.to(torch.bfloat16) for name, tensor in hf.state_dict().items()}
    return state, ModelArch.from_hf_config(config)


@pytest.fixture(scope="module")
def templated(state_and_arch):
    """The compiled model with in-graph products (built unpacked: on a CPU without bf16 kernels a packed bf16 weight
    is an fp32 copy), compiled by its first forward here, counting the templates Inductor made."""
    state, arch = state_and_arch
    model = build_model(arch, state, torch.bfloat16, pack=False)
    model.compile(templates=True)
    before = counters["inductor"]["cpp_templated_kernel_counter"]
    runner_of(model, arch).forward([ForwardItem(list(range(8)), 0, list(range(3, 20)), 1)])
    return model, arch, counters["inductor"]["cpp_templated_kernel_counter"] - before


def runner_of(model, arch, num_blocks: int = 96):
    return make_runner(model, arch, num_blocks, CacheConfig(block_size=BLOCK, attention_backend="torch"))


def test_products_in_graph_for_bf16_on_cpus_with_amx(monkeypatch):
    monkeypatch.setattr(compiled, "amx_tiles", lambda: True)
    assert products_in_graph(torch.bfloat16)
    assert not products_in_graph(torch.float32)
    assert not products_in_graph(torch.float16)
    monkeypatch.setattr(compiled, "amx_tiles", lambda: False)
    assert not products_in_graph(torch.bfloat16)


@needs_compiler
def test_the_graph_makes_every_product_itself(templated, monkeypatch):
    model, arch, templates = templated
    assert templates == 4 * arch.num_layers + 1  # qkv, out, gate_up and down of each layer, and the LM head

    def refuse(*args, **kwargs):
        raise AssertionError("an opaque product was called")

    monkeypatch.setattr(compiled, "linear", refuse)
    logits = runner_of(model, arch).forward([ForwardItem(list(range(8)), 0, [5, 6, 7, 8, 9], 1)])[0]
    assert torch.isfinite(logits).all()


@needs_compiler
def test_a_position_gets_the_same_logits_alone_among_scored_rows_and_beside_others(templated):
    model, arch, _ = templated
    runner = runner_of(model, arch)
    assert_one_token_steps_equal_scored_rows(runner, beside=[1, 2])
    table, other = list(range(32, 48)), list(range(48, 96))
    prompt, drafts = [12, 50, 7, 19, 88, 23, 30], [7, 8, 9, 10, 11]
    runner.forward([ForwardItem(table, 0, prompt, 1)])
    alone = runner.forward([ForwardItem(table, len(prompt), drafts, len(drafts))])[0]
    for prefill in (3, 40, 150):  # beside another sequence's prefill: 8 to 155 rows in the step
        beside = ForwardItem(other, 0, list(range(1, prefill + 1)), 1)
        together = runner.forward([ForwardItem(table, len(prompt), drafts, len(drafts)), beside])[0]
        assert torch.equal(together, alone), prefill


@needs_compiler
def test_logits_are_the_eager_bf16_ones_up_to_rounding(templated, state_and_arch):
    model, arch, _ = templated
    state, _ = state_and_arch
    eager = build_model(arch, state, torch.bfloat16, pack=False)
    prompt, drafts = [12, 50, 7, 19, 88, 23, 30, 6, 1, 44, 15], [7, 8, 9, 10, 11]
    got_runner, want_runner = runner_of(model, arch), runner_of(eager, arch)
    got = [r.forward([ForwardItem(list(range(16)), 0, prompt, 1)])[0] for r in (got_runner, want_runner)]
    step = [ForwardItem(list(range(16)), len(prompt), drafts, len(drafts))]
    scored = [got_runner.forward(step)[0], want_runner.forward(step)[0]]
    for compiled_logits, eager_logits in (got, scored):
        # bf16 rounds each product and activation to 8 bits of mantissa, in another order in the graph's fused
        # loops: a few of bf16's steps at these logits' magnitude (~10), far below what a wrong weight or a
        # missing product would move
        torch.testing.assert_close(compiled_logits, eager_logits, rtol=0, atol=0.25)
        assert torch.equal(compiled_logits.argmax(-1), eager_logits.argmax(-1))


@needs_compiler
def test_an_engine_speculating_on_it_decodes_what_it_decodes_plainly(templated, state_and_arch):
    model, arch, _ = templated
    state, _ = state_and_arch
    draft = build_model(arch, state, torch.bfloat16, pack=False)  # the same weights, eager: most drafts accepted
    prompts = [[5, 17, 33, 2, 8, 61, 4], [9, 9, 40, 71, 3], [12, 50, 7, 19, 88, 23, 30, 6, 1, 44, 15]]
    outputs = {}
    for k in (0, 3):
        config = EngineConfig(num_speculative_tokens=k, adaptive_k=False, max_num_seqs=4, max_model_len=96)
        cache = CacheConfig(block_size=BLOCK)
        drafter = make_draft_model_drafter(draft, arch, config, cache) if k else None
        engine = build_engine((model, arch), drafter, config, cache)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=24, ignore_eos=True))
        outputs[k] = {f"r{i}": [] for i in range(len(prompts))}
        accepted = 0
        while engine.has_unfinished():
            for out in engine.step():
                outputs[k][out.request_id].extend(out.new_token_ids)
                accepted += max(0, len(out.new_token_ids) - 1)
        if k:
            assert accepted > 0  # the scoring rows were exercised
    assert outputs[3] == outputs[0]


def test_packed_bf16_weights_are_unpacked_and_fp32_copies_refused(state_and_arch):
    state, arch = state_and_arch
    model = build_model(arch, state, torch.bfloat16, pack=False)
    layer = model.layers[0]
    plain = layer.mlp.down_proj.weight.detach().clone()
    layer.mlp.down_proj.weight = torch.nn.Parameter(
        torch.ops.mkldnn._reorder_linear_weight(plain, 16), requires_grad=False
    )
    _unpack_layers(list(model.layers), torch.bfloat16)
    assert not layer.mlp.down_proj.weight.is_mkldnn and torch.equal(layer.mlp.down_proj.weight, plain)
    layer.mlp.down_proj.weight = torch.nn.Parameter(
        torch.ops.mkldnn._reorder_linear_weight(plain.float(), 16), requires_grad=False
    )
    with pytest.raises(ValueError, match="build the model or head unpacked"):
        CompiledForward(model, templates=True)
