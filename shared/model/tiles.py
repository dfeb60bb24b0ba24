"""Products through our own kernel (tile_kernel.cpp) where the libraries' are slow for a decoding step's few rows.

bf16 on an x86 CPU with AVX-512 BF16 and no AMX (AMD EPYC, Zen 4): there oneDNN's bf16 products cost the same at
one row as at eight (4 at least, for rows that agree: parallel.MIN_PRODUCT_ROWS), and this kernel took 0.62x their
time over the target's 121 products at one row, 0.61x at eight, 0.85x at 40 and 0.92-1.02x at prefill chunks of
128-512 (2 threads, `specdec_bench.tiles_bench --dtype bfloat16`).

fp32 on an x86 CPU with AVX-512 that is not Intel's (MKL's packed products serve Intel's, mkl_product.py): on Zen 4
0.64x oneDNN's time at one and at eight rows, 0.85x at 40, 0.99-1.02x at 128-512 (`--dtype float32`), and the
fp32 target decoded at 1.48x / 1.03x vLLM's CPU build at batch 1 / 8 (eager) where it had at 0.86x / 0.80x.

Either way a step at batch 1 to 8 reads each weight from memory once, at the rate the memory gives, and a row's
result is the same bits whatever the call holds (see the kernel's header).

A weight tiled here is a bf16 [out / 32, in / 2, 32, 2] or an fp32 [out / 32, in, 32] tensor: its shape says what
it is, survives a Parameter and cannot be mistaken for a plain [out, in] weight. `SPECDEC_BF16_TILES=0` and
`SPECDEC_FP32_TILES=0` keep oneDNN's products (an A/B)."""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from shared.model import native

SOURCE = Path(__file__).with_name("tile_kernel.cpp")
TILE = 32  # outputs per tile (the kernel's TILE)
DTYPES = (torch.bfloat16, torch.float32)
SWITCHES = {torch.bfloat16: "SPECDEC_BF16_TILES", torch.float32: "SPECDEC_FP32_TILES"}


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """The built kernel (built on first use); None where it cannot be built."""
    multiply = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int], None)
    native_build: native.Signature = ((), ctypes.c_int)
    return native.build(
        SOURCE,
        "product kernel",
        {
            "specdec_bf16_product": multiply,
            "specdec_fp32_product": multiply,
            "specdec_bf16_native": native_build,
            "specdec_fp32_native": native_build,
        },
    )


def native_instructions(dtype: torch.dtype) -> bool:
    """Whether the built kernel multiplies `dtype` on the CPU's own instructions (bf16: vdpbf16ps; fp32: AVX-512)
    rather than its portable path."""
    lib = load_kernel()
    if lib is None:
        return False
    return bool(lib.specdec_bf16_native() if dtype == torch.bfloat16 else lib.specdec_fp32_native())


@functools.cache
def enabled(dtype: torch.dtype) -> bool:
    """Whether the kernel is built and runs on the CPU's own instructions for `dtype`, and its switch is not 0.
    Which CPUs take it is parallel.pack_weight's choice: not those with AMX for bf16, where oneDNN's bf16 kernels
    and the compiled graph's templates were measured and this kernel was not; not Intel's for fp32 (MKL's)."""
    if os.environ.get(SWITCHES[dtype], "1") == "0":
        return False
    return native_instructions(dtype)


def fits(weight: torch.Tensor) -> bool:
    """Whether a weight can be tiled: bf16 or fp32, [out, in] with out a multiple of 32 (and in even for bf16)."""
    if weight.dtype not in DTYPES or weight.dim() != 2 or weight.shape[0] % TILE:
        return False
    return weight.dtype == torch.float32 or weight.shape[1] % 2 == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bf16 -> [out / 32, in / 2, 32, 2]: a tile's 32 outputs, pair of inputs by pair; [out, in] fp32 ->
    [out / 32, in, 32]: input by input."""
    out, inputs = weight.shape
    if weight.dtype == torch.float32:
        return weight.detach().reshape(out // TILE, TILE, inputs).permute(0, 2, 1).contiguous()
    return weight.detach().reshape(out // TILE, TILE, inputs // 2, 2).permute(0, 2, 1, 3).contiguous()


def is_packed(weight: torch.Tensor) -> bool:
    if weight.dtype == torch.bfloat16:
        return weight.dim() == 4 and weight.shape[2] == TILE and weight.shape[3] == 2
    return weight.dtype == torch.float32 and weight.dim() == 3 and weight.shape[2] == TILE


def unpack(packed: torch.Tensor) -> torch.Tensor:
    if packed.dtype == torch.float32:
        return packed.permute(0, 2, 1).reshape(out_features(packed), in_features(packed)).contiguous()
    return packed.permute(0, 2, 1, 3).reshape(out_features(packed), in_features(packed)).contiguous()


def out_features(packed: torch.Tensor) -> int:
    return packed.shape[0] * TILE


def in_features(packed: torch.Tensor) -> int:
    return packed.shape[1] * (2 if packed.dtype == torch.bfloat16 else 1)


def product(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """rows [n, in] @ the packed weight's [out, in].T (+ bias) -> [n, out] in the rows' dtype. A bf16 weight takes
    bf16 rows. An fp32 weight (or an fp32 copy of a half one: a CPU without half kernels) also takes half rows,
    multiplied in fp32 and rounded once, as parallel.linear does with oneDNN's fp32 copies."""
    bf16, inputs, outputs = packed.dtype == torch.bfloat16, in_features(packed), out_features(packed)
    if bf16 and rows.dtype != torch.bfloat16:
        raise ValueError(f"a bf16-tiled weight multiplies bf16 rows, not {rows.dtype}")
    if rows.dim() != 2 or rows.shape[1] != inputs:  # the kernel would read past the rows
        raise ValueError(f"rows {tuple(rows.shape)} do not fit a tiled weight of {inputs} inputs")
    if bias is not None and bias.shape != (outputs,):
        raise ValueError(f"a bias of shape {tuple(bias.shape)} for a tiled weight of {outputs} outputs")
    if not bf16 and rows.dtype != torch.float32:
        return product(rows.float(), packed, None if bias is None else bias.float()).to(rows.dtype)
    lib = load_kernel()
    assert lib is not None, "a weight was tiled for the product kernel, which no longer loads"
    rows = rows.contiguous()
    out = rows.new_empty(rows.shape[0], outputs)
    bias = None if bias is None else bias.to(packed.dtype).contiguous()  # held until the call returns
    kernel = lib.specdec_bf16_product if bf16 else lib.specdec_fp32_product
    kernel(
        rows.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
        rows.shape[0], outputs, inputs, torch.get_num_threads(),
    )  # fmt: skip
    return out
