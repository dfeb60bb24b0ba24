"""bf16 products through our own kernel (shared/model/bf16_kernel.cpp via shared/model/bf16_tiles.py).

Forced on any CPU: without AVX-512 BF16 the kernel builds its portable path, which sums in the same order, so what
is tested here (the product within bf16 rounding of the fp32 one, a row's bits independent of the rest of the call
and of the threads) holds for both builds. The whole forward's one-token steps against its scored rows run in
tests/unit/test_packed_linear.py (the "bf16 tiles" path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.model import bf16_tiles, parallel
from shared.model.compiled import plain_weight
from shared.model.parallel import linear, out_features, pack_weight

pytestmark = pytest.mark.skipif(bf16_tiles.load_kernel() is None, reason="no C++ compiler to build the kernel")

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (8192, 576)]  # the target's and the head's subset


@pytest.fixture
def tiles(monkeypatch):
    monkeypatch.setattr(bf16_tiles, "enabled", lambda: True)
    monkeypatch.setattr(parallel, "amx_tiles", lambda: False)  # pack_weight leaves bf16 to oneDNN with AMX


def _weights(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(*shape, generator=gen) * 0.05).bfloat16()
    return weight, torch.randn(shape[0], generator=gen).bfloat16(), gen


def _within_one_bf16_step(got: torch.Tensor, want: torch.Tensor) -> bool:
    step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp(min=1e-3))) - 7)
    return bool(((got.float() - want).abs() <= step).all())


@pytest.mark.parametrize("shape", SHAPES)
def test_the_product_is_the_fp32_product_rounded_once(tiles, shape):
    weight, bias, gen = _weights(shape, 0)
    packed = pack_weight(weight)
    assert bf16_tiles.is_packed(packed) and out_features(packed) == shape[0]
    for rows in ((1, shape[1]), (7, shape[1]), (3, 5, shape[1])):  # 3-D: the EAGLE head's [batch, seq, hidden]
        x = torch.randn(*rows, generator=gen).bfloat16()
        for b in (None, bias):
            got = linear(x, packed, b)
            assert got.dtype == torch.bfloat16 and got.shape == (*rows[:-1], shape[0])
            assert _within_one_bf16_step(got, F.linear(x.float(), weight.float(), None if b is None else b.float()))


@pytest.mark.parametrize("shape", SHAPES[:4])
def test_a_rows_bits_do_not_depend_on_the_call_or_the_threads(tiles, shape):
    """Every row count 1-16 (the kernel's tiles of 6 rows, whole and partial), 40 and 300 rows, and one or two
    threads: the bits a row gets alone are those it gets among any others."""
    weight, bias, gen = _weights(shape, 1)
    packed = pack_weight(weight)
    x = torch.randn(300, shape[1], generator=gen).bfloat16()
    together = linear(x, packed, bias)
    spans = [(0, n) for n in range(1, 17)] + [(5, 45), (299, 300), (13, 14), (7, 19)]
    for start, stop in spans:
        assert torch.equal(linear(x[start:stop], packed, bias), together[start:stop]), (start, stop)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(linear(x, packed, bias), together)
    finally:
        torch.set_num_threads(threads)


def test_packing_round_trips_and_takes_only_the_shapes_it_tiles(tiles):
    weight, _, _ = _weights((192, 64), 2)
    packed = pack_weight(weight)
    assert packed.shape == (3, 32, 64, 2) and torch.equal(bf16_tiles.unpack(packed), weight)
    assert torch.equal(plain_weight(torch.nn.Parameter(packed, requires_grad=False), torch.bfloat16), weight)
    for odd in (torch.randn(96, 64).bfloat16(), torch.randn(64, 63).bfloat16(), torch.randn(64, 64)):
        assert not bf16_tiles.is_packed(pack_weight(odd))  # oneDNN's layout, or an fp32 one: not ours


def test_fp32_rows_on_a_tiled_weight_are_refused(tiles):
    packed = pack_weight(torch.randn(64, 64).bfloat16())
    with pytest.raises(ValueError, match="multiplies bf16 rows"):
        linear(torch.randn(2, 64), packed)


def test_tiles_are_taken_only_with_avx512_bf16_and_no_amx(monkeypatch):
    weight = torch.randn(64, 64).bfloat16()
    bf16_tiles.enabled.cache_clear()
    try:
        native = bool(bf16_tiles.load_kernel().specdec_bf16_native())
        assert native is parallel._torch_cpu_has("_is_avx512_bf16_supported")  # -march=native found vdpbf16ps
        monkeypatch.setattr(parallel, "amx_tiles", lambda: False)
        assert bf16_tiles.enabled() is native and bf16_tiles.is_packed(pack_weight(weight)) is native
        monkeypatch.setattr(parallel, "amx_tiles", lambda: True)  # oneDNN's blocks and the templates there
        assert not bf16_tiles.is_packed(pack_weight(weight))
        monkeypatch.setattr(parallel, "amx_tiles", lambda: False)
        monkeypatch.setenv("SPECDEC_BF16_TILES", "0")
        bf16_tiles.enabled.cache_clear()
        assert not bf16_tiles.enabled() and not bf16_tiles.is_packed(pack_weight(weight))
    finally:
        bf16_tiles.enabled.cache_clear()
