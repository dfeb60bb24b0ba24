"""fp32 products through MKL's packed sgemm (`shared/model/mkl_product.py`), taken by `pack_weight` on Intel CPUs.

What they must give is what the oneDNN products give: the plain product to fp32 rounding, and a row's result
independent of how many rows share the product and of its place among them. Here the MKL path is taken on any CPU
whose torch has MKL (not only Intel's), so that these tests hold it to that wherever they run; a shape whose
rows MKL makes depend on the row count must fall back to oneDNN.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.model import mkl_product, parallel, tiles
from shared.model.build import CacheConfig, make_runner
from shared.model.compiled import _PRODUCTS, CompiledForward
from shared.model.eagle import build_head, head_config, init_head_state, save_head
from shared.model.parallel import ColumnParallelLinear, RowParallelLinear, linear, out_features, pack_weight
from tests.tiny import assert_one_token_steps_equal_scored_rows, default_width_model, ours, tiny_hf_model

needs_mkl = pytest.mark.skipif(
    not (torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available()), reason="torch without MKL"
)


@pytest.fixture
def mkl(monkeypatch):
    """The MKL path on this CPU whatever its vendor, each shape checked afresh. Where MKL's packed rows depend on
    the row count for every shape (an AMD EPYC, Zen 4, 2026-12-04: MKL's kernels are not Intel's own there),
    pack_weight refuses them and keeps oneDNN's, which is the check doing its work: the MKL path is never taken
    on such a CPU, and these tests have nothing of it to hold. Our own kernel, which pack_weight gives fp32 weights
    before MKL on AVX-512 CPUs that are not Intel's (tiles.py), is turned off."""
    monkeypatch.setattr(mkl_product, "available", lambda: True)
    monkeypatch.setattr(tiles, "enabled", lambda dtype: False)
    monkeypatch.setattr(mkl_product, "_checked", {})
    if mkl_product.pack(torch.randn(96, 64)) is None:
        pytest.skip("MKL's packed products depend on the row count on this CPU: pack_weight keeps oneDNN's")
    monkeypatch.setattr(mkl_product, "_checked", {})


def _is_mkl(weight: torch.Tensor) -> bool:
    return getattr(weight, mkl_product.ORIGIN, None) is not None


@pytest.mark.parametrize(
    ("vendor", "switch", "expected"),
    [
        ("GenuineIntel", None, True),
        ("GenuineIntel", "1", True),
        ("GenuineIntel", "0", False),  # SPECDEC_MKL_PRODUCTS=0: oneDNN's products everywhere
        ("AuthenticAMD", None, False),
        ("", None, False),
        ("CentaurHauls", None, False),
    ],
)
def test_mkl_products_are_taken_on_intel_cpus_only(monkeypatch, vendor, switch, expected):
    monkeypatch.setattr(mkl_product, "_vendor", lambda: vendor)
    if switch is None:
        monkeypatch.delenv("SPECDEC_MKL_PRODUCTS", raising=False)
    else:
        monkeypatch.setenv("SPECDEC_MKL_PRODUCTS", switch)
    mkl_product.available.cache_clear()
    try:
        assert mkl_product.available() is (expected and torch.backends.mkl.is_available())
    finally:
        mkl_product.available.cache_clear()


