"""Linear weights packed at load into oneDNN's blocked layout (`shared/model/parallel.py: pack_weight`).

The packed product must equal the plain one to fp32 rounding, in every shape the model calls it with, and a
row's result must not depend on how many rows share the product: that is what lets a speculative step's
k + 1 scored rows give, bit for bit, the logits a one-token step would.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shared.model import mkl_product, parallel, tiles
from shared.model.build import CacheConfig, make_runner
from shared.model.config import ModelArch
from shared.model.cpuinfo import cpuinfo_field
from shared.model.eagle import build_head, head_config, init_head_state, save_head
from shared.model.loader import build_model
from shared.model.parallel import ColumnParallelLinear, RowParallelLinear, half_kernels, linear, pack_weight
from tests.tiny import assert_one_token_steps_equal_scored_rows, default_width_model, ours, tiny_hf_model

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("shape", [(96, 64), (192, 64), (64, 128), (1000, 64)])
def test_packed_product_equals_plain(shape, fp32_path):
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(*shape, generator=gen), torch.randn(shape[0], generator=gen)
    packed = pack_weight(weight)
    assert _packed_as(packed, fp32_path) if shape[0] % 32 == 0 else packed.is_mkldnn  # tiles: 32 outputs each
    for rows in ((1, shape[1]), (7, shape[1]), (3, 5, shape[1])):  # 3-D: the EAGLE head's [batch, seq, hidden]
        x = torch.randn(*rows, generator=gen)
        torch.testing.assert_close(linear(x, packed), F.linear(x, weight), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(linear(x, packed, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


@needs_onednn
@pytest.mark.parametrize("shape", [(3072, 576), (960, 576), (576, 1536), (192, 1536)])
def test_a_rows_result_does_not_depend_on_the_other_rows(shape, fp32_path):
    """The default target's shapes. With an input of 1536 (the MLP's down projection) oneDNN's one-row kernel
    summed in another order than its kernel for several rows; `linear` gives a product of fewer than four rows
    spare rows (parallel.MIN_PRODUCT_ROWS). Our kernel's rows need none."""
    gen = torch.Generator().manual_seed(1)
    packed = pack_weight(torch.randn(*shape, generator=gen))
    assert _packed_as(packed, fp32_path)
    x = torch.randn(40, shape[1], generator=gen)
    together = linear(x, packed)
    for start, stop in ((0, 1), (0, 2), (4, 7), (0, 5), (3, 4), (7, 16), (11, 40)):
        assert torch.equal(linear(x[start:stop], packed), together[start:stop]), (start, stop)


def test_weights_that_onednn_would_not_take_stay_plain():
    for weight in (torch.randn(8), torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 9, (8, 4))):
        assert pack_weight(weight) is weight


HALF = [torch.bfloat16, torch.float16]


@pytest.fixture(params=["fp32 copy", "fp32 copy tiled", "native", "bf16 tiles"])
def half_path(request, monkeypatch):
    """Half-precision weights packed as fp32 copies (CPUs without half instructions, e.g. AVX2 or AVX-512 without
    BF16) for oneDNN or, where our kernel takes fp32 (AVX-512, not Intel's: shared/model/tiles.py), tiled for it;
    in their own dtype for oneDNN (AVX-512 BF16 / FP16, AMX); or, bf16 only, tiled for our kernel (AVX-512 BF16
    without AMX). The tiled paths are forced here on any CPU, where the kernel runs its portable path if the CPU
    lacks the instructions; "native" only runs where this CPU has them. oneDNN's bf16 kernels also run, emulated,
    on any AVX-512 CPU, but the packing does not take them there: slower than the fp32 copy, and one row's result
    then depends on how many rows share the product (seen on a Xeon without BF16: row 3 of 40 alone differed from
    the same row among the 40)."""
    tiled = {"bf16 tiles": torch.bfloat16, "fp32 copy tiled": torch.float32}.get(request.param)
    monkeypatch.setattr(tiles, "enabled", lambda dtype: dtype == tiled)
    if tiled == torch.bfloat16:
        monkeypatch.setattr(parallel, "amx_tiles", lambda: False)  # pack_weight leaves bf16 to oneDNN with AMX
    if tiled == torch.float32:
        monkeypatch.setattr(mkl_product, "intel_cpu", lambda: False)  # and fp32 to MKL on Intel's CPUs
    if request.param.startswith("fp32 copy"):
        monkeypatch.setattr(parallel, "half_kernels", lambda dtype: False)
    return request.param


