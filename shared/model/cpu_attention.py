"""The `cpu` attention backend: paged_kernel.cpp, built once per machine with the system's C++ compiler and called
through ctypes. It reads K and V in place through the block tables and computes every query from its own keys
alone (see the kernel's header), so one call serves a whole step: prefill chunks, decode rows, k + 1 scoring rows
and token-tree nodes, with no padding, no gathered copy of the context and no split into calls.

Built by shared/model/native.py (`-march=native`, cached per source, compiler and CPU). Without a compiler, or
when the build fails, `auto` keeps the torch backend."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from shared.model import native

SOURCE = Path(__file__).with_name("paged_kernel.cpp")
DTYPES = {torch.float32: "specdec_paged_attention_f32", torch.bfloat16: "specdec_paged_attention_bf16"}
HEAD_SIZES = (16, 32, 64, 96, 128, 256)  # the kernel's builds (each a template instance: compile time)


@functools.cache
def load_kernel(source: Path = SOURCE) -> ctypes.CDLL | None:
    """The built kernel, building it on first use; None (logged) where it cannot be built or loaded. `source`:
    another version of paged_kernel.cpp, for specdec_bench.kernel_bench's A/B of two builds."""
    attention = ([ctypes.c_void_p] * 10 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int], None)
    return native.build(source, "cpu attention kernel", {name: attention for name in DTYPES.values()})


def supports(dtype: torch.dtype | None, head_dim: int | None) -> bool:
    return dtype in DTYPES and head_dim in HEAD_SIZES


class CpuPagedAttention:
    """The whole step's attention in one kernel call (paged_attention does not split it into groups)."""

    name = "cpu"
    whole_step = True

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._functions = {dtype: getattr(lib, name) for dtype, name in DTYPES.items()}

    def __call__(self, q, k_cache, v_cache, meta: Any, scale: float) -> torch.Tensor:
        # meta: an attention.AttentionMetadata (not imported: attention imports this module, not the reverse)
        rows = meta.rows_for_kernel()  # built with the metadata where build_metadata(kernel=True)
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        q = q.contiguous()  # [T, H, D]
        out = torch.empty_like(q)
        _, block_size, kv_heads, head_dim = k_cache.shape
        self._functions[q.dtype](
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
            rows.block_tables.data_ptr(), rows.block_tables.shape[1], rows.seq_start.data_ptr(),
            rows.row_keys.data_ptr(), rows.extra_start.data_ptr(), rows.extra_keys.data_ptr(),
            rows.num_seqs, q.shape[1], kv_heads, head_dim, block_size, scale, torch.get_num_threads(),
        )  # fmt: skip
        return out
