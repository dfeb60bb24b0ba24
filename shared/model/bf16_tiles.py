"""bf16 products through our own kernel (bf16_kernel.cpp) where oneDNN's are slow: an x86 CPU with AVX-512 BF16 and
no AMX (AMD EPYC, Zen 4). There oneDNN's bf16 products cost the same at one row as at eight (4 at least, for rows
that agree: parallel.MIN_PRODUCT_ROWS), and this kernel took 0.41-0.43x their time over the target's 121 products
at one row, 0.62-0.66x at eight, 0.81-0.82x at 40 and 0.93-0.96x at prefill chunks of 128-512 (2 threads,
`specdec_bench.bf16_bench`): a step at batch 1 to 8 reads each weight from memory once, at the rate the memory
gives. A row's result is the same bits whatever the call holds (see the kernel's header).

A weight packed here is a [out / 64, in / 2, 64, 2] bf16 tensor: its shape says what it is, survives a Parameter
and cannot be mistaken for a plain [out, in] weight. `SPECDEC_BF16_TILES=0` keeps oneDNN's products (an A/B)."""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from shared.model import native

SOURCE = Path(__file__).with_name("bf16_kernel.cpp")
TILE = 64  # outputs per tile (the kernel's TILE)


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """The built kernel (built on first use); None where it cannot be built."""
    lib = native.build(SOURCE, "bf16 product kernel")
    if lib is None:
        return None
    pointer, integer = ctypes.c_void_p, ctypes.c_int64
    lib.specdec_bf16_product.argtypes = [pointer] * 4 + [integer] * 3 + [ctypes.c_int]
    lib.specdec_bf16_product.restype = None
    lib.specdec_bf16_native.restype = ctypes.c_int
    return lib


@functools.cache
def enabled() -> bool:
    """Whether the kernel is built and runs on vdpbf16ps (AVX-512 BF16), and SPECDEC_BF16_TILES is not 0. Which
    CPUs take it is parallel.pack_weight's choice: not those with AMX, where oneDNN's bf16 kernels and the compiled
    graph's templates were measured and this kernel was not."""
    if os.environ.get("SPECDEC_BF16_TILES", "1") == "0":
        return False
    lib = load_kernel()
    return lib is not None and bool(lib.specdec_bf16_native())


def fits(weight: torch.Tensor) -> bool:
    """Whether a weight can be tiled: bf16, [out, in] with out a multiple of 64 and in even."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return False
    return weight.shape[0] % TILE == 0 and weight.shape[1] % 2 == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bf16 -> [out / 64, in / 2, 64, 2]: a tile's 64 outputs, pair of inputs by pair."""
    out, inputs = weight.shape
    return weight.detach().reshape(out // TILE, TILE, inputs // 2, 2).permute(0, 2, 1, 3).contiguous()


def is_packed(weight: torch.Tensor) -> bool:
    return weight.dim() == 4 and weight.dtype == torch.bfloat16 and weight.shape[2] == TILE


def unpack(packed: torch.Tensor) -> torch.Tensor:
    tiles, pairs, _, _ = packed.shape
    return packed.permute(0, 2, 1, 3).reshape(tiles * TILE, pairs * 2).contiguous()


def out_features(packed: torch.Tensor) -> int:
    return packed.shape[0] * TILE


def product(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """rows [n, in] bf16 @ the packed weight's [out, in].T (+ bias) -> [n, out] bf16."""
    if rows.dtype != torch.bfloat16:
        raise ValueError(f"a bf16-tiled weight multiplies bf16 rows, not {rows.dtype}")
    lib = load_kernel()
    assert lib is not None, "a weight was packed for the bf16 kernel, which no longer loads"
    rows = rows.contiguous()
    out = rows.new_empty(rows.shape[0], out_features(packed))
    bias = None if bias is None else bias.to(torch.bfloat16).contiguous()  # held until the call returns
    lib.specdec_bf16_product(
        rows.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
        rows.shape[0], out.shape[1], rows.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    return out
