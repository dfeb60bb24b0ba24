"""Assemble an engine from model names: load weights, size the caches, pick the drafter."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from proposer_service.draft_model import DraftModelDrafter
from proposer_service.drafter import Drafter
from proposer_service.ngram import NgramDrafter
from shared.kv.block_manager import BlockManager
from shared.kv.cache import KVCache
from shared.model.config import ModelArch
from shared.model.llama import LlamaModel
from shared.model.loader import check_same_vocabulary, load_model
from shared.model.runner import ModelRunner
from verifier_service.engine import Engine, EngineConfig


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: room for max_num_seqs full-length sequences
    attention_backend: str = "auto"


def make_runner(model: LlamaModel, arch: ModelArch, num_blocks: int, cache: CacheConfig) -> ModelRunner:
    device = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    kv = KVCache(arch.num_layers, num_blocks, cache.block_size, arch.num_kv_heads, arch.head_dim, dtype, device)
    return ModelRunner(model, kv, cache.attention_backend)


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
    return DraftModelDrafter(runner, BlockManager(num_blocks, cache.block_size), top_n=top_n)


def build_engine(
    target: str | tuple[LlamaModel, ModelArch],
    drafter: str | Drafter | None = None,  # "ngram", a draft model name/path, a Drafter, or None (k = 0)
    config: EngineConfig | None = None,
    cache: CacheConfig | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Engine:
    config = config or EngineConfig()
    cache = cache or CacheConfig()
    model, arch = load_model(target, dtype, device) if isinstance(target, str) else target
    arch.check_context_length(config.max_model_len, "the target")
    num_blocks = default_num_blocks(config, cache)
    runner = make_runner(model, arch, num_blocks, cache)
    if drafter == "ngram":
        drafter = NgramDrafter()
    elif isinstance(drafter, str):
        draft_model, draft_arch = load_model(drafter, dtype, device)
        check_same_vocabulary(arch, draft_arch, str(target), drafter)
        drafter = make_draft_model_drafter(draft_model, draft_arch, config, cache)
    return Engine(config, runner, BlockManager(num_blocks, cache.block_size), drafter, arch.eos_token_ids)
