"""The KV cache tensors: one key and one value tensor per layer, addressed as [block, offset]."""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Apply copy-on-write pairs (src, dst) from the block manager before the step writes."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64)
        for k_cache, v_cache in self.layers:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copy single token slots (src, dst), as block * block_size + offset, in every layer, in the order given
        (a token tree's accepted path moved onto its sequence's consecutive slots)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64)
        for k_cache, v_cache in self.layers:
            for cache in (k_cache, v_cache):
                flat = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, kv_heads, D]
                flat[dst] = flat[src]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
