"""The target's features of stored conversations, recomputed by prefill at training time.

Data shards hold tokens only (specdec_train/data.py). Each training step prefills its conversations through
the target (our paged Llama forward, a private KV cache, no gradient) and reads the hidden states of the
layers the head needs plus the final normed state, whose LM-head output is the teacher distribution. A
prefill token costs ~1/5 of the decoding step that generated it, the layers stay a training-time choice, and
nothing is stored unless asked: `FeatureStore` keeps each conversation's features on disk for a run trained
over several sittings (each one would otherwise prefill again what the last one did), `CachedFeatures` keeps
them in memory for data small enough to go round several times in one sitting.

Features are rounded to fp16, as the verifier sends them to an EAGLE proposer (shared/feature_codec.py): the
head trains on the values it will read when serving, and a stored copy is exactly what a recompute gives.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from shared.kv.cache import KVCache
from shared.model.attention import SeqSpan, build_metadata, uses_kernel
from shared.model.llama import LlamaModel

BLOCK_SIZE = 16
WIRE_DTYPE = torch.float16  # the features' dtype on the wire (the proposer asks for fp16 at handshake)

Features = tuple[torch.Tensor, torch.Tensor]  # (final normed [n, hidden], layers [n, len(layers) * hidden]) fp32


class TargetFeatures:
    def __init__(self, model: LlamaModel, layers: tuple[int, ...], max_tokens: int = 4096) -> None:
        arch = model.arch
        self.model, self.layers, self.max_tokens = model, tuple(layers), max_tokens
        dtype = model.embed_tokens.weight.dtype
        num_blocks = max_tokens // BLOCK_SIZE + 64  # + rounding up of each row's last block
        self.cache = KVCache(arch.num_layers, num_blocks, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim, dtype)

    def __call__(self, rows: list[torch.Tensor]) -> list[Features]:
        """Token rows [n_i] -> per row (final normed hidden [n_i, hidden], layers [n_i, len(layers) * hidden]),
        fp32 holding fp16 values, each row read from its own start (the features of a whole conversation)."""
        out: list[Features] = []
        group: list[torch.Tensor] = []
        for row in rows:
            if group and sum(len(r) for r in group) + len(row) > self.max_tokens:
                out += self._forward(group)
                group = []
            group.append(row)
        return out + (self._forward(group) if group else [])

    def _forward(self, rows: list[torch.Tensor]) -> list[Features]:
        spans, next_block = [], 0
        for row in rows:
            blocks = -(-len(row) // BLOCK_SIZE)
            if next_block + blocks > self.cache.num_blocks:
                raise ValueError(f"a row of {len(row)} tokens does not fit a feature cache of {self.max_tokens}")
            spans.append(SeqSpan(list(range(next_block, next_block + blocks)), 0, len(row)))
            next_block += blocks
        meta = build_metadata(spans, BLOCK_SIZE, kernel=uses_kernel(self.model.backend))
        input_ids = torch.cat([r.long() for r in rows])
        final, captured = self.model.forward_with_layers(input_ids, self.cache.layers, meta, self.layers)
        assert captured is not None
        # New tensors outside inference mode: inference tensors cannot be saved for the head's backward pass.
        final, captured = final.to(WIRE_DTYPE).float(), captured.to(WIRE_DTYPE).float()
        sizes = [len(r) for r in rows]
        return list(zip(final.split(sizes), captured.split(sizes), strict=True))

    def packed(self, features: Features) -> torch.Tensor:  # -> [n, width] fp16
        """One conversation's features as stored: the layers, and the final state only where -1 (the final
        state itself) is not among them."""
        final, layers = features
        parts = [layers] if -1 in self.layers else [layers, final]
        return torch.cat(parts, dim=-1).to(WIRE_DTYPE)

    def unpacked(self, stored: torch.Tensor) -> Features:
        hidden = self.model.arch.hidden_size
        layers = stored[:, : len(self.layers) * hidden].float()
        if -1 in self.layers:
            slot = self.layers.index(-1)
            return layers[:, slot * hidden : (slot + 1) * hidden], layers
        return stored[:, len(self.layers) * hidden :].float(), layers

    def stored_bytes(self, num_tokens: int) -> int:
        width = len(self.layers) + (0 if -1 in self.layers else 1)
        return num_tokens * width * self.model.arch.hidden_size * WIRE_DTYPE.itemsize


def _key(row: torch.Tensor) -> str:
    return hashlib.sha1(row.to(torch.int32).numpy().tobytes()).hexdigest()


class CachedFeatures:
    """Keeps the features of each conversation it computed (fp16, as stored), up to `max_bytes`: a data set that
    fits (e.g. a few hundred thousand positions, some GB) pays the target's prefill once, in its first epoch,
    instead of every epoch. A hit returns exactly what a recompute would."""

    def __init__(self, inner: TargetFeatures | FeatureStore, max_bytes: int) -> None:
        self.inner, self.max_bytes, self.used_bytes = inner, max_bytes, 0
        self.target = inner if isinstance(inner, TargetFeatures) else inner.inner
        self.store: dict[str, torch.Tensor] = {}

    def row_bytes(self, num_tokens: int) -> int:
        return self.target.stored_bytes(num_tokens)

    def holds_all(self, lengths: list[int]) -> bool:
        """Whether conversations of these lengths all fit: then only the first epoch prefills."""
        return self.row_bytes(sum(lengths)) <= self.max_bytes

    def __call__(self, rows: list[torch.Tensor]) -> list[Features]:
        keys = [_key(row) for row in rows]
        missing = [i for i, key in enumerate(keys) if key not in self.store]
        computed = dict(zip(missing, self.inner([rows[i] for i in missing]), strict=True)) if missing else {}
        for i, feats in computed.items():
            size = self.row_bytes(len(rows[i]))
            if keys[i] not in self.store and self.used_bytes + size <= self.max_bytes:
                self.store[keys[i]] = self.target.packed(feats)
                self.used_bytes += size
        return [computed[i] if i in computed else self.target.unpacked(self.store[key]) for i, key in enumerate(keys)]


class FeatureStore:
    """Each conversation's features on disk (one fp16 file per conversation, named by its tokens' hash), up to
    `max_bytes`: a run trained on over several sittings (`--resume`) pays each conversation's prefill once.
    The folder is per target and layer set (`folder_for`); a file is written whole or not at all."""

    def __init__(self, inner: TargetFeatures, folder: Path, max_bytes: int) -> None:
        self.inner, self.folder, self.max_bytes = inner, folder, max_bytes
        folder.mkdir(parents=True, exist_ok=True)
        self.used_bytes = sum(p.stat().st_size for p in folder.glob("*.pt"))
        self.hits = self.misses = 0

    @staticmethod
    def folder_for(root: Path, target: str, layers: tuple[int, ...]) -> Path:
        name = Path(target.rstrip("/")).name or "target"
        return root / f"{name}-layers{'_'.join(str(i) for i in layers)}-fp16"

    def __call__(self, rows: list[torch.Tensor]) -> list[Features]:
        paths = [self.folder / f"{_key(row)}.pt" for row in rows]
        missing = [i for i, path in enumerate(paths) if not path.is_file()]
        computed = dict(zip(missing, self.inner([rows[i] for i in missing]), strict=True)) if missing else {}
        self.hits, self.misses = self.hits + len(rows) - len(missing), self.misses + len(missing)
        for i, feats in computed.items():
            size = self.inner.stored_bytes(len(rows[i]))
            if self.used_bytes + size <= self.max_bytes:
                tmp = paths[i].with_suffix(f".{os.getpid()}.tmp")
                torch.save(self.inner.packed(feats), tmp)  # a new tensor of this row alone (cat, then cast)
                tmp.replace(paths[i])
                self.used_bytes += size
        out = []
        for i, path in enumerate(paths):
            if i in computed:
                out.append(computed[i])
                continue
            stored = torch.load(path)
            if stored.shape[0] != len(rows[i]):
                raise ValueError(f"{path} holds {stored.shape[0]} positions, its conversation {len(rows[i])}")
            out.append(self.inner.unpacked(stored))
        return out
