"""Assemble an engine from a target model and a given drafter: the target over its paged cache, then the engine.

The drafter comes from outside: the server passes a RemoteProposer; in-process drafters (n-gram, a local
draft model) are chosen by specdec_local.builder, so this service never imports the proposer's code.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import replace

import torch

from shared.drafting import Drafter
from shared.hugepages import advise_process_memory
from shared.model.build import CacheConfig, PagedModel, load_paged_model
from shared.model.config import ModelArch
from shared.model.llama import LlamaModel
from shared.model.runner import ModelRunner
from shared.model.tp_group import TPModelRunner
from verifier_service.config import EngineConfig, VerifierConfig
from verifier_service.engine import Engine

log = logging.getLogger("specdec.verifier")


def load_target(
    target: str | tuple[LlamaModel, ModelArch],
    config: EngineConfig,
    cache: CacheConfig,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    tensor_parallel_size: int = 1,
    compile: bool = False,
) -> PagedModel:
    """The target over a cache sized for `config` (its context clamped to the model's)."""
    return load_paged_model(
        target,
        config.max_num_seqs,
        config.max_model_len,
        config.num_speculative_tokens,
        cache,
        dtype,
        device,
        tensor_parallel_size,
        compile=compile,
    )


@contextlib.contextmanager
def closing_on_failure(runner: ModelRunner) -> Iterator[None]:
    """A tensor-parallel runner's rank processes are stopped if building on top of it fails."""
    try:
        yield
    except BaseException:
        if isinstance(runner, TPModelRunner):
            runner.close()
        raise


def engine_on(target: PagedModel, drafter: Drafter | None, config: EngineConfig) -> Engine:
    """The engine over a loaded target; its context is the one the cache was sized for."""
    config = replace(config, max_model_len=target.max_model_len)
    return Engine(config, target.runner, target.blocks, drafter, target.arch.eos_token_ids)


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
    paged = load_target(target, config, cache or CacheConfig(), dtype, device, tensor_parallel_size)
    with closing_on_failure(paged.runner):
        return engine_on(paged, drafter, config)


def build_service_engine(
    config: VerifierConfig, name: str, target: tuple[LlamaModel, ModelArch] | None, drafter: Drafter | None
) -> Engine:
    """The verifier service's engine from its flags: the target `name` (or `target`, already loaded, at TP 1) in
    the flags' dtype on their device, the cache, the warm-up batch, and the compiler of output formats."""
    from shared.grammar import load_compiler
    from shared.model.attention import resolve_block_size
    from shared.model.dtype import resolve_dtype
    from shared.model.info import resolve_device

    tp_size = config.tensor_parallel_size
    if tp_size > 1 and target is not None:
        raise ValueError("at --tensor-parallel-size > 1 every rank loads the target itself: pass no model")
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, name)
    log.info("target dtype=%s (--dtype %s) device=%s", str(dtype).removeprefix("torch."), config.dtype, device)
    block_size = resolve_block_size(config.block_size, config.attention_backend, device)
    cache = CacheConfig(block_size, config.num_kv_blocks, config.attention_backend, config.enable_prefix_caching)
    started = time.monotonic()
    engine_config = config.engine_config(config.max_model_len)
    paged = load_target(target or name, engine_config, cache, dtype, device, tp_size, compile=config.compile)
    log.info(
        "target model loaded model=%s tensor_parallel_size=%d seconds=%.1f", name, tp_size, time.monotonic() - started
    )
    with closing_on_failure(paged.runner):
        engine = engine_on(paged, drafter, config.engine_config(paged.max_model_len))
        # The weights and the cache on huge pages before the warm-up: the policy starts from the warm-up's timings
        advise_process_memory("verifier")
        if config.warm_up:
            started = time.monotonic()
            engine.warm_up()  # with --compile, the first forward compiles the graph: most of a minute
            log.info("warm-up batch served seconds=%.1f compiled=%s", time.monotonic() - started, config.compile)
        # After the weights, not beside them: two threads importing transformers' lazy modules at once can fail.
        engine.grammar = load_compiler(
            name, engine.runner.vocab_size, tuple(engine.eos_token_ids), "requests with a format get INVALID_ARGUMENT"
        )
    return engine
