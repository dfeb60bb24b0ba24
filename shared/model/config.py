"""The architecture facts our Llama forward needs, read from a transformers config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "smollm", "smollm2")


@dataclass(frozen=True)
class ModelArch:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # attention window, if the model limits it (Mistral v0.1, some Qwen2)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArch:
        model_type = getattr(config, "model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not a Llama-family model; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (Llama uses silu)")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        # Qwen2 has biases on q/k/v only; its config has no attention_bias field.
        attention_bias = bool(getattr(config, "attention_bias", model_type == "qwen2"))
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            rope_parameters=_rope_parameters(config),
            eos_token_ids=_eos_ids(getattr(config, "eos_token_id", None)),
            sliding_window=_sliding_window(config, model_type),
        )

    def check_context_length(self, max_model_len: int, name: str = "the model") -> None:
        """Our attention is full (not windowed): refuse contexts where the two would differ."""
        if self.sliding_window is not None and max_model_len > self.sliding_window:
            raise ValueError(
                f"{name} uses sliding-window attention ({self.sliding_window} tokens), which specdec does not "
                f"implement; set max_model_len <= {self.sliding_window} (got {max_model_len})"
            )


def _rope_parameters(config: Any) -> dict[str, Any]:
    # transformers 5 keeps everything in rope_parameters; older configs use rope_theta + rope_scaling.
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def _sliding_window(config: Any, model_type: str) -> int | None:
    window = getattr(config, "sliding_window", None)
    if model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        return None
    return int(window) if window else None


def _eos_ids(eos: Any) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos)
