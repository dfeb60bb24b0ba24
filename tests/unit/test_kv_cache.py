"""KVCache's copies of blocks and slots, made over every layer at once, against the same copies made layer by
layer with plain indexing (what the cache did before its layers became views of one tensor)."""

from __future__ import annotations

import random

import pytest
import torch

from shared.kv.cache import KVCache


def _random_cache(seed: int, num_layers: int = 3, num_blocks: int = 6, block_size: int = 4) -> KVCache:
    cache = KVCache(num_layers, num_blocks, block_size, num_kv_heads=2, head_dim=5)
    generator = torch.Generator().manual_seed(seed)
    for k_cache, v_cache in cache.layers:  # written through the views, as the model writes them
        k_cache.copy_(torch.randn(k_cache.shape, generator=generator))
        v_cache.copy_(torch.randn(v_cache.shape, generator=generator))
    return cache


def _layer_by_layer(cache: KVCache, pairs: list[tuple[int, int]], slots: bool) -> list[tuple[torch.Tensor, ...]]:
    expected = []
    src = torch.tensor([s for s, _ in pairs])
    dst = torch.tensor([d for _, d in pairs])
    for k_cache, v_cache in cache.layers:
        copies = []
        for tensor in (k_cache.clone(), v_cache.clone()):
            view = tensor.view(-1, *tensor.shape[2:]) if slots else tensor
            view[dst] = view[src]
            copies.append(tensor)
        expected.append(tuple(copies))
    return expected


def _disjoint_pairs(rng: random.Random, count: int, n: int) -> list[tuple[int, int]]:
    picked = rng.sample(range(count), 2 * n)
    return list(zip(picked[:n], picked[n:], strict=True))


@pytest.mark.parametrize("seed", range(20))
def test_slot_copies_equal_the_layer_by_layer_copies(seed: int) -> None:
    cache = _random_cache(seed)
    rng = random.Random(seed)
    slots = cache.num_blocks * cache.block_size
    # A tree's path moved down: ascending, a destination never a later source (Engine._move_path).
    pairs = sorted(_disjoint_pairs(rng, slots, rng.randint(1, 5)), key=lambda p: p[1])
    if seed % 2:  # a chain of moves: a source that an earlier pair wrote is read before that write
        pairs = [(5, 3), (7, 5), (9, 7)]
    expected = _layer_by_layer(cache, pairs, slots=True)
    cache.copy_slots(pairs)
    for (k_cache, v_cache), (k_expected, v_expected) in zip(cache.layers, expected, strict=True):
        assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


@pytest.mark.parametrize("seed", range(10))
def test_block_copies_equal_the_layer_by_layer_copies(seed: int) -> None:
    cache = _random_cache(seed)
    rng = random.Random(seed)
    pairs = _disjoint_pairs(rng, cache.num_blocks, rng.randint(1, 3))
    expected = _layer_by_layer(cache, pairs, slots=False)
    cache.copy_blocks(pairs)
    for (k_cache, v_cache), (k_expected, v_expected) in zip(cache.layers, expected, strict=True):
        assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


def test_a_copy_moves_every_layer_and_nothing_else() -> None:
    """A negative control for the comparisons above: the copy changes the destination slot in every layer, keys
    and values alike, and leaves every other slot as it was."""
    cache = _random_cache(0)
    before = [(k.clone(), v.clone()) for k, v in cache.layers]
    src, dst = (1, 2), (3, 1)  # block 1 offset 2 -> block 3 offset 1
    cache.copy_slots([(src[0] * cache.block_size + src[1], dst[0] * cache.block_size + dst[1])])
    for (k_cache, v_cache), (k_before, v_before) in zip(cache.layers, before, strict=True):
        for now, old in ((k_cache, k_before), (v_cache, v_before)):
            assert torch.equal(now[dst], old[src]) and not torch.equal(now[dst], old[dst])
            now[dst] = old[dst]
            assert torch.equal(now, old)


def test_the_layers_are_contiguous_views_of_one_tensor() -> None:
    cache = _random_cache(1)
    for i, (k_cache, v_cache) in enumerate(cache.layers):
        assert k_cache.is_contiguous() and v_cache.is_contiguous()  # what the attention kernels assert
        assert k_cache.data_ptr() == cache.storage[i, 0].data_ptr()
        assert v_cache.data_ptr() == cache.storage[i, 1].data_ptr()