@pytest.fixture(params=["oneDNN", "fp32 tiles"])
def fp32_path(request, monkeypatch):
    """fp32 weights packed for oneDNN, or tiled for our kernel (forced here on any CPU, as above). Intel's CPUs
    pack them for MKL instead (tests/unit/test_mkl_product.py), turned off here."""
    monkeypatch.setattr(tiles, "enabled", lambda dtype: request.param == "fp32 tiles" and dtype == torch.float32)
    monkeypatch.setattr(mkl_product, "intel_cpu", lambda: False)
    monkeypatch.setattr(mkl_product, "available", lambda: False)
    if request.param == "fp32 tiles" and tiles.load_kernel() is None:
        pytest.skip("no C++ compiler to build the product kernel")
    return request.param


def _half_or_skip(dtype: torch.dtype, path: str) -> None:
    if path == "native" and not half_kernels(dtype):
        pytest.skip(f"this CPU has no {dtype} instructions for oneDNN's kernels")
    if path == "bf16 tiles" and dtype != torch.bfloat16:
        pytest.skip("the tiled kernel multiplies bf16 only")
    if path in TILED_PATHS and tiles.load_kernel() is None:
        pytest.skip("no C++ compiler to build the product kernel")


TILED_PATHS = ("bf16 tiles", "fp32 copy tiled", "fp32 tiles")


def _packed_as(weight: torch.Tensor, path: str) -> bool:
    return tiles.is_packed(weight) if path in TILED_PATHS else weight.is_mkldnn


@pytest.mark.parametrize(
    ("machine", "avx512_bf16", "amx", "flags", "expected"),
    [
        ("x86_64", False, False, {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, False),  # Skylake-SP: emulated
        ("x86_64", False, False, {"avx2", "fma"}, False),
        ("x86_64", True, False, {"avx512f", "avx512_bf16"}, True),  # Cooper Lake, Zen 4
        ("x86_64", False, True, {"amx_tile", "amx_bf16"}, True),  # Sapphire Rapids
        ("x86_64", False, False, {"avx2", "avx_ne_convert"}, True),  # Sierra Forest, Arrow Lake
        ("aarch64", False, False, set(), True),  # ARM: oneDNN's own check decides
    ],
)
def test_bf16_counts_as_native_only_with_bf16_instructions(monkeypatch, machine, avx512_bf16, amx, flags, expected):
    monkeypatch.setattr(parallel.platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(parallel, "_cpu_flags", lambda: flags)
    assert parallel.bf16_instructions() is expected
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert half_kernels(torch.bfloat16) is expected
    weight = pack_weight(torch.randn(16, 8).bfloat16())
    assert weight.is_mkldnn and weight.dtype == (torch.bfloat16 if expected else torch.float32)


@pytest.mark.parametrize(
    ("machine", "avx512_bf16", "amx", "expected"),
    [
        ("x86_64", True, False, False),  # Zen 4, Cooper Lake: row-invariant in one call (measured on Zen 4)
        ("x86_64", True, True, True),  # Sapphire Rapids: a row's bf16 result depended on the row count
        ("x86_64", False, True, True),
        ("x86_64", False, False, True),  # AVX-NE-CONVERT only: not measured, the blocks stay
        ("aarch64", False, False, True),
    ],
)
def test_bf16_products_run_in_blocks_except_with_avx512_bf16_and_no_amx(
    monkeypatch, machine, avx512_bf16, amx, expected
):
    monkeypatch.setattr(parallel.platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    parallel.bf16_in_blocks.cache_clear()
    try:
        assert parallel.bf16_in_blocks() is expected
    finally:
        parallel.bf16_in_blocks.cache_clear()


def test_cpu_flags_are_read_from_this_machine():
    flags = parallel._cpu_flags()
    if Path("/proc/cpuinfo").exists() and parallel.platform.machine() == "x86_64":
        assert "sse2" in flags  # every x86-64 CPU has it
        assert cpuinfo_field("vendor_id")  # mkl_product's choice reads it
    assert cpuinfo_field("no such field") == ""


@needs_onednn
@pytest.mark.parametrize("dtype", HALF)
def test_half_product_is_the_fp32_product_rounded_once(dtype, half_path):
    """A half-precision product accumulates in fp32 and rounds its result once: the fp32 product of the same
    (exactly representable) values, rounded, within one half-precision step where two fp32 sums differ in their
    last bits across a rounding boundary."""
    _half_or_skip(dtype, half_path)
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(192, 64, generator=gen).to(dtype)
    bias = torch.randn(192, generator=gen).to(dtype)
    packed = pack_weight(weight)
    fp32_copy = half_path.startswith("fp32 copy")
    assert _packed_as(packed, half_path) and packed.dtype == (torch.float32 if fp32_copy else dtype)
    for rows in ((1, 64), (7, 64), (3, 5, 64)):
        x = torch.randn(*rows, generator=gen).to(dtype)
        for b in (None, bias):
            got = linear(x, packed, b)
            assert got.dtype == dtype and got.shape == (*rows[:-1], 192)
            want = F.linear(x.float(), weight.float(), None if b is None else b.float())
            step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp(min=1e-3))) - (7 if dtype == torch.bfloat16 else 10))
            assert bool(((got.float() - want).abs() <= step).all()), (dtype, rows, b is not None)


