"""bf16 and fp32 products through our own kernel (shared/model/tile_kernel.cpp via shared/model/tiles.py).

Forced on any CPU: without AVX-512 (BF16) the kernel builds its portable path, which sums in the same order, so what
is tested here (the product within one rounding of the fp32 one, a row's bits independent of the rest of the call
and of the threads) holds for both builds. (Their fp32 bits differ from each other: the portable path rounds each
product and each sum, AVX-512 fuses them; each build is invariant in itself, and the services take only the
native one.) The whole forward's one-token steps against its scored rows run in
tests/unit/test_packed_linear.py (its "bf16 tiles" and "fp32 tiles" paths)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.model import mkl_product, parallel, tiles
from shared.model.compiled import plain_weight
from shared.model.parallel import linear, out_features, pack_weight

pytestmark = pytest.mark.skipif(tiles.load_kernel() is None, reason="no C++ compiler to build the kernel")

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (8192, 576)]  # the target's and the head's subset
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture
def tiled(monkeypatch):
    monkeypatch.setattr(tiles, "enabled", lambda dtype: True)
    monkeypatch.setattr(parallel, "amx_tiles", lambda: False)  # pack_weight leaves bf16 to oneDNN with AMX
    monkeypatch.setattr(mkl_product, "intel_cpu", lambda: False)  # and fp32 to MKL on Intel's CPUs


def _weights(shape, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(*shape, generator=gen) * 0.05).to(dtype)
    return weight, torch.randn(shape[0], generator=gen).to(dtype), gen


def _close(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """bf16: the exact product within one bf16 step (one rounding of an fp32 sum). fp32: within the bound of a sum
    of n terms in fp32 in any order, n * 2^-24 * the sum of the terms' magnitudes."""
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    if got.dtype == torch.bfloat16:
        step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp(min=1e-3))) - 7)
        return bool(((got.double() - want).abs() <= step).all())
    magnitude = F.linear(x.double().abs(), weight.double().abs(), None if bias is None else bias.double().abs())
    return bool(((got.double() - want).abs() <= (x.shape[-1] + 1) * 2.0**-24 * magnitude).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_product_is_the_fp32_product_rounded_once(tiled, shape, dtype):
    weight, bias, gen = _weights(shape, 0, dtype)
    packed = pack_weight(weight)
    assert tiles.is_packed(packed) and out_features(packed) == shape[0] and packed.dtype == dtype
    for rows in ((1, shape[1]), (7, shape[1]), (3, 5, shape[1])):  # 3-D: the EAGLE head's [batch, seq, hidden]
        x = torch.randn(*rows, generator=gen).to(dtype)
        for b in (None, bias):
            got = linear(x, packed, b)
            assert got.dtype == dtype and got.shape == (*rows[:-1], shape[0])
            assert _close(got, x, weight, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_a_rows_bits_do_not_depend_on_the_call_or_the_threads(tiled, shape, dtype):
    """Every row count 1-26 (the kernel's passes of up to 12 rows, one to three of them, even and uneven), 40 and
    300 rows, and one or two threads: the bits a row gets alone are those it gets among any others."""
    weight, bias, gen = _weights(shape, 1, dtype)
    packed = pack_weight(weight)
    x = torch.randn(300, shape[1], generator=gen).to(dtype)
    together = linear(x, packed, bias)
    spans = [(0, n) for n in range(1, 27)] + [(5, 45), (299, 300), (13, 14), (7, 19)]
    for start, stop in spans:
        assert torch.equal(linear(x[start:stop], packed, bias), together[start:stop]), (start, stop)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(linear(x, packed, bias), together)
    finally:
        torch.set_num_threads(threads)


def test_packing_round_trips_and_takes_only_the_shapes_it_tiles(tiled):
    for dtype, tiled_shape in ((torch.bfloat16, (6, 32, 32, 2)), (torch.float32, (6, 64, 32))):
        weight, _, _ = _weights((192, 64), 2, dtype)
        packed = pack_weight(weight)
        assert packed.shape == tiled_shape and torch.equal(tiles.unpack(packed), weight)
        assert tiles.in_features(packed) == 64
        assert torch.equal(plain_weight(torch.nn.Parameter(packed, requires_grad=False), dtype), weight)
    for odd in (torch.randn(80, 64).bfloat16(), torch.randn(64, 63).bfloat16(), torch.randn(80, 64)):
        assert not tiles.is_packed(pack_weight(odd))  # oneDNN's layout: not ours


def test_fp32_rows_on_a_bf16_tiled_weight_are_refused(tiled):
    packed = pack_weight(torch.randn(64, 64).bfloat16())
    with pytest.raises(ValueError, match="multiplies bf16 rows"):
        linear(torch.randn(2, 64), packed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_rows_on_an_fp32_copy_are_multiplied_in_fp32_and_rounded_once(tiled, monkeypatch, dtype):
    """A CPU without half kernels keeps fp32 copies of half weights (pack_weight); tiled, they take half rows."""
    monkeypatch.setattr(tiles, "enabled", lambda d: d == torch.float32)
    monkeypatch.setattr(parallel, "half_kernels", lambda d: False)
    weight, bias, gen = _weights((192, 576), 3, dtype)
    packed = pack_weight(weight)
    assert tiles.is_packed(packed) and packed.dtype == torch.float32
    x = torch.randn(5, 576, generator=gen).to(dtype)
    want = tiles.product(x.float(), packed, bias.float()).to(dtype)
    assert torch.equal(linear(x, packed, bias), want) and want.dtype == dtype


def test_tiles_are_taken_where_the_cpu_calls_for_them(monkeypatch):
    """bf16: with AVX-512 BF16 and no AMX; fp32: with AVX-512 on a CPU that is not Intel's (MKL's there)."""
    tiles.enabled.cache_clear()
    try:
        lib = tiles.load_kernel()
        bf16_native, fp32_native = bool(lib.specdec_bf16_native()), bool(lib.specdec_fp32_native())
        assert bf16_native is parallel._torch_cpu_has("_is_avx512_bf16_supported")  # -march=native: vdpbf16ps
        assert fp32_native is ("avx512f" in parallel._cpu_flags())
        bf16, fp32 = torch.randn(64, 64).bfloat16(), torch.randn(64, 64)
        monkeypatch.setattr(parallel, "amx_tiles", lambda: False)
        monkeypatch.setattr(mkl_product, "intel_cpu", lambda: False)
        assert tiles.enabled(torch.bfloat16) is bf16_native and tiles.is_packed(pack_weight(bf16)) is bf16_native
        assert tiles.enabled(torch.float32) is fp32_native and tiles.is_packed(pack_weight(fp32)) is fp32_native
        monkeypatch.setattr(parallel, "amx_tiles", lambda: True)  # oneDNN's blocks and the templates there
        monkeypatch.setattr(mkl_product, "intel_cpu", lambda: True)  # MKL's packed products there
        assert not tiles.is_packed(pack_weight(bf16)) and not tiles.is_packed(pack_weight(fp32))
        monkeypatch.setattr(parallel, "amx_tiles", lambda: False)
        monkeypatch.setattr(mkl_product, "intel_cpu", lambda: False)
        monkeypatch.setenv("SPECDEC_BF16_TILES", "0")
        monkeypatch.setenv("SPECDEC_FP32_TILES", "0")
        tiles.enabled.cache_clear()
        assert not tiles.enabled(torch.bfloat16) and not tiles.is_packed(pack_weight(bf16))
        assert not tiles.enabled(torch.float32) and not tiles.is_packed(pack_weight(fp32))
    finally:
        tiles.enabled.cache_clear()


def test_rows_or_a_bias_that_do_not_fit_the_weight_are_refused(tiled):
    """The kernel trusts the widths it is given: a mismatch must raise, as F.linear does, not read past a buffer."""
    for dtype in DTYPES:
        packed = pack_weight(torch.randn(64, 32).to(dtype))
        with pytest.raises(ValueError, match="do not fit"):
            linear(torch.randn(3, 16).to(dtype), packed)
        with pytest.raises(ValueError, match="bias of shape"):
            linear(torch.randn(3, 32).to(dtype), packed, torch.randn(8).to(dtype))
        assert linear(torch.randn(3, 32).to(dtype), packed, torch.randn(64).to(dtype)).shape == (3, 64)
