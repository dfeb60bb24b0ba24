"""The proposer's configuration: flags and SPECDEC_* environment variables (see shared/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.model.dtype import DTYPE_CHOICES
from shared.tls import TLSConfig

KINDS = ("draft-model", "ngram", "eagle", "suffix")
MODEL_KINDS = ("draft-model", "eagle")  # the kinds that run a model (what --compile compiles)


@dataclass(frozen=True)
class ProposerConfig(TLSConfig):
    """specdec proposer: drafts tokens for a verifier over one bidi gRPC stream per verifier."""

    model: str = field(
        default="",
        metadata={
            "help": "draft model: HF hub id, HF folder or .gguf; with --kind eagle the head's folder (default: the "
            "repository's draft model, or its EAGLE head)"
        },
    )
    kind: str = field(default="draft-model", metadata={"help": "drafting method: draft-model, ngram, eagle or suffix"})
    target_model: str = field(
        default="",
        metadata={
            "help": "kind eagle: the target the head drafts for; only its embedding and LM head are read; kind "
            "ngram and suffix: only its tokenizer, for drafts under a format (default: the repository's target)"
        },
    )
    host: str = field(
        default="127.0.0.1",
        metadata={"help": "address to listen on (loopback by default: an internal service; 0.0.0.0 in a pod)"},
    )
    port: int = field(default=50053, metadata={"help": "port to listen on (0: any free port)"})
    max_k: int = field(default=16, metadata={"help": "largest draft length per sequence per step (larger k clamped)"})
    max_num_seqs: int = field(
        default=16, metadata={"help": "sequences whose draft KV the cache holds at once (idle ones are evicted)"}
    )
    max_model_len: int = field(
        default=2048, metadata={"help": "context length of the draft model (clamped to the model's own)"}
    )
    block_size: int = field(
        default=0,
        metadata={"help": "tokens per draft KV cache block (0 = auto: 256 where flash-attn runs, else 16)"},
    )
    num_kv_blocks: int | None = field(
        default=None, metadata={"help": "draft KV cache blocks (default: max_num_seqs full-length sequences)"}
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata={
            "help": "a new sequence reuses the draft KV of prefixes seen before (earlier turns, shared system "
            "prompts); --no-enable-prefix-caching recomputes every prompt in the draft model"
        },
    )
    draft_top_n: int = field(
        default=64, metadata={"help": "sampled drafts come from the draft model's top-n tokens (sent sparse)"}
    )
    tree_width: int = field(
        default=4,
        metadata={"help": "token trees (when the verifier asks for one): the best tokens drafted under each node"},
    )
    tree_beam: int = field(
        default=2, metadata={"help": "token trees: the best nodes of each depth expanded (one batched forward a depth)"}
    )
    draft_ahead: int = field(
        default=0,
        metadata={
            "help": "draft-model and eagle kinds: after answering, draft the next round for this many likely outcomes "
            "of each sequence's verification, and answer from that speculation cache when the committed tokens "
            "match (0: off; pays where the proposer has its own cores, docs/services.md)"
        },
    )
    suffix_branches: bool = field(
        default=True,
        metadata={
            "help": "draft-model and eagle kinds: join each draft with what followed the sequence's latest tokens in "
            "its own prompt and output (suffix decoding over the request's own text, no other request's): a branch "
            "of the model's token tree, or a greedy chain in place of the model's where the text is surer "
            "(docs/services.md); --no-suffix-branches: the model's drafts alone"
        },
    )
    ngram_max: int = field(default=4, metadata={"help": "n-gram kind: longest n-gram looked up"})
    ngram_min: int = field(default=1, metadata={"help": "n-gram kind: shortest n-gram looked up"})
    suffix_cache_tokens: int = field(
        default=1_000_000,
        metadata={
            "help": "suffix kind: tokens of earlier outputs kept for drafting, all tenants together (least recently "
            "written requests evicted whole; 0: only each request's own text)"
        },
    )
    suffix_max_depth: int = field(
        default=32, metadata={"help": "suffix kind and --suffix-branches: longest string indexed (match plus draft)"}
    )
    suffix_max_spec_factor: float = field(
        default=2.0,
        metadata={"help": "suffix kind: a match of m tokens drafts at most m * this factor + --suffix-max-spec-offset"},
    )
    suffix_max_spec_offset: float = field(default=-1.0, metadata={"help": "suffix kind: see --suffix-max-spec-factor"})
    suffix_min_token_prob: float = field(
        default=0.1,
        metadata={
            "help": "suffix kind and --suffix-branches: a draft stops where its path's empirical probability "
            "falls below this"
        },
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "tensor-parallel degree of the draft model, independent of the verifier's (1: one process, "
            "the usual choice for a small draft)"
        },
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "weights and KV cache dtype: auto (the checkpoint's dtype on GPU, float32 on CPU; an EAGLE "
            "head: bfloat16 on a CPU with bf16 instructions), float32, bfloat16 or float16"
        },
    )
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:N, or auto (cuda when available)"})
    compile: bool = field(
        default=False,
        metadata={
            "help": "eagle and draft-model kinds: the drafter's forward compiled by torch.compile (CPU, "
            "tensor-parallel size 1, a C++ compiler), as the verifier's --compile; with a bf16 head or draft on a CPU "
            "with AMX its products made inside the graph. Compiled at start, by a draft before serving (~20 s for the "
            "EAGLE head on 2 cores); the verifier's output does not depend on it"
        },
    )
    attention_backend: str = field(default="auto", metadata={"help": "auto, torch, cpu or flash"})
    grace_period_s: float = field(default=5.0, metadata={"help": "on SIGTERM, seconds to let open streams finish"})
    metrics_port: int = field(
        default=0, metadata={"help": "Prometheus /metrics port on --host (0: no endpoint); traces: OTEL_* variables"}
    )
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING or ERROR"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind not in KINDS:
            raise ValueError(f"--kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.compile and self.kind not in MODEL_KINDS:
            raise ValueError(f"--compile needs --kind eagle or draft-model (a {self.kind} drafter runs no model)")
        if self.tensor_parallel_size > 1 and self.kind != "draft-model":
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size} needs --kind draft-model")
        if not 0 <= self.port <= 65535 or not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--port and --metrics-port must be in [0, 65535], got {self.port}, {self.metrics_port}")
        if self.block_size < 0:
            raise ValueError(f"--block-size must be >= 0 (0 = auto), got {self.block_size}")
        for name in ("max_k", "max_num_seqs", "max_model_len", "draft_top_n", "tree_width", "tree_beam"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.draft_ahead < 0:
            raise ValueError(f"--draft-ahead must be >= 0, got {self.draft_ahead}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"--num-kv-blocks must be >= 1, got {self.num_kv_blocks}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= --ngram-min <= --ngram-max, got {self.ngram_min}, {self.ngram_max}")
        if self.suffix_cache_tokens < 0 or self.suffix_max_depth < 2:
            raise ValueError(
                f"need --suffix-cache-tokens >= 0 and --suffix-max-depth >= 2, got {self.suffix_cache_tokens}, "
                f"{self.suffix_max_depth}"
            )
        if self.suffix_max_spec_factor <= 0 or not 0 <= self.suffix_min_token_prob <= 1:
            raise ValueError(
                f"need --suffix-max-spec-factor > 0 and --suffix-min-token-prob in [0, 1], got "
                f"{self.suffix_max_spec_factor}, {self.suffix_min_token_prob}"
            )
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.grace_period_s < 0:
            raise ValueError(f"--grace-period-s must be >= 0, got {self.grace_period_s}")
