"""Build the drafter a proposer serves, by kind, and what GetInfo reports about it.

- draft-model: any HF causal LM with the target's vocabulary, over its own paged KV cache (shared/model/build.py,
  the same assembly as the verifier's target), at its own tensor-parallel degree;
- eagle: a draft head (shared/model/eagle.py) plus, from the target, only its embedding and LM head;
- ngram: prompt lookup, no model; the target's tokenizer only for drafts under a format;
- suffix: suffix decoding (proposer_service/suffix.py), no model; the target's tokenizer as for ngram.
Each kind gets a compiler of formats (structured output) over the ids it drafts, when a tokenizer loads.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from proposer_service.config import ProposerConfig
from shared.drafting import Drafter
from shared.grammar import GrammarCompiler, load_compiler
from shared.placement import cpu_set, host_id
from shared.proto_gen.specdec.v1 import proposer_pb2

log = logging.getLogger("specdec.proposer")

KIND_TO_PROTO = {
    "draft-model": proposer_pb2.PROPOSER_KIND_DRAFT_MODEL,
    "ngram": proposer_pb2.PROPOSER_KIND_NGRAM,
    "eagle": proposer_pb2.PROPOSER_KIND_EAGLE,
    "suffix": proposer_pb2.PROPOSER_KIND_SUFFIX,
}


@dataclass(frozen=True)
class ProposerInfo:
    """What GetInfo reports; also bounds what the servicer asks of the drafter."""

    kind: str  # "draft-model", "ngram", "eagle" or "suffix"
    model: str = ""
    vocab_size: int = 0  # 0: any vocabulary (n-gram and suffix only propose ids they have seen)
    tokenizer_fingerprint: str = ""
    max_k: int = 16
    max_model_len: int = 0  # 0: unlimited
    target_hidden_size: int = 0  # > 0: the drafter reads the target's features of this size (eagle)
    target_feature_layers: tuple[int, ...] = (-1,)  # whose hidden states, concatenated per position

    @property
    def feature_width(self) -> int:
        """Values per position in ProposeSequence.target_features: hidden size x layers read."""
        return self.target_hidden_size * len(self.target_feature_layers)

    def to_proto(self) -> proposer_pb2.GetInfoResponse:
        return proposer_pb2.GetInfoResponse(
            kind=KIND_TO_PROTO.get(self.kind, proposer_pb2.PROPOSER_KIND_UNSPECIFIED),
            model=self.model,
            vocab_size=self.vocab_size,
            tokenizer_fingerprint=self.tokenizer_fingerprint,
            max_k=self.max_k,
            max_model_len=self.max_model_len,
            needs_target_features=self.target_hidden_size > 0,
            target_hidden_size=self.target_hidden_size,
            target_feature_layers=list(self.target_feature_layers) if self.target_hidden_size else [],
            feature_dtype=(
                proposer_pb2.FEATURE_DTYPE_FLOAT16
                if self.target_hidden_size
                else proposer_pb2.FEATURE_DTYPE_UNSPECIFIED
            ),
            host_id=host_id(),  # so that a verifier sharing these cores does not have it follow plain sequences
            cpus=sorted(cpu_set()),
        )


def build_drafter(config: ProposerConfig) -> tuple[Drafter, ProposerInfo]:
    if config.kind == "ngram":
        return build_ngram_drafter(config)
    if config.kind == "suffix":
        return build_suffix_drafter(config)
    drafter, info = build_eagle_drafter(config) if config.kind == "eagle" else build_draft_model_drafter(config)
    if config.suffix_branches:
        from proposer_service.paged_drafter import PagedDrafter
        from proposer_service.suffix_branches import SuffixBranches

        assert isinstance(drafter, PagedDrafter)
        drafter.branches = SuffixBranches(config.suffix_max_depth, config.suffix_min_token_prob)
    if config.compile:
        started = time.monotonic()
        warm_up(drafter, info)
        log.info("warm-up draft done seconds=%.1f compiled=True", time.monotonic() - started)
    return drafter, info


WARM_UP_TENANT = "\x00warm-up"  # no API key's name: its blocks are never another request's prefix-cache hit


def warm_up(drafter: Drafter, info: ProposerInfo, k: int = 2) -> None:
    """One short draft before serving, tree and chain, and the sequences released: with --compile the first forward
    of each graph compiles it, which a verifier's first request would otherwise wait for (and time out on)."""
    import torch

    from shared.drafting import DraftRequest

    tokens = list(range(1, 9))
    # The target's features of every committed position but the last (zeros: a draft's quality is not the point).
    features = torch.zeros(len(tokens) - 1, info.feature_width) if info.target_hidden_size else None
    requests = [
        DraftRequest(
            f"\x00warm-up-{nodes}",
            len(tokens),
            tokens,
            k,
            features=features,
            tenant=WARM_UP_TENANT,
            max_tree_nodes=nodes,
        )
        for nodes in (0, 2 * k)
    ]
    drafter.propose(requests)
    drafter.release([req.seq_id for req in requests])


