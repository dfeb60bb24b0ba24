"""The rotary embedding and K/V cache writes through small_ops_kernel.cpp: the bits of rope.apply_rotation and
attention.write_kv, and torch's ops wherever the kernel must not run."""

from __future__ import annotations

import pytest
import torch

from shared.model import small_ops
from shared.model.attention import write_kv
from shared.model.rope import apply_rotation, rotation_tables

pytestmark = pytest.mark.skipif(small_ops.load_kernel() is None, reason="no C++ compiler: rotary runs as torch ops")

HEADS, KV_HEADS, DIM, BLOCKS, BLOCK = 9, 3, 64, 12, 4


def layer_inputs(dtype: torch.dtype, tokens: int, rot: int, seed: int = 0):
    """A q/k/v product's rows as the layer slices them (a view of a wider tensor: rows with a stride), rotation
    tables, two caches and distinct slots."""
    generator = torch.Generator().manual_seed(seed)
    wide = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM + 7, generator=generator).to(dtype)
    qkv = wide[:, 3 : 3 + (HEADS + 2 * KV_HEADS) * DIM]
    angles = torch.rand(tokens, rot // 2, generator=generator) * 50
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    tables = rotation_tables(cos.to(dtype), sin.to(dtype))
    caches = [torch.randn(BLOCKS, BLOCK, KV_HEADS, DIM, generator=generator).to(dtype) for _ in range(2)]
    slots = torch.randperm(BLOCKS * BLOCK, generator=generator)[:tokens]
    return qkv, tables, caches, slots


def torch_ops(qkv, tables, caches, slots):
    """What llama.Attention runs without the kernel: rotate queries and keys, write keys and values."""
    k_cache, v_cache = (c.clone() for c in caches)
    qk, v = qkv.split([(HEADS + KV_HEADS) * DIM, KV_HEADS * DIM], dim=-1)
    qk = apply_rotation(qk.reshape(-1, HEADS + KV_HEADS, DIM), *tables)
    meta = type("Meta", (), {"slot_mapping": slots})()
    write_kv(k_cache, v_cache, qk[:, HEADS:], v.reshape(-1, KV_HEADS, DIM), meta)
    return qk[:, :HEADS], k_cache, v_cache


@pytest.mark.parametrize("rot", [DIM, DIM // 2], ids=["full rotary", "partial rotary"])
@pytest.mark.parametrize("tokens", [1, 8, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_gives_the_ops_bits(dtype, tokens, rot):
    qkv, tables, caches, slots = layer_inputs(dtype, tokens, rot)
    q_ops, k_ops, v_ops = torch_ops(qkv, tables, caches, slots)
    k_cache, v_cache = (c.clone() for c in caches)
    assert small_ops.takes_rotation(qkv, tables[0], k_cache, v_cache)
    q = small_ops.rotate_and_store(qkv, *tables, HEADS, k_cache, v_cache, slots)
    assert torch.equal(q, q_ops) and torch.equal(k_cache, k_ops) and torch.equal(v_cache, v_ops)


def test_rows_are_independent_and_threads_move_nothing():
    qkv, tables, caches, slots = layer_inputs(torch.float32, 24, DIM, seed=1)
    k_all, v_all = (c.clone() for c in caches)
    q_all = small_ops.rotate_and_store(qkv, *tables, HEADS, k_all, v_all, slots)
    k_one, v_one = (c.clone() for c in caches)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        rows = [
            small_ops.rotate_and_store(
                qkv[t : t + 1], tables[0][t : t + 1], tables[1][t : t + 1], HEADS, k_one, v_one, slots[t : t + 1]
            )  # fmt: skip
            for t in range(24)
        ]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.cat(rows), q_all) and torch.equal(k_one, k_all) and torch.equal(v_one, v_all)


def test_a_slot_outside_the_cache_is_refused_and_nothing_is_written():
    qkv, tables, caches, slots = layer_inputs(torch.float32, 4, DIM)
    k_cache, v_cache = (c.clone() for c in caches)
    for bad in (BLOCKS * BLOCK, -1):
        wrong = slots.clone()
        wrong[2] = bad
        with pytest.raises(IndexError, match="outside the cache"):
            small_ops.rotate_and_store(qkv, *tables, HEADS, k_cache, v_cache, wrong)
        assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])
    with pytest.raises(ValueError, match="do not fit"):
        small_ops.rotate_and_store(qkv, *tables, HEADS + 1, k_cache, v_cache, slots)


def test_where_the_kernel_must_not_run(monkeypatch):
    qkv, tables, (k_cache, v_cache), _ = layer_inputs(torch.float32, 4, DIM)
    assert not small_ops.takes_rotation(qkv.double(), tables[0], k_cache, v_cache)  # another dtype
    assert not small_ops.takes_rotation(qkv, tables[0].bfloat16(), k_cache, v_cache)  # tables of another dtype
    assert not small_ops.takes_rotation(qkv.t(), tables[0], k_cache, v_cache)  # rows without unit stride
    assert not small_ops.takes_rotation(qkv.clone().requires_grad_(), tables[0], k_cache, v_cache)  # autograd
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # traced: the graph fuses the ops itself
    assert not small_ops.takes_rotation(qkv, tables[0], k_cache, v_cache)
    monkeypatch.undo()
    monkeypatch.setenv(small_ops.ROPE_SWITCH, "0")
    small_ops.enabled.cache_clear()
    try:
        assert not small_ops.takes_rotation(qkv, tables[0], k_cache, v_cache)
    finally:
        monkeypatch.delenv(small_ops.ROPE_SWITCH)
        small_ops.enabled.cache_clear()
    assert small_ops.takes_rotation(qkv, tables[0], k_cache, v_cache)
