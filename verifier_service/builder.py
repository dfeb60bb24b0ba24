"""Assemble an engine from a target model and a given drafter: load weights, size the caches.

The drafter comes from outside: the server passes a RemoteProposer; in-process drafters (n-gram, a local
draft model) are chosen by specdec_local.builder, so this service never imports the proposer's code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from shared.drafting import Drafter
from shared.kv.block_manager import BlockManager
from shared.model.build import CacheConfig, default_num_blocks, make_runner, make_tp_runner, read_arch
from shared.model.config import ModelArch
from shared.model.llama import LlamaModel
from shared.model.loader import load_model
from shared.model.runner import ModelRunner
from shared.model.tp_group import TPModelRunner
from verifier_service.engine import Engine, EngineConfig


def engine_num_blocks(config: EngineConfig, cache: CacheConfig) -> int:
    return default_num_blocks(config.max_num_seqs, config.max_model_len, config.num_speculative_tokens, cache)


def load_target(
    target: str | tuple[LlamaModel, ModelArch],
    config: EngineConfig,
    cache: CacheConfig,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    tensor_parallel_size: int = 1,
) -> tuple[ModelRunner, ModelArch]:
    """The target's runner over a cache sized for `config`. At `tensor_parallel_size` > 1 the target must be a
    name or path: every rank loads its own shard."""
    num_blocks = engine_num_blocks(config, cache)
    if tensor_parallel_size > 1:
        if not isinstance(target, str):
            raise ValueError(
                "a tensor-parallel target is loaded by every rank from its checkpoint: pass its name or path"
            )
        arch = read_arch(target)
        arch.check_context_length(config.max_model_len, "the target")
        return make_tp_runner(target, arch, num_blocks, cache, tensor_parallel_size, dtype, device), arch
    model, arch = load_model(target, dtype, device) if isinstance(target, str) else target
    arch.check_context_length(config.max_model_len, "the target")
    return make_runner(model, arch, num_blocks, cache), arch


@contextlib.contextmanager
def closing_on_failure(runner: ModelRunner) -> Iterator[None]:
    """A tensor-parallel runner's rank processes are stopped if building on top of it fails."""
    try:
        yield
    except BaseException:
        if isinstance(runner, TPModelRunner):
            runner.close()
        raise


def assemble_engine(
    runner: ModelRunner, arch: ModelArch, drafter: Drafter | None, config: EngineConfig, cache: CacheConfig
) -> Engine:
    blocks = BlockManager(engine_num_blocks(config, cache), cache.block_size, cache.enable_prefix_caching)
    return Engine(config, runner, blocks, drafter, arch.eos_token_ids)


def build_engine(
    target: str | tuple[LlamaModel, ModelArch],
    drafter: Drafter | None = None,  # None: k = 0
    config: EngineConfig | None = None,
    cache: CacheConfig | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    tensor_parallel_size: int = 1,
) -> Engine:
    config = config or EngineConfig()
    cache = cache or CacheConfig()
    runner, arch = load_target(target, config, cache, dtype, device, tensor_parallel_size)
    with closing_on_failure(runner):
        return assemble_engine(runner, arch, drafter, config, cache)
