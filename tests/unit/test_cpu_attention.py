"""The cpu attention kernel (shared/model/paged_kernel.cpp through shared/model/cpu_attention.py): the torch
backend's outputs to rounding on a step that mixes a prefill chunk, decode rows, k + 1 scoring rows and a token
tree; and each query's output bit for bit the same however it is scored: alone, among k + 1 rows, inside a prefill
chunk, as a tree node (against its path as a chain), beside any other sequences. That invariance is what keeps
speculative greedy output equal to plain decoding, and prefix-cached or replayed prompts equal to fresh ones."""

from __future__ import annotations

import pytest
import torch

from shared.model import cpu_attention, native
from shared.model.attention import (
    SeqSpan,
    TorchPagedAttention,
    build_metadata,
    paged_attention,
    select_backend,
    tree_of_parents,
)

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler to build the kernel")

BLOCK = 16
KV_HEADS, GROUP = 3, 3
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 0.02}  # bf16 output: one rounding step at |x| ~ 2 is 0.0078


@pytest.fixture(scope="module")
def kernel():
    return select_backend("cpu", "cpu", BLOCK, torch.float32, 64)


def caches(num_blocks: int, dim: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK, KV_HEADS, dim)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def queries(rows: int, dim: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, KV_HEADS * GROUP, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


def mixed_step() -> list[SeqSpan]:
    """Blocks handed out non-contiguously and out of order, as the block manager does after some churn."""
    tree = tree_of_parents(37, 7, [-1, 0, 0, -1, 3, 1])  # the root token and six nodes on three branches
    return [
        SeqSpan([9, 2, 30], 37, 7, tree),
        SeqSpan([4, 11, 5, 20, 21, 22, 23, 24, 25, 26], 0, 150),  # a prefill chunk
        SeqSpan([3, 12, 13, 14], 60, 1),  # decode
        SeqSpan([6, 7, 8, 15, 16, 17], 80, 5),  # k = 4 scoring rows
        SeqSpan([1, 10, 18, 19, 27], 10, 64),  # a later prefill chunk over cached tokens
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 16])
def test_a_mixed_step_gives_what_the_torch_backend_gives_to_rounding(kernel, dtype, dim):
    spans = mixed_step()
    k_cache, v_cache = caches(32, dim, dtype)
    q = queries(sum(s.num_new for s in spans), dim, dtype)
    got = paged_attention(kernel, q, k_cache, v_cache, build_metadata(spans, BLOCK, kernel=True), dim**-0.5)
    want = paged_attention(TorchPagedAttention(), q, k_cache, v_cache, build_metadata(spans, BLOCK), dim**-0.5)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_gets_the_same_bits_alone_among_rows_in_a_prefill_chunk_and_beside_other_sequences(kernel, dtype):
    k_cache, v_cache = caches(24, 64, dtype)
    table = [5, 1, 17, 3, 9, 12, 20]
    q = queries(100, 64, dtype)

    def run(spans: list[SeqSpan], q_rows: torch.Tensor) -> torch.Tensor:
        return paged_attention(kernel, q_rows, k_cache, v_cache, build_metadata(spans, BLOCK, kernel=True), 0.125)

    prefill = run([SeqSpan(table, 0, 100)], q)  # position j of the chunk is query row j
    neighbours = [SeqSpan([2, 4, 6, 8], 50, 5), SeqSpan([7, 10, 11], 0, 40)]
    neighbour_q = queries(45, 64, dtype, seed=2)
    for position in (0, 15, 16, 57, 99):
        alone = run([SeqSpan(table, position, 1)], q[position : position + 1])
        assert torch.equal(alone[0], prefill[position]), position
        for n in (2, 5, 17):  # as the last of n scoring rows, the others before it
            if position + 1 >= n:
                rows = run([SeqSpan(table, position + 1 - n, n)], q[position + 1 - n : position + 1])
                assert torch.equal(rows[-1], alone[0]), (position, n)
        mixed = run([neighbours[0], SeqSpan(table, position, 1), neighbours[1]], torch.cat(
            [neighbour_q[:5], q[position : position + 1], neighbour_q[5:]]
        ))  # fmt: skip
        assert torch.equal(mixed[5], alone[0]), position


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tree_node_gets_the_bits_of_its_path_scored_as_a_chain(kernel, dtype):
    """Node outputs depend on the keys they see: a chain of the node's path written at consecutive slots with
    the same K and V must give the same bits."""
    parents = [-1, 0, 0, -1, 3, 1, 5]
    prefix = 37  # committed tokens; the step feeds the last of them (the root, position 36) and the nodes
    tree = tree_of_parents(prefix - 1, 1 + len(parents), parents)
    table = [9, 2, 30, 4]
    k_cache, v_cache = caches(32, 64, dtype)
    q = queries(1 + len(parents), 64, dtype)
    step = build_metadata([SeqSpan(table, prefix - 1, 8, tree)], BLOCK, kernel=True)
    nodes = paged_attention(kernel, q, k_cache, v_cache, step, 0.125)
    for node, path in enumerate(tree.visible):  # path: the slots of the node's ancestors and its own, ascending
        chain_k, chain_v = k_cache.clone(), v_cache.clone()
        flat_k, flat_v = chain_k.view(-1, KV_HEADS, 64), chain_v.view(-1, KV_HEADS, 64)
        for depth, slot in enumerate(path):  # copy the path's K/V onto consecutive positions after the prefix
            src = table[slot // BLOCK] * BLOCK + slot % BLOCK
            pos = prefix + depth
            dst = table[pos // BLOCK] * BLOCK + pos % BLOCK
            flat_k[dst], flat_v[dst] = k_cache.view(-1, KV_HEADS, 64)[src], v_cache.view(-1, KV_HEADS, 64)[src]
        chain = SeqSpan(table, prefix + len(path) - 1, 1)
        got = paged_attention(
            kernel, q[1 + node : 2 + node], chain_k, chain_v, build_metadata([chain], BLOCK, kernel=True), 0.125
        )
        assert torch.equal(got[0], nodes[1 + node]), node


def test_auto_picks_the_kernel_on_the_cpu_and_torch_where_it_cannot_run(monkeypatch):
    assert select_backend("auto", "cpu", BLOCK, torch.bfloat16, 64).name == "cpu"
    assert select_backend("auto", "cpu", BLOCK, torch.float16, 64).name == "torch"  # no half build
    assert select_backend("auto", "cpu", BLOCK, torch.float32, 24).name == "torch"  # a head size not built
    assert select_backend("torch", "cpu", BLOCK, torch.float32, 64).name == "torch"
    with pytest.raises(ValueError, match="head size in"):
        select_backend("cpu", "cpu", BLOCK, torch.float32, 24)
    monkeypatch.setattr(native, "compiler", lambda: None)
    cpu_attention.load_kernel.cache_clear()
    try:
        assert select_backend("auto", "cpu", BLOCK, torch.float32, 64).name == "torch"
        with pytest.raises(ValueError, match="needs a C\\+\\+ compiler"):
            select_backend("cpu", "cpu", BLOCK, torch.float32, 64)
    finally:
        cpu_attention.load_kernel.cache_clear()


def test_the_build_lands_in_the_kernel_cache_once_per_source(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_KERNEL_CACHE", str(tmp_path))
    cpu_attention.load_kernel.cache_clear()
    try:
        assert cpu_attention.load_kernel() is not None
        built = list(tmp_path.glob("paged_kernel-*.so"))
        assert len(built) == 1 and not [p for p in tmp_path.iterdir() if p.is_dir()]  # no build folder left
        stamp = built[0].stat().st_mtime_ns
        cpu_attention.load_kernel.cache_clear()
        assert cpu_attention.load_kernel() is not None and built[0].stat().st_mtime_ns == stamp  # reused
    finally:
        cpu_attention.load_kernel.cache_clear()


def test_metadata_built_for_another_backend_still_serves_the_kernel(kernel):
    """A caller that builds the step's metadata without kernel=True (the trainer's feature pass did) gets the
    same output: the kernel's rows are built from the metadata's spans on the first call."""
    spans = mixed_step()
    k_cache, v_cache = caches(32, 64, torch.float32)
    q = queries(sum(s.num_new for s in spans), 64, torch.float32)
    plain = build_metadata(spans, BLOCK)
    assert plain.kernel_rows is None
    got = paged_attention(kernel, q, k_cache, v_cache, plain, 0.125)
    assert torch.equal(
        got, paged_attention(kernel, q, k_cache, v_cache, build_metadata(spans, BLOCK, kernel=True), 0.125)
    )
