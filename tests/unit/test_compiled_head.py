"""The EAGLE head compiled (the proposer's `--compile`, shared/model/compiled_head.py): its states and logits are
the eager head's (within bf16 rounding where the graph makes its own bf16 products, forced here on any CPU; 1e-4
with the opaque fp32 products), a position's result does not depend on the rest of the forward, an engine drafting
with it decodes transformers' greedy tokens, and the proposer's warm-up compiles it and leaves nothing behind."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from proposer_service.builder import ProposerInfo, warm_up
from proposer_service.config import ProposerConfig
from proposer_service.eagle import drafter_for_head
from shared.config import load_config
from shared.kv.cache import KVCache
from shared.model import compiled
from shared.model.attention import SeqSpan, build_metadata
from shared.model.eagle import build_head
from shared.sampling import SamplingParams
from tests.tiny import hf_greedy, ours, tiny_hf_model
from tests.unit.test_eagle import FUSED, embeddings, engine_with_eagle, make_head_dir, prompts, run

pytestmark = pytest.mark.skipif(
    not compiled.has_cpp_compiler(), reason="no C++ compiler for torch.compile's CPU kernels"
)
BLOCK = 4


@pytest.fixture(scope="module")
def target():
    hf = tiny_hf_model(seed=1, logit_scale=8.0)
    return hf, ours(hf)


def heads(folder, target, dtype: torch.dtype, templates: bool):
    """The eager head (packed as the proposer packs it) and its twin compiled (built plain where the graph makes the
    products: on a CPU without bf16 kernels a packed bf16 weight is an fp32 copy)."""
    eager, arch = build_head(folder, *embeddings(target), dtype=dtype)
    twin, _ = build_head(folder, *embeddings(target), dtype=dtype, pack=not templates)
    twin.compile(templates=templates)
    return eager, twin, arch


def forward(head, cache, spans, features, ids):
    meta = build_metadata(spans, BLOCK)
    hidden = head(features, ids, cache.layers, meta)
    return hidden, head.compute_logits(hidden)


@pytest.mark.parametrize(("dtype", "templates"), [(torch.bfloat16, True), (torch.float32, False)])
def test_compiled_head_is_the_eager_head(tmp_path, target, dtype, templates, monkeypatch):
    _, tiny = target
    folder = make_head_dir(tmp_path, tiny[1], torch.randperm(96)[:40], layers=FUSED, scale=4.0)
    eager, twin, arch = heads(folder, tiny, dtype, templates)
    caches = [KVCache(1, 16, BLOCK, arch.num_kv_heads, arch.head_dim, dtype) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    lengths, tables = [9, 6], [[0, 1, 2], [3, 4]]
    features = eager.fuse_features(torch.randn(sum(lengths), eager.feature_width, generator=gen))
    ids = torch.randint(0, 96, (sum(lengths),), generator=gen)
    before = counters["inductor"]["cpp_templated_kernel_counter"]
    spans = [SeqSpan(t, 0, n) for t, n in zip(tables, lengths, strict=True)]
    outs = [forward(head, c, spans, features, ids) for head, c in zip((eager, twin), caches, strict=True)]
    (hidden, logits), (twin_hidden, twin_logits) = outs
    if templates:  # every product made by the graphs: fc, the layer's four, the LM head over the subset
        assert counters["inductor"]["cpp_templated_kernel_counter"] - before == 4 * arch.num_layers + 2
        torch.testing.assert_close(twin_hidden.float(), hidden.float(), atol=0.1, rtol=0.02)
        torch.testing.assert_close(twin_logits, logits, atol=0.25, rtol=0.02)
    else:
        torch.testing.assert_close(twin_hidden, hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(twin_logits, logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(twin_logits.argmax(-1), logits.argmax(-1))
    # One draft position of the second sequence alone, then beside the first's: the same states bit for bit.
    step = torch.randn(2, arch.hidden_size, generator=gen).to(dtype)
    step_ids = torch.tensor([5, 7])
    alone = forward(twin, caches[1], [SeqSpan(tables[1], 6, 1)], step[1:], step_ids[1:])
    both = forward(twin, caches[1], [SeqSpan(tables[0], 9, 1), SeqSpan(tables[1], 6, 1)], step, step_ids)
    assert torch.equal(both[0][1:], alone[0]) and torch.equal(both[1][1:], alone[1])

    def refuse(*args, **kwargs):
        raise AssertionError("an eager product was called")

    if templates:  # the compiled graphs only, and no eager product, from now on
        monkeypatch.setattr("shared.model.eagle.linear", refuse)
        monkeypatch.setattr("shared.model.parallel.linear", refuse)
        monkeypatch.setattr(compiled, "linear", refuse)
        forward(twin, caches[1], [SeqSpan(tables[1], 6, 1)], step[1:], step_ids[1:])


def test_an_engine_drafting_with_the_compiled_head_decodes_the_targets_greedy_tokens(tmp_path, target):
    hf, tiny = target
    folder = make_head_dir(tmp_path, tiny[1], torch.arange(96))
    head, _ = build_head(folder, *embeddings(tiny), dtype=torch.float32)
    head.compile()
    drafter = drafter_for_head(head, num_blocks=256, block_size=BLOCK)
    info = ProposerInfo("eagle", str(folder), 96, max_k=4, target_hidden_size=tiny[1].hidden_size)
    warm_up(drafter, info)  # what the proposer's --compile does before it serves
    assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks and not drafter.states
    assert head.compiled is not None and head.compiled.graph is not None and head.compiled.logits_graph is not None
    engine = engine_with_eagle(tiny, drafter, k=3, max_num_seqs=3)
    ps = prompts(3, seed=5)
    outs = run(engine, ps, SamplingParams(max_tokens=20, ignore_eos=True))
    for i, p in enumerate(ps):
        assert outs[f"r{i}"] == hf_greedy(hf, p, 20, eos=False)
    assert engine.stats.drafted_tokens > 0  # a random head's drafts: rejected, and the output the target's


def test_compile_is_refused_for_proposers_without_a_model():
    for kind in ("ngram", "suffix"):
        with pytest.raises(ValueError, match=f"a {kind} drafter runs no model"):
            ProposerConfig(kind=kind, compile=True)
    assert ProposerConfig(kind="eagle", compile=True).compile
    assert load_config(ProposerConfig, ["--kind", "draft-model", "--compile"]).compile