@needs_onednn
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape", [(3072, 576), (576, 1536), (960, 576)])
def test_a_half_rows_result_does_not_depend_on_the_other_rows(dtype, shape, half_path):
    """On a Xeon with AMX, oneDNN's bf16 product in one call gave a row of the up projection another last bit at
    3-32 rows than at 1, 2 or 40, and rows of the down projection (1536 wide) at almost any count; `linear` runs
    such products there in blocks of a fixed row count (parallel.HALF_BLOCK_ROWS). With AVX-512 BF16 and no AMX
    it runs them in one call (parallel.bf16_in_blocks): this test is what holds that CPU to row-invariance."""
    _half_or_skip(dtype, half_path)
    gen = torch.Generator().manual_seed(1)
    packed = pack_weight(torch.randn(*shape, generator=gen).to(dtype))
    x = torch.randn(300, shape[1], generator=gen).to(dtype)
    together = linear(x, packed)
    spans = ((0, 1), (0, 2), (4, 7), (0, 5), (3, 4), (7, 16), (11, 40), (0, 33), (5, 70), (9, 74), (17, 290))
    spans += ((299, 300),)
    for start, stop in spans:
        assert torch.equal(linear(x[start:stop], packed), together[start:stop]), (start, stop)


@pytest.mark.skipif(not half_kernels(torch.bfloat16), reason="this CPU has no bf16 instructions for oneDNN's kernels")
def test_a_bf16_block_padded_with_an_earlier_products_rows_gives_what_zero_padding_gives(monkeypatch):
    """`linear` pads a bf16 product's last block in a block kept per thread, whose spare rows hold an earlier
    product's rows rather than zeros (parallel._padded_block). Without bf16 instructions nothing is padded; where
    the products run in one call (parallel.bf16_in_blocks) the blocks are made to run here all the same."""
    monkeypatch.setattr(parallel, "bf16_in_blocks", lambda: True)
    monkeypatch.setattr(tiles, "enabled", lambda dtype: False)
    gen = torch.Generator().manual_seed(3)
    packed = pack_weight(torch.randn(576, 1536, generator=gen).bfloat16())
    earlier, x = torch.randn(15, 1536, generator=gen).bfloat16(), torch.randn(21, 1536, generator=gen).bfloat16()
    for rows in (x[:1], x[:6], x):  # one block; a whole block and a partial one
        linear(earlier, packed)
        spare = parallel._padded_block(earlier)[rows.shape[0] % parallel.HALF_BLOCK_ROWS :]
        assert spare.abs().sum() > 0  # the spare rows the next product leaves are not zeros
        block_rows = parallel.HALF_BLOCK_ROWS
        zero_padded = torch.cat(
            [
                parallel.onednn_product(F.pad(b, (0, 0, 0, block_rows - b.shape[0])), packed, None)[: b.shape[0]]
                for b in rows.split(block_rows)
            ]
        )
        assert torch.equal(linear(rows, packed), zero_padded), rows.shape[0]


