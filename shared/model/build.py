"""A model over its own paged KV cache, assembled one way for the verifier's target and the proposer's draft
model (in a service or in-process): weights (or a model already loaded), the cache sized for the batch and
context, the runner (rank 0's under tensor parallelism) and the pure-Python block manager over the cache."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shared.kv.block_manager import BlockManager
from shared.kv.cache import KVCache
from shared.model.config import ModelArch
from shared.model.llama import LlamaModel
from shared.model.loader import ModelSource, load_hf_config, load_model
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


@dataclass(frozen=True)
class PagedModel:
    runner: ModelRunner
    blocks: BlockManager
    arch: ModelArch
    max_model_len: int  # the context the cache was sized for: the one asked for, clamped to the model's


def load_paged_model(
    model: str | tuple[LlamaModel, ModelArch],
    max_num_seqs: int,
    max_model_len: int,
    num_speculative_tokens: int,
    cache: CacheConfig,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    tensor_parallel_size: int = 1,
    role: str = "the target",
    compile: bool = False,
) -> PagedModel:
    """`model` (a name or path to load, or a model already loaded) over a cache for `max_num_seqs` sequences of
    `max_model_len` tokens plus `num_speculative_tokens` draft slots (or `cache.num_blocks`). At
    `tensor_parallel_size` > 1 it must be a name or path: every rank loads its own shard, and a model that
    cannot be split is refused before any process starts. `compile`: the forward as one compiled graph
    (shared/model/compiled.py), at tensor-parallel size 1 on CPU."""
    if compile and tensor_parallel_size > 1:
        raise ValueError("--compile needs --tensor-parallel-size 1 (the ranks' all-reduces stay eager)")
    if tensor_parallel_size > 1:
        if not isinstance(model, str):
            raise ValueError(
                f"a tensor-parallel model is loaded by every rank from its checkpoint: pass {role}'s name or path"
            )
        arch = read_arch(model)
        check_tensor_parallel(arch, tensor_parallel_size)
    else:
        loaded, arch = load_model(model, dtype, device) if isinstance(model, str) else model
    max_model_len = min(max_model_len, arch.max_position_embeddings)
    arch.check_context_length(max_model_len, role)
    num_blocks = default_num_blocks(max_num_seqs, max_model_len, num_speculative_tokens, cache)
    runner: ModelRunner
    if tensor_parallel_size > 1:
        assert isinstance(model, str)
        runner = make_tp_runner(model, arch, num_blocks, cache, tensor_parallel_size, dtype, device)
    else:
        runner = make_runner(loaded, arch, num_blocks, cache)
    if compile:
        loaded.compile()  # the model itself: an already loaded model passed here runs compiled wherever it is used
    return PagedModel(
        runner, BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching), arch, max_model_len
    )


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