@needs_mkl
@pytest.mark.parametrize("shape", [(96, 64), (192, 64), (64, 128), (1000, 64)])
def test_mkl_packed_product_equals_plain(mkl, shape):
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(*shape, generator=gen), torch.randn(shape[0], generator=gen)
    packed = pack_weight(weight)
    assert packed.is_mkldnn and _is_mkl(packed) and out_features(packed) == shape[0]
    for rows in ((1, shape[1]), (7, shape[1]), (3, 5, shape[1]), (0, shape[1])):
        x = torch.randn(*rows, generator=gen)
        torch.testing.assert_close(linear(x, packed), F.linear(x, weight), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(linear(x, packed, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


@needs_mkl
@pytest.mark.parametrize("shape", [(3072, 576), (960, 576), (576, 1536), (192, 1536), (576, 576)])
def test_an_mkl_rows_result_does_not_depend_on_the_other_rows(mkl, shape):
    """The default target's shapes, 1 to 300 rows: every span's rows equal the same rows of one 300-row product."""
    gen = torch.Generator().manual_seed(1)
    packed = pack_weight(torch.randn(*shape, generator=gen))
    if not _is_mkl(packed):
        pytest.skip(f"MKL's rows of a {shape} weight depend on the row count on this CPU: it stays with oneDNN")
    x = torch.randn(300, shape[1], generator=gen)
    together = linear(x, packed)
    spans = ((0, 1), (0, 2), (4, 7), (0, 5), (3, 4), (7, 16), (11, 40), (0, 33), (5, 70), (9, 74), (17, 290))
    for start, stop in (*spans, (299, 300), (0, 300)):
        assert torch.equal(linear(x[start:stop], packed), together[start:stop]), (start, stop)


@needs_mkl
def test_a_shape_whose_rows_depend_on_the_row_count_stays_with_onednn(mkl, monkeypatch):
    real = mkl_product.product

    def row_dependent(rows, weight, origin, bias):  # a lone row summed in another order
        out = real(rows, weight, origin, bias)
        return out + 1e-3 if rows.shape[0] == 1 else out

    monkeypatch.setattr(mkl_product, "product", row_dependent)
    weight = torch.randn(64, 32)
    packed = pack_weight(weight)
    assert packed.is_mkldnn and not _is_mkl(packed)
    monkeypatch.setattr(mkl_product, "product", real)
    x = torch.randn(3, 32)
    torch.testing.assert_close(linear(x, packed), F.linear(x, weight), atol=1e-4, rtol=1e-5)
    assert not _is_mkl(pack_weight(torch.randn(64, 32)))  # the shape's verdict is kept


@needs_mkl
def test_half_weights_without_half_kernels_are_packed_as_fp32_copies_for_mkl(mkl, monkeypatch):
    monkeypatch.setattr(parallel, "half_kernels", lambda dtype: False)
    gen = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(192, 64, generator=gen).bfloat16(), torch.randn(192, generator=gen).bfloat16()
    packed = pack_weight(weight)
    assert _is_mkl(packed) and packed.dtype == torch.float32
    x = torch.randn(5, 64, generator=gen).bfloat16()
    got = linear(x, packed, bias)
    # multiplied in fp32 and rounded once: the fp32 product of the same (exactly representable) values, rounded
    assert got.dtype == torch.bfloat16 and torch.equal(got, linear(x.float(), packed, bias.float()).bfloat16())
    torch.testing.assert_close(got.float(), F.linear(x.float(), weight.float(), bias.float()), atol=0.05, rtol=0.01)


@needs_mkl
def test_an_mkl_packed_model_gives_one_token_steps_the_logits_of_scored_rows(mkl):
    """The whole forward in fp32 at the default target's widths: a one-token step's logits are, bit for bit, those of
    the same position among k + 1 scored rows and beside another sequence's rows."""
    model, arch = default_width_model(torch.float32)
    linears = [m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    assert linears and all(_is_mkl(m.weight) for m in linears) and _is_mkl(model.packed_lm_head)
    runner = make_runner(model, arch, num_blocks=64, cache=CacheConfig(block_size=4, attention_backend="torch"))
    assert_one_token_steps_equal_scored_rows(runner, beside=[1] * 30)


@needs_mkl
def test_models_heads_and_compiled_products_keep_their_shapes_when_packed_for_mkl(mkl, tmp_path):
    model, arch = ours(tiny_hf_model(seed=3))
    hidden = torch.randn(4, arch.hidden_size)
    torch.testing.assert_close(
        model.compute_logits(hidden), F.linear(hidden, model.lm_head_weight), atol=1e-4, rtol=1e-5
    )
    save_head(tmp_path, head_config(arch, 1, 16), init_head_state(arch, torch.arange(16)))
    head, _ = build_head(tmp_path, model.embed_tokens.weight, model.lm_head_weight)
    assert _is_mkl(head.fc_weight) and _is_mkl(head.subset_lm_head) and head.draft_vocab_size == 16
    assert head.compute_logits(torch.randn(3, arch.hidden_size)).shape == (3, 16)
    weight = pack_weight(torch.randn(40, arch.hidden_size))
    assert _PRODUCTS[CompiledForward._register(weight)].out_features == 40  # the compiled graph's product width
