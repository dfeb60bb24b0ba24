"""Assemble an engine from model names: load weights, size the caches, pick the drafter."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from proposer_service.draft_model import DraftModelDrafter
from proposer_service.ngram import NgramDrafter
from shared.drafting import Drafter
from shared.kv.block_manager import BlockManager
from shared.kv.cache import KVCache
from shared.model.config import ModelArch
from shared.model.llama import LlamaModel
from shared.model.loader import ModelSource, check_same_vocabulary, load_hf_config, load_model
from shared.model.runner import ModelRunner
from shared.model.tp_group import (
    RankSpec,
    TPModelRunner,
    check_tensor_parallel,
    default_threads_per_rank,
    launch_tp_runner,
)
from verifier_service.engine import Engine, EngineConfig


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


def default_num_blocks(config: EngineConfig, cache: CacheConfig) -> int:
    # Drafts need k extra slots per sequence on top of the context.
    per_seq = math.ceil((config.max_model_len + config.num_speculative_tokens + 1) / cache.block_size)
    return cache.num_blocks or config.max_num_seqs * per_seq


def make_draft_model_drafter(
    model: LlamaModel, arch: ModelArch, config: EngineConfig, cache: CacheConfig, top_n: int = 64
) -> DraftModelDrafter:
    arch.check_context_length(config.max_model_len, "the draft model")
    num_blocks = default_num_blocks(config, CacheConfig(cache.block_size, None, cache.attention_backend))
    runner = make_runner(model, arch, num_blocks, cache)
    blocks = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
    return DraftModelDrafter(runner, blocks, top_n=top_n)


def build_engine(
    target: str | tuple[LlamaModel, ModelArch],
    drafter: str | Drafter | None = None,  # "ngram", a draft model name/path, a Drafter, or None (k = 0)
    config: EngineConfig | None = None,
    cache: CacheConfig | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    tensor_parallel_size: int = 1,
) -> Engine:
    """At `tensor_parallel_size` > 1 the target must be a name or path: every rank loads its own shard.
    The in-process draft model (a name here) always runs at TP 1; a larger draft belongs in a proposer
    service, which has its own --tensor-parallel-size."""
    config = config or EngineConfig()
    cache = cache or CacheConfig()
    num_blocks = default_num_blocks(config, cache)
    runner: ModelRunner
    if tensor_parallel_size > 1:
        if not isinstance(target, str):
            raise ValueError(
                "a tensor-parallel target is loaded by every rank from its checkpoint: pass its name or path"
            )
        arch = read_arch(target)
        arch.check_context_length(config.max_model_len, "the target")
        runner = make_tp_runner(target, arch, num_blocks, cache, tensor_parallel_size, dtype, device)
    else:
        model, arch = load_model(target, dtype, device) if isinstance(target, str) else target
        arch.check_context_length(config.max_model_len, "the target")
        runner = make_runner(model, arch, num_blocks, cache)
    try:
        if drafter == "ngram":
            drafter = NgramDrafter()
        elif isinstance(drafter, str):
            draft_model, draft_arch = load_model(drafter, dtype, device)
            check_same_vocabulary(arch, draft_arch, str(target), drafter)
            drafter = make_draft_model_drafter(draft_model, draft_arch, config, cache)
        blocks = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        return Engine(config, runner, blocks, drafter, arch.eos_token_ids)
    except BaseException:
        if isinstance(runner, TPModelRunner):
            runner.close()
        raise


def read_arch(name_or_path: str) -> ModelArch:
    """The model's architecture from its config alone (no weights read)."""
    return ModelArch.from_hf_config(load_hf_config(ModelSource.resolve(name_or_path)))
