"""The eager forward's small ops through our own kernel (small_ops_kernel.cpp): RMSNorm in one call where torch
runs six ops (eight in bf16), with the residual add before it where the model has one; a layer's rotary with its K/V
cache writes in one call where it runs seven; the MLP's SiLU(gate) * up in one call where it runs three.

On an AMD EPYC (Zen 4, 2 threads) the target's 61 norms cost 1.3-2 ms of a 31 ms fp32 forward at batch 8 as torch's
ops (measured by dropping them), the rotary and writes 0.8 ms (torch profiler). The norm computes each row alone, in
a fixed order: a row's bits do not depend on the rows beside it, as the products' (tiles.py) do not. The rotary
does apply_rotation's arithmetic element by element and copies: the ops' bits. `SPECDEC_NORM_KERNEL=0` and
`SPECDEC_ROPE_KERNEL=0` keep torch's ops (A/Bs); so do a compiled graph (it fuses them itself), autograd (the head's
trainer) and tensors the kernel does not take (not on the CPU, other dtypes, other layouts). The SiLU runs Cephes'
exp where torch runs SLEEF's: a few fp32 units from torch's values; `SPECDEC_SILU_KERNEL=0` keeps torch's."""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from shared.model import native

SOURCE = Path(__file__).with_name("small_ops_kernel.cpp")
NORM_SWITCH, ROPE_SWITCH, SILU_SWITCH = "SPECDEC_NORM_KERNEL", "SPECDEC_ROPE_KERNEL", "SPECDEC_SILU_KERNEL"


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """The built kernel (built on first use); None where it cannot be built."""
    pointer, integer = ctypes.c_void_p, ctypes.c_int64
    norm = ([pointer] * 3 + [integer] * 2 + [ctypes.c_float, ctypes.c_int], None)
    add_norm = ([pointer] * 5 + [integer] * 2 + [ctypes.c_float, ctypes.c_int], None)
    silu = ([pointer, integer, pointer, integer, integer, ctypes.c_int], None)
    rotate = (
        [pointer, integer, pointer, pointer, integer] + [pointer] * 4 + [integer] * 5 + [ctypes.c_int],
        ctypes.c_int,
    )
    return native.build(
        SOURCE,
        "small-ops kernel",
        {
            "specdec_fp32_rms_norm": norm,
            "specdec_bf16_rms_norm": norm,
            "specdec_fp32_add_rms_norm": add_norm,
            "specdec_bf16_add_rms_norm": add_norm,
            "specdec_fp32_silu_mul": silu,
            "specdec_bf16_silu_mul": silu,
            "specdec_fp32_rotate_and_store": rotate,
            "specdec_bf16_rotate_and_store": rotate,
        },
    )


@functools.cache
def enabled(switch: str) -> bool:
    """The kernel is built and the op's switch is not 0."""
    return os.environ.get(switch, "1") != "0" and load_kernel() is not None


def _eager_cpu(x: torch.Tensor, *same_dtype: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and all(t.dtype == x.dtype for t in same_dtype)
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *same_dtype)))
        and not torch.compiler.is_compiling()
    )


# ---- RMSNorm ----