def test_a_bf16_position_gets_the_same_logits_in_a_one_token_step_and_among_scored_rows(half_path):
    """The whole forward in bf16, at the default target's widths (576 hidden, 1536 MLP): the logits a one-token
    step gives are, bit for bit, those of the same position among k + 1 scored rows and beside another
    sequence's rows, what keeps speculative and plain decoding on one path at bf16's many near-ties."""
    _half_or_skip(torch.bfloat16, half_path)
    model, arch = default_width_model(torch.bfloat16)
    runner = make_runner(model, arch, num_blocks=64, cache=CacheConfig(block_size=4, attention_backend="torch"))
    assert_one_token_steps_equal_scored_rows(runner, beside=[1] * 30)


@needs_onednn
def test_a_bf16_model_is_packed_and_its_logits_are_bf16_values(half_path):
    _half_or_skip(torch.bfloat16, half_path)
    hf = tiny_hf_model(seed=4)
    arch = ModelArch.from_hf_config(hf.config)
    model = build_model(arch, hf.state_dict(), torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    assert linears and all(_packed_as(m.weight, half_path) for m in linears)
    assert model.embed_tokens.weight.dtype == torch.bfloat16 and not model.embed_tokens.weight.is_mkldnn
    hidden = torch.randn(4, arch.hidden_size).bfloat16()
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32  # what the sampler reads
    assert torch.equal(logits, logits.bfloat16().float())  # rounded as transformers' bf16 LM head rounds
    torch.testing.assert_close(logits, F.linear(hidden, model.lm_head_weight).float(), atol=0.07, rtol=0.02)


def test_an_fp32_position_gets_the_same_logits_in_a_one_token_step_and_among_scored_rows(fp32_path):
    """As the bf16 test below, in fp32 at the default target's widths: oneDNN's products with spare rows
    (parallel.MIN_PRODUCT_ROWS) and our kernel's (AVX-512 CPUs that are not Intel's) alike."""
    model, arch = default_width_model(torch.float32)
    assert _packed_as(model.layers[0].mlp.down_proj.weight, fp32_path)
    runner = make_runner(model, arch, num_blocks=64, cache=CacheConfig(block_size=4, attention_backend="torch"))
    assert_one_token_steps_equal_scored_rows(runner, beside=[1] * 30)


@needs_onednn
def test_loaded_models_and_heads_are_packed_and_keep_their_plain_embedding(tmp_path, fp32_path):
    model, arch = ours(tiny_hf_model(seed=3))
    linears = [m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    assert linears and all(_packed_as(m.weight, fp32_path) for m in linears)
    assert not model.embed_tokens.weight.is_mkldnn  # read by the embedding and by EAGLE heads
    hidden = torch.randn(4, arch.hidden_size)
    torch.testing.assert_close(
        model.compute_logits(hidden), F.linear(hidden, model.lm_head_weight), atol=1e-4, rtol=1e-5
    )
    config = head_config(arch, 1, 16)
    save_head(tmp_path, config, init_head_state(arch, torch.arange(16)))
    head, _ = build_head(tmp_path, model.embed_tokens.weight, model.lm_head_weight)
    assert _packed_as(head.fc_weight, fp32_path) and head.subset_lm_head.is_mkldnn  # 16 outputs: not a tile
    head_linears = [m for m in head.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    assert all(_packed_as(m.weight, fp32_path) for m in head_linears)
