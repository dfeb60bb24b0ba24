"""Build an engine whose drafter runs in this process: n-gram, a local draft model, or any Drafter."""

from __future__ import annotations

import torch

from proposer_service.draft_grammar import DraftGrammar
from proposer_service.draft_model import DraftModelDrafter
from proposer_service.ngram import NgramDrafter
from shared.drafting import Drafter
from shared.model.build import CacheConfig, load_paged_model
from shared.model.config import ModelArch
from shared.model.llama import LlamaModel
from shared.model.loader import check_same_vocabulary, load_model
from verifier_service.builder import closing_on_failure, engine_on, load_target
from verifier_service.engine import Engine, EngineConfig


def make_draft_model_drafter(
    model: LlamaModel, arch: ModelArch, config: EngineConfig, cache: CacheConfig, top_n: int = 64
) -> DraftModelDrafter:
    """A draft model over its own cache, sized as the engine's (`config`; `cache.num_blocks` is the target's)."""
    draft_cache = CacheConfig(cache.block_size, None, cache.attention_backend, cache.enable_prefix_caching)
    paged = load_paged_model(
        (model, arch),
        config.max_num_seqs,
        config.max_model_len,
        config.num_speculative_tokens,
        draft_cache,
        role="the draft model",
    )
    return DraftModelDrafter(paged.runner, paged.blocks, top_n=top_n)


def enable_structured_output(engine: Engine, tokenizer) -> None:
    """Formats on an in-process engine: the target's tokenizer for the verifier's masks, and the same compiler for
    an in-process drafter's (same vocabulary), as a proposer service builds its own."""
    engine.enable_structured_output(tokenizer)
    grammar = getattr(engine.drafter, "grammar", None)
    if isinstance(grammar, DraftGrammar):
        grammar.compiler = engine.grammar


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
    paged = load_target(target, config, cache, dtype, device, tensor_parallel_size)
    with closing_on_failure(paged.runner):
        if drafter == "ngram":
            drafter = NgramDrafter()
        elif isinstance(drafter, str):
            draft_model, draft_arch = load_model(drafter, dtype, device)
            check_same_vocabulary(paged.arch, draft_arch, str(target), drafter)
            drafter = make_draft_model_drafter(draft_model, draft_arch, config, cache)
        return engine_on(paged, drafter, config)
