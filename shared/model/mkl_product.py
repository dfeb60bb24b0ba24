"""fp32 weight products through MKL's packed sgemm, on Intel CPUs (`parallel.pack_weight` and `linear` use it).

Why: a oneDNN product call (`mkldnn._linear_pointwise` on a packed weight) costs ~35 us before any arithmetic (a
16 x 16 weight, 1 or 2 threads), MKL's packed product ~7 us; over the default target's 120 layer weights, each read
from memory as in a step, MKL's took 0.60-0.67x oneDNN's time at 1-2 rows, 0.77-0.90x at 4-16, 0.77-0.85x at 17-64
and 0.88x at 264 (Xeon with AMX, 2 threads; ad-hoc script, docs/BENCHMARKS.md "MKL's packed products").

Exactness: torch's `mkl._mkl_linear` multiplies through the packed weight only when the rows number the packing's
row hint, else it falls back to a plain product of the original weight (whose kernel and summation order change
with the row count). Here every call passes its own row count as the hint, so every product goes through the one
packed buffer: packed for 256 rows, MKL's buffer served every count from 1 to 300 rows with each row's result
equal, bit for bit, to that row alone and at any place among the others (the target's shapes; a buffer packed
for one row did not: its lone row took another kernel). That is what lets a speculative step's k + 1 scored rows
give the logits a one-token step gives. It is MKL's behaviour, not its documented contract, so each weight shape is
checked once when first packed (`_rows_agree`), and a shape that fails stays with oneDNN.

The packed tensor is opaque and does not know its shape; the op reads the output width from an "origin" weight,
here an fp32 scalar expanded to [out, in], which holds no memory. The packed tensor carries it as `mkl_origin`.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from shared.model.cpuinfo import cpuinfo_field

log = logging.getLogger("specdec.model")

PACK_ROWS = 256  # MKL's row hint when packing: 1-16 rows as fast as with a hint of 16, 40-264 rows 10-25% faster
ORIGIN = "mkl_origin"  # the attribute of a packed weight that holds its [out, in] origin view
_CHECK_COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64)  # row counts a shape is checked at, each against 64 rows


@functools.cache
def available() -> bool:
    """MKL's packed products where torch has them, on Intel CPUs only: measured there; on AMD CPUs MKL's kernels
    are not Intel's own and its packed rows disagreed with each other (Zen 4), so pack_weight gives fp32 weights to
    our own kernel there (tiles.py) or oneDNN. `SPECDEC_MKL_PRODUCTS=0` keeps oneDNN's on Intel CPUs (an A/B, or a
    CPU where MKL misbehaves)."""
    return (
        os.environ.get("SPECDEC_MKL_PRODUCTS", "1") != "0"
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
        and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
        and intel_cpu()
    )


def intel_cpu() -> bool:
    return _vendor() == "GenuineIntel"


def _vendor() -> str:
    return cpuinfo_field("vendor_id")


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """An fp32 `weight` [out, in] packed for MKL, carrying its origin view; None where this shape's rows would
    not agree (then the caller packs it for oneDNN)."""
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PACK_ROWS)
    origin = weight.new_zeros(()).expand(weight.shape)
    if not _rows_agree(packed, origin, weight):
        return None
    setattr(packed, ORIGIN, origin)
    return packed


def carry_origin(packed: torch.Tensor, into: torch.nn.Parameter) -> torch.nn.Parameter:
    """`into` (a Parameter made of `packed`) with the packed weight's origin view: a new tensor object does not
    keep a Python attribute."""
    origin = getattr(packed, ORIGIN, None)
    if origin is not None:
        setattr(into, ORIGIN, origin)
    return into


def product(rows: torch.Tensor, weight: torch.Tensor, origin: torch.Tensor, bias: torch.Tensor | None):
    """rows [n, in] (contiguous) @ weight.T (+ bias) -> [n, out]; half-precision rows multiplied in fp32 and the
    result rounded once to their dtype."""
    if rows.dtype != torch.float32:
        fp32_bias = None if bias is None else bias.float()
        return product(rows.float(), weight, origin, fp32_bias).to(rows.dtype)
    return torch.ops.mkl._mkl_linear(rows, weight, origin, bias, rows.shape[0])


_checked: dict[tuple[int, ...], bool] = {}


def _rows_agree(packed: torch.Tensor, origin: torch.Tensor, weight: torch.Tensor) -> bool:
    """Once per shape: every row count of _CHECK_COUNTS gives its rows' results of a 64-row product bit for bit, and
    the products are right (against torch's own product of the plain weight)."""
    shape = tuple(weight.shape)
    if shape not in _checked:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(64, shape[1], generator=gen)
        with torch.inference_mode():
            together = product(x, packed, origin, None)
            same = all(torch.equal(product(x[:n], packed, origin, None), together[:n]) for n in _CHECK_COUNTS)
            same = same and torch.equal(product(x[9:10], packed, origin, None), together[9:10])
            right = torch.allclose(together, x @ weight.T, rtol=1e-4, atol=1e-4 * float(weight.abs().max()) + 1e-6)
        _checked[shape] = same and right
        if not _checked[shape]:
            log.warning("MKL's packed products of %s weights depend on the row count here: oneDNN's instead", shape)
    return _checked[shape]