def load_grammar_compiler(
    tokenizer_source: str, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> GrammarCompiler | None:
    """The compiler of formats (structured output) over the drafter's token ids, or None (with a warning) when
    no tokenizer can be loaded: sequences with a format are then not drafted."""
    return load_compiler(tokenizer_source, vocab_size, eos_token_ids, "sequences with a format are not drafted")


def build_ngram_drafter(config: ProposerConfig) -> tuple[Drafter, ProposerInfo]:
    from proposer_service.ngram import NgramDrafter

    drafter = NgramDrafter(config.ngram_max, config.ngram_min, target_grammar(config))
    return drafter, ProposerInfo("ngram", "", 0, "", config.max_k, 0)


def build_suffix_drafter(config: ProposerConfig) -> tuple[Drafter, ProposerInfo]:
    from proposer_service.suffix import SuffixDrafter

    drafter = SuffixDrafter(
        config.suffix_cache_tokens,
        config.suffix_max_depth,
        config.suffix_max_spec_factor,
        config.suffix_max_spec_offset,
        config.suffix_min_token_prob,
        grammar=target_grammar(config),
    )
    return drafter, ProposerInfo("suffix", "", 0, "", config.max_k, 0)


def target_grammar(config: ProposerConfig) -> GrammarCompiler | None:
    """Formats for a drafter without a model (n-gram, suffix): compiled with the target's tokenizer."""
    from shared.model.build import read_arch
    from shared.settings import default_target_model

    target = config.target_model or default_target_model()
    try:
        arch = read_arch(target)
        return load_grammar_compiler(target, arch.vocab_size, arch.eos_token_ids)
    except Exception as err:
        log.warning("no config from %s (%s): sequences with a format are not drafted", target, err)
        return None


def build_draft_model_drafter(config: ProposerConfig) -> tuple[Drafter, ProposerInfo]:
    from proposer_service.draft_model import DraftModelDrafter
    from shared.model.attention import resolve_block_size
    from shared.model.build import CacheConfig, load_paged_model
    from shared.model.dtype import resolve_dtype
    from shared.model.info import resolve_device, tokenizer_fingerprint
    from shared.settings import default_draft_model

    name = config.model or default_draft_model()
    started = time.monotonic()
    device, tp_size = resolve_device(config.device), config.tensor_parallel_size
    dtype = resolve_dtype(config.dtype, device, name)
    log.info("draft dtype=%s (--dtype %s) device=%s", str(dtype).removeprefix("torch."), config.dtype, device)
    block_size = resolve_block_size(config.block_size, config.attention_backend, device)
    cache = CacheConfig(block_size, config.num_kv_blocks, config.attention_backend, config.enable_prefix_caching)
    paged = load_paged_model(
        name, config.max_num_seqs, config.max_model_len, config.max_k, cache, dtype, device, tp_size, "the draft model",
        compile=config.compile,
    )  # fmt: skip
    arch = paged.arch
    grammar = load_grammar_compiler(name, arch.vocab_size, arch.eos_token_ids)
    drafter = DraftModelDrafter(paged.runner, paged.blocks, top_n=config.draft_top_n, grammar=grammar)
    drafter.tree_width, drafter.tree_beam, drafter.cache.ahead = config.tree_width, config.tree_beam, config.draft_ahead
    fingerprint = tokenizer_fingerprint(name)
    info = ProposerInfo("draft-model", name, arch.vocab_size, fingerprint, config.max_k, paged.max_model_len)
    log.info(
        "draft model loaded model=%s vocab=%d layers=%d kv_blocks=%d block_size=%d tensor_parallel_size=%d "
        "seconds=%.1f",
        name,
        arch.vocab_size,
        arch.num_layers,
        paged.blocks.num_blocks,
        block_size,
        tp_size,
        time.monotonic() - started,
    )
    return drafter, info


def build_eagle_drafter(config: ProposerConfig) -> tuple[Drafter, ProposerInfo]:
    """The head from its folder and, from the target, only the embedding and LM head tensors."""
    from proposer_service.eagle import make_eagle_drafter
    from shared.model.attention import DEFAULT_BLOCK_SIZE
    from shared.model.build import CacheConfig, default_num_blocks
    from shared.model.dtype import resolve_head_dtype
    from shared.model.eagle import check_feature_layers
    from shared.model.info import resolve_device, tokenizer_fingerprint
    from shared.model.loader import load_embeddings
    from shared.settings import default_eagle_head, default_target_model

    head_dir, target = config.model or default_eagle_head(), config.target_model or default_target_model()
    started = time.monotonic()
    embedding, lm_head, arch = load_embeddings(target)
    max_model_len = min(config.max_model_len, arch.max_position_embeddings)
    # On the CPU the head attends as --attention-backend says (eagle.build_head); on a GPU through torch (no flash
    # pages).
    cache = CacheConfig(
        config.block_size or DEFAULT_BLOCK_SIZE,
        config.num_kv_blocks,
        config.attention_backend,
        config.enable_prefix_caching,
    )
    num_blocks = default_num_blocks(config.max_num_seqs, max_model_len, config.max_k, cache)
    device = resolve_device(config.device)
    dtype = resolve_head_dtype(config.dtype, device, target)
    log.info("head dtype=%s (--dtype %s) device=%s", str(dtype).removeprefix("torch."), config.dtype, device)
    drafter = make_eagle_drafter(
        head_dir,
        embedding,
        lm_head,
        num_blocks,
        cache.block_size,
        cache.enable_prefix_caching,
        config.draft_top_n,
        device,
        # The head drafts the target's token ids: the target's tokenizer names them.
        load_grammar_compiler(target, arch.vocab_size, arch.eos_token_ids),
        dtype,
        cache.attention_backend,
    )
    # A head for layers this target lacks is refused here, at start-up, not by a verifier later.
    check_feature_layers(drafter.head.feature_layers, arch.num_layers, f"the head {head_dir}")
    if config.compile:
        drafter.head.compile()
    drafter.tree_width, drafter.tree_beam, drafter.cache.ahead = config.tree_width, config.tree_beam, config.draft_ahead
    fingerprint = tokenizer_fingerprint(target)
    info = ProposerInfo(
        "eagle", head_dir, arch.vocab_size, fingerprint, config.max_k, max_model_len, arch.hidden_size,
        drafter.head.feature_layers,
    )  # fmt: skip
    log.info(
        "eagle head loaded head=%s target=%s target_layers=%s draft_vocab=%d kv_blocks=%d seconds=%.1f",
        head_dir,
        target,
        list(drafter.head.feature_layers),
        drafter.head.draft_vocab_size,
        num_blocks,
        time.monotonic() - started,
    )
    return drafter, info
