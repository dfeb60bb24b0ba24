"""Model runners and cache sizing, the same for the verifier's target and the proposer's draft model."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shared.kv.cache import KVCache
from shared.model.config import ModelArch
from shared.model.llama import LlamaModel
from shared.model.loader import ModelSource, load_hf_config
from shared.model.runner import ModelRunner
from shared.model.tp_group import (
    RankSpec,
    TPModelRunner,
    check_tensor_parallel,
    default_threads_per_rank,
    launch_tp_runner,
)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: room for max_num_seqs full-length sequences
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True  # reuse the K/V of prompt prefixes seen before (block_manager.py)


def make_runner(model: LlamaModel, arch: ModelArch, num_blocks: int, cache: CacheConfig) -> ModelRunner:
    device = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    kv_heads = model.tp.local_kv_heads(arch.num_kv_heads)  # this rank's KV heads (all of them at TP 1)
    kv = KVCache(arch.num_layers, num_blocks, cache.block_size, kv_heads, arch.head_dim, dtype, device)
    return ModelRunner(model, kv, cache.attention_backend)


def make_tp_runner(
    name_or_path: str,
    arch: ModelArch,
    num_blocks: int,
    cache: CacheConfig,
    tensor_parallel_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> TPModelRunner:
    """Rank 0's runner over a group of `tensor_parallel_size` ranks, each loading its own shard of the
    checkpoint (see shared/model/tp_group.py). A model that cannot be split is refused before any
    process starts."""
    check_tensor_parallel(arch, tensor_parallel_size)
    spec = RankSpec(
        model=name_or_path,
        num_blocks=num_blocks,
        block_size=cache.block_size,
        dtype=str(dtype).removeprefix("torch."),
        device=device,
        attention_backend=cache.attention_backend,
        num_threads=default_threads_per_rank(device, tensor_parallel_size),
    )
    return launch_tp_runner(spec, tensor_parallel_size)


def default_num_blocks(max_num_seqs: int, max_model_len: int, num_speculative_tokens: int, cache: CacheConfig) -> int:
    """`cache.num_blocks` if set, else room for `max_num_seqs` full-length sequences."""
    # Drafts need k extra slots per sequence on top of the context.
    per_seq = math.ceil((max_model_len + num_speculative_tokens + 1) / cache.block_size)
    return cache.num_blocks or max_num_seqs * per_seq


def read_arch(name_or_path: str) -> ModelArch:
    """The model's architecture from its config alone (no weights read)."""
    return ModelArch.from_hf_config(load_hf_config(ModelSource.resolve(name_or_path)))
