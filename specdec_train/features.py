"""The target's features of stored conversations, recomputed by prefill at training time.

Data shards hold tokens only (specdec_train/data.py). Each training step prefills its conversations through
the target (our paged Llama forward, a private KV cache, no gradient) and reads the hidden states of the
layers the head needs plus the final normed state, whose LM-head output is the teacher distribution. A
prefill token costs ~1/5 of the decoding step that generated it, no disk holds 2M x hidden x layers, and
the layers stay a training-time choice.
"""

from __future__ import annotations

import torch

from shared.kv.cache import KVCache
from shared.model.attention import SeqSpan, build_metadata
from shared.model.llama import LlamaModel

BLOCK_SIZE = 16


class TargetFeatures:
    def __init__(self, model: LlamaModel, layers: tuple[int, ...], max_tokens: int = 4096) -> None:
        arch = model.arch
        self.model, self.layers, self.max_tokens = model, tuple(layers), max_tokens
        dtype = model.embed_tokens.weight.dtype
        num_blocks = max_tokens // BLOCK_SIZE + 64  # + rounding up of each row's last block
        self.cache = KVCache(arch.num_layers, num_blocks, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim, dtype)

    def __call__(self, rows: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Token rows [n_i] -> per row (final normed hidden [n_i, hidden], layers [n_i, len(layers) * hidden]),
        fp32, each row read from its own start (the features of a whole conversation)."""
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        group: list[torch.Tensor] = []
        for row in rows:
            if group and sum(len(r) for r in group) + len(row) > self.max_tokens:
                out += self._forward(group)
                group = []
            group.append(row)
        return out + (self._forward(group) if group else [])

    def _forward(self, rows: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        spans, next_block = [], 0
        for row in rows:
            blocks = -(-len(row) // BLOCK_SIZE)
            if next_block + blocks > self.cache.num_blocks:
                raise ValueError(f"a row of {len(row)} tokens does not fit a feature cache of {self.max_tokens}")
            spans.append(SeqSpan(list(range(next_block, next_block + blocks)), 0, len(row)))
            next_block += blocks
        meta = build_metadata(spans, BLOCK_SIZE)
        input_ids = torch.cat([r.long() for r in rows])
        final, captured = self.model.forward_with_layers(input_ids, self.cache.layers, meta, self.layers)
        assert captured is not None
        # Clones outside inference mode: inference tensors cannot be saved for the head's backward pass.
        final, captured = final.clone(), captured.clone()
        sizes = [len(r) for r in rows]
        return list(zip(final.split(sizes), captured.split(sizes), strict=True))


class CachedFeatures:
    """Keeps the features of each conversation it computed, up to `max_bytes`: a data set that fits (e.g. a few
    hundred thousand positions, some GB) pays the target's prefill once, in its first epoch, instead of every
    epoch. The stored values are those computed (fp32): a cache hit returns exactly what a recompute would."""

    def __init__(self, inner: TargetFeatures, max_bytes: int) -> None:
        self.inner, self.max_bytes, self.used_bytes = inner, max_bytes, 0
        self.store: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}

    def row_bytes(self, num_tokens: int) -> int:
        return num_tokens * (1 + len(self.inner.layers)) * self.inner.model.arch.hidden_size * 4

    def holds_all(self, lengths: list[int]) -> bool:
        """Whether conversations of these lengths all fit: then only the first epoch prefills."""
        return self.row_bytes(sum(lengths)) <= self.max_bytes

    def __call__(self, rows: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        keys = [row.numpy().tobytes() for row in rows]
        missing = [i for i, key in enumerate(keys) if key not in self.store]
        computed = dict(zip(missing, self.inner([rows[i] for i in missing]), strict=True)) if missing else {}
        for i, feats in computed.items():
            size = self.row_bytes(len(rows[i]))
            if self.used_bytes + size <= self.max_bytes:
                # Clones: a view would keep its whole group's tensor alive, rows not kept included.
                self.store[keys[i]] = (feats[0].clone(), feats[1].clone())
                self.used_bytes += size
        return [computed[i] if i in computed else self.store[key] for i, key in enumerate(keys)]