def takes_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel normalises these rows: CPU, fp32 or bf16 rows with a weight of their dtype and width, no
    gradient wanted, not being traced by torch.compile."""
    return weight.shape == x.shape[-1:] and _eager_cpu(x, weight) and enabled(NORM_SWITCH)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2, -1) + eps)), rounded where RMSNorm's torch ops round; `takes_norm` must hold."""
    lib = load_kernel()
    assert lib is not None
    x = x.contiguous()
    weight = weight.contiguous()
    out = torch.empty_like(x)
    width = x.shape[-1]
    kernel = lib.specdec_fp32_rms_norm if x.dtype == torch.float32 else lib.specdec_bf16_rms_norm
    kernel(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // width, width, eps, torch.get_num_threads())
    return out


def takes_add_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel adds delta to these rows and normalises the sum: `takes_norm` holds, delta alike."""
    return delta.shape == x.shape and takes_norm(x, weight) and _eager_cpu(delta, x)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): the sum rounded as torch's add rounds it, then normalised as `rms_norm`
    does; `takes_add_norm` must hold."""
    lib = load_kernel()
    assert lib is not None
    if delta.shape != x.shape or delta.dtype != x.dtype:
        raise ValueError(f"cannot add rows {tuple(delta.shape)} {delta.dtype} to {tuple(x.shape)} {x.dtype}")
    x, delta, weight = x.contiguous(), delta.contiguous(), weight.contiguous()
    total, out = torch.empty_like(x), torch.empty_like(x)
    width = x.shape[-1]
    kernel = lib.specdec_fp32_add_rms_norm if x.dtype == torch.float32 else lib.specdec_bf16_add_rms_norm
    kernel(
        x.data_ptr(), delta.data_ptr(), weight.data_ptr(), total.data_ptr(), out.data_ptr(), x.numel() // width,
        width, eps, torch.get_num_threads(),
    )  # fmt: skip
    return total, out


# ---- SiLU(gate) * up ----


def takes_silu(gate_up: torch.Tensor) -> bool:
    """Whether the kernel runs the MLP's activation on these rows: CPU, fp32 or bf16 rows with unit stride, no
    gradient wanted, not traced by torch.compile."""
    return gate_up.dim() == 2 and gate_up.stride(1) == 1 and _eager_cpu(gate_up) and enabled(SILU_SWITCH)


def silu_mul(gate_up: torch.Tensor, width: int) -> torch.Tensor:  # [T, 2 width] -> [T, width]
    """F.silu(gate) * up of each row's halves [gate | up], rounded where the two ops round; `takes_silu` must
    hold."""
    lib = load_kernel()
    assert lib is not None
    if gate_up.shape[1] != 2 * width:
        raise ValueError(f"gate/up rows of {gate_up.shape[1]} values are not two halves of {width}")
    out = gate_up.new_empty(gate_up.shape[0], width)
    kernel = lib.specdec_fp32_silu_mul if gate_up.dtype == torch.float32 else lib.specdec_bf16_silu_mul
    kernel(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), gate_up.shape[0], width, torch.get_num_threads())
    return out


# ---- rotary and the K/V cache writes ----


def takes_rotation(qkv: torch.Tensor, cos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel runs this layer's rotary and cache writes: CPU, fp32 or bf16 throughout, rows of the q/k/v
    product with unit stride, caches in one piece, no gradient wanted, not traced by torch.compile."""
    return (
        qkv.dim() == 2
        and qkv.stride(1) == 1
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and _eager_cpu(qkv, cos, k_cache, v_cache)
        and enabled(ROPE_SWITCH)
    )


def rotate_and_store(
    qkv: torch.Tensor,  # [T, (heads + 2 kv_heads) * head_dim]: queries, keys, values
    cos: torch.Tensor,  # [T, 1, rot_dim] (rope.rotation_tables)
    signed_sin: torch.Tensor,  # [T, 1, rot_dim]
    heads: int,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [T] int64
) -> torch.Tensor:
    """The rotated queries [T, heads, head_dim]; the rotated keys and the values written to their slots, as
    rope.apply_rotation then attention.write_kv would. `takes_rotation` must hold."""
    lib = load_kernel()
    assert lib is not None
    kv_heads, head_dim = k_cache.shape[-2:]
    tokens = qkv.shape[0]
    rot = cos.shape[-1]
    if qkv.shape[1] != (heads + 2 * kv_heads) * head_dim or slots.shape != (tokens,):
        raise ValueError(f"q/k/v rows {tuple(qkv.shape)} do not fit {heads} + 2 x {kv_heads} heads of {head_dim}")
    if cos.shape != (tokens, 1, rot) or signed_sin.shape != cos.shape or rot % 2 or rot > head_dim:
        raise ValueError(f"rotation tables {tuple(cos.shape)} for {tokens} tokens of {head_dim} values a head")
    cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
    slots = slots.to(torch.int64).contiguous()
    q = qkv.new_empty(tokens, heads, head_dim)
    kernel = lib.specdec_fp32_rotate_and_store if qkv.dtype == torch.float32 else lib.specdec_bf16_rotate_and_store
    status = kernel(
        qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), signed_sin.data_ptr(), rot, q.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), k_cache.numel() // (kv_heads * head_dim), tokens,
        heads, kv_heads, head_dim, torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise IndexError(f"a cache slot among {slots.tolist()} is outside the cache of {k_cache.shape[0]} blocks")
    return q
