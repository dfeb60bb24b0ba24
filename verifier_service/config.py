"""The verifier's configuration: flags and SPECDEC_* environment variables (see shared/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.model.dtype import DTYPE_CHOICES
from shared.tls import TLSConfig


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings; the defaults here are the service's (VerifierConfig's flags start from them)."""

    num_speculative_tokens: int = 4
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    max_waiting: int = 256
    # Draft only as far as it pays (see spec_policy.py); False drafts num_speculative_tokens always.
    adaptive_k: bool = True
    probe_interval: int = 16  # every N steps a drafting plan drafts one token more or less (its costs measured)
    # Token trees: at most this many draft nodes per sequence (depth <= num_speculative_tokens); 0: chains only.
    max_tree_nodes: int = 0

    @property
    def step_tokens(self) -> int:
        """The most tokens one step commits per sequence (k drafts and the target's own): a proposer sent more than
        this at once is catching up."""
        return self.num_speculative_tokens + 1


ENGINE_DEFAULTS = EngineConfig()


@dataclass(frozen=True)
class VerifierConfig(TLSConfig):
    """specdec verifier: owns the target model and its paged KV cache, verifies drafts from a proposer."""

    model: str = field(
        default="",
        metadata={"help": "target model: HF hub id, HF folder or .gguf (default: the repository's target model)"},
    )
    proposer: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "proposer address(es) host:port, comma-separated; the first reachable one is used and the "
            "others are fallbacks. Empty: decode with the target alone (k = 0)"
        },
    )
    num_speculative_tokens: int = field(
        default=ENGINE_DEFAULTS.num_speculative_tokens,
        metadata={"help": "draft length k per sequence per step (the largest k when adaptive)"},
    )
    adaptive_k: bool = field(
        default=ENGINE_DEFAULTS.adaptive_k,
        metadata={
            "help": "choose k per sequence from its acceptance and the measured draft cost (0 when drafting "
            "does not pay); --no-adaptive-k always drafts num_speculative_tokens"
        },
    )
    max_tree_nodes: int = field(
        default=ENGINE_DEFAULTS.max_tree_nodes,
        metadata={
            "help": "token trees: the most draft nodes scored per sequence per step (depth <= the draft length); "
            "0: chains only"
        },
    )
    host: str = field(
        default="127.0.0.1",
        metadata={"help": "address to listen on (loopback by default: an internal service; 0.0.0.0 in a pod)"},
    )
    port: int = field(default=50052, metadata={"help": "port to listen on (0: any free port)"})
    max_num_seqs: int = field(default=ENGINE_DEFAULTS.max_num_seqs, metadata={"help": "sequences in the running batch"})
    max_num_batched_tokens: int = field(
        default=ENGINE_DEFAULTS.max_num_batched_tokens, metadata={"help": "tokens fed per engine step"}
    )
    max_model_len: int = field(
        default=ENGINE_DEFAULTS.max_model_len,
        metadata={"help": "context length: prompt plus generated tokens (clamped to the model's)"},
    )
    block_size: int = field(
        default=0,
        metadata={"help": "tokens per KV cache block (0 = auto: 256 where flash-attn runs, which needs it; else 16)"},
    )
    num_kv_blocks: int | None = field(
        default=None, metadata={"help": "KV cache blocks (default: max_num_seqs full-length sequences)"}
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata={
            "help": "reuse the KV cache of prompt prefixes seen before (earlier turns of a session, a shared "
            "system prompt); finished requests' blocks stay cached until their space is needed. "
            "--no-enable-prefix-caching recomputes every prompt"
        },
    )
    max_waiting: int = field(
        default=ENGINE_DEFAULTS.max_waiting, metadata={"help": "queued requests beyond which RESOURCE_EXHAUSTED"}
    )
    warm_up: bool = field(
        default=True,
        metadata={
            "help": "before serving, run one synthetic full batch (every slot, a full prefill, speculative steps) "
            "so memory reaches its serving size at start and stays flat; --no-warm-up skips it"
        },
    )
    default_max_tokens: int = field(default=128, metadata={"help": "max_tokens of a request that sets none"})
    feature_layers: str = field(
        default="auto",
        metadata={
            "help": "target layers whose hidden states an EAGLE proposer may ask for (kept only when one asks, "
            "from the scoring forward): comma-separated decoder layers (0-based) and -1, the final normed state; "
            "auto: -1 and EAGLE-3's low, middle and high layers (1, L/2 - 1, L - 4 of an L-layer target). A "
            "proposer asking for another layer is refused at connection"
        },
    )
    proposer_timeout_ms: int = field(
        default=2000,
        metadata={"help": "deadline of one propose round trip; past it the step decodes with k = 0 and reconnects"},
    )
    max_draft_support: int = field(
        default=1024,
        metadata={
            "help": "widest draft distribution per position accepted from the proposer (stated to it at the "
            "handshake; capped by the vocabulary): a wider draft is dropped and counted as invalid"
        },
    )
    proposer_reconnect_max_s: float = field(
        default=10.0, metadata={"help": "longest wait between proposer reconnection attempts (exponential backoff)"}
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "tensor-parallel degree of the target model: ranks (processes; one GPU each on CUDA) that "
            "each hold 1/N of the attention heads and MLP; N must divide the model's attention heads"
        },
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "weights and KV cache dtype: auto (the checkpoint's dtype on GPU, float32 on CPU), float32, "
            "bfloat16 or float16"
        },
    )
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:N, or auto (cuda when available)"})
    attention_backend: str = field(default="auto", metadata={"help": "auto, torch, cpu or flash"})
    compile: bool = field(
        default=False,
        metadata={
            "help": "run the target's forward as one graph compiled by torch.compile (CPU, tensor-parallel size "
            "1): the small ops between the weight products fused (steps 8-16 percent faster on a 2-core Xeon); "
            "the first forward (the warm-up) compiles for about a minute; logits within ~1e-4 of the eager ones. "
            "With --dtype bfloat16 on a CPU with AMX the graph also makes the weight products "
            "itself (steps ~0.65x the eager bf16 ones on a 2-core Xeon with AMX; compiling takes ~140 s there)"
        },
    )
    grace_period_s: float = field(
        default=20.0,
        metadata={"help": "on SIGTERM, seconds to let running requests finish before they are aborted"},
    )
    keepalive_interval_s: float = field(
        default=10.0,
        metadata={
            "help": "a request that waits its turn this long while the engine steps other requests gets an empty "
            "message, so a gateway does not take the silence for a hung verifier (none while the engine is stuck)"
        },
    )
    metrics_port: int = field(
        default=0, metadata={"help": "Prometheus /metrics port on --host (0: no endpoint); traces: OTEL_* variables"}
    )
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING or ERROR"})
    tls_server_name: str = field(
        default="",
        metadata={
            "help": "name the proposer's certificate must carry when its address does not; TLS to the "
            "proposer is on when --tls-ca-file is set"
        },
    )

    def capturable_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """--feature-layers for a target of `num_target_layers` layers (ValueError when it names others)."""
        from shared.model.eagle import check_feature_layers, eagle3_layers  # torch: not for parsing flags

        if self.feature_layers.strip() == "auto":
            return (-1, *eagle3_layers(num_target_layers))
        try:
            layers = tuple(int(i) for i in self.feature_layers.split(","))
        except ValueError:
            raise ValueError(
                f"--feature-layers must be auto or comma-separated integers, got {self.feature_layers!r}"
            ) from None
        check_feature_layers(layers, num_target_layers, "--feature-layers")
        return layers

    def engine_config(self, max_model_len: int) -> EngineConfig:
        """The engine's settings from these flags; `max_model_len` clamped to the model's."""
        return EngineConfig(
            num_speculative_tokens=self.num_speculative_tokens,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            max_waiting=self.max_waiting,
            adaptive_k=self.adaptive_k,
            max_tree_nodes=self.max_tree_nodes,
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.compile and self.tensor_parallel_size > 1:
            raise ValueError("--compile needs --tensor-parallel-size 1 (the ranks' all-reduces stay eager)")
        if not 0 <= self.port <= 65535 or not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--port and --metrics-port must be in [0, 65535], got {self.port}, {self.metrics_port}")
        if self.num_speculative_tokens < 0 or self.max_tree_nodes < 0:
            raise ValueError(
                f"--num-speculative-tokens and --max-tree-nodes must be >= 0, got {self.num_speculative_tokens}, "
                f"{self.max_tree_nodes}"
            )
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "default_max_tokens",
            "proposer_timeout_ms",
            "max_draft_support",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 0:
            raise ValueError(f"--block-size must be >= 0 (0 = auto), got {self.block_size}")
        if self.max_waiting < 0:
            raise ValueError(f"--max-waiting must be >= 0, got {self.max_waiting}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"--num-kv-blocks must be >= 1, got {self.num_kv_blocks}")
        for address in self.proposer:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"--proposer address {address!r} is not host:port")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.keepalive_interval_s <= 0:
            raise ValueError(f"--keepalive-interval-s must be > 0, got {self.keepalive_interval_s}")
        if self.grace_period_s < 0 or self.proposer_reconnect_max_s <= 0:
            raise ValueError("--grace-period-s must be >= 0 and --proposer-reconnect-max-s > 0")
