"""EAGLE-style draft head (Li et al. 2024, 2025) with a frequency-ranked vocabulary subset (FR-Spec, Zhao et al.
2025).

At head position j the input is [g_j ; embed(t_{j+1})] and fc (2h -> h) and Llama decoder layer(s) turn it into
the head's state x_j, from which the target's own LM head, restricted to the subset, gives logits for t_{j+2}.
Drafting feeds the head its own x as g after the last real position. Two kinds, by `target_feature_layers`:
- [-1] (EAGLE-1, the default of a config without the key): g_j is the target's final hidden state after
  reading tokens[: j + 1], and x_j is a prediction of the next one, f_{j+1}, fed to the LM head as is.
- any other layers (EAGLE-3: a low, a middle and a high one): the verifier sends those layers' hidden states
  (decoder layer i's output; -1 the final normed state), each is RMS-normalised (no weight: their scales
  differ by orders of magnitude) and `fuse` (n*h -> h) mixes them into g_j; x_j goes through the head's own
  RMSNorm before the LM head.

Two forwards over one set of weights: `EagleHead` (serving, over a paged KV cache, reusing our Llama layer)
and `reference_forward` (training and tests: plain causal attention over whole sequences, differentiable).
The files of a head: `config.json` (a Llama config of the head's layers plus `draft_vocab_size`) and
`model.safetensors` (fc, the layers and `vocab_subset`; never the target's embedding or LM head, which are
read from the target at load time).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from shared.model.attention import (
    DEFAULT_BLOCK_SIZE,
    AttentionMetadata,
    TorchPagedAttention,
    default_scale,
    select_backend,
)
from shared.model.config import ModelArch
from shared.model.llama import DecoderLayer, RMSNorm
from shared.model.parallel import SINGLE, linear, pack_linears, packed_parameter
from shared.model.rope import RotaryEmbedding, apply_rotary, rotation_tables

if TYPE_CHECKING:
    from shared.model.compiled_head import CompiledHead

HEAD_ARCHITECTURE = "SpecdecEagleHead"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


FINAL_LAYER = (-1,)


def head_config(
    target_arch: ModelArch,
    num_layers: int,
    draft_vocab_size: int,
    feature_layers: tuple[int, ...] = FINAL_LAYER,
    **extra: Any,
) -> dict[str, Any]:
    """config.json of a head for `target_arch`: its layers have the target's shape."""
    check_feature_layers(feature_layers, target_arch.num_layers)
    return {
        "architectures": [HEAD_ARCHITECTURE],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": target_arch.hidden_size,
        "intermediate_size": target_arch.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": target_arch.num_heads,
        "num_key_value_heads": target_arch.num_kv_heads,
        "head_dim": target_arch.head_dim,
        "rms_norm_eps": target_arch.rms_norm_eps,
        "max_position_embeddings": target_arch.max_position_embeddings,
        "rope_parameters": dict(target_arch.rope_parameters),
        "vocab_size": target_arch.vocab_size,
        "tie_word_embeddings": target_arch.tie_word_embeddings,
        "draft_vocab_size": draft_vocab_size,
        "target_feature_layers": list(feature_layers),
        "target_num_layers": target_arch.num_layers,
        **extra,
    }


def feature_layers_of(config: dict[str, Any]) -> tuple[int, ...]:
    """The target layers a head reads; a config without the key is an EAGLE-1 head (final state only)."""
    return tuple(int(i) for i in config.get("target_feature_layers", FINAL_LAYER))


def eagle3_layers(num_target_layers: int) -> tuple[int, ...]:
    """A low, a middle and a high decoder layer (EAGLE-3's choice: 1, L/2 - 1, L - 4; spread out on a tiny
    target), read by the trainer's default heads and captured by the verifier's default `--feature-layers`."""
    if num_target_layers >= 8:
        return (1, num_target_layers // 2 - 1, num_target_layers - 4)
    return tuple(dict.fromkeys((0, num_target_layers // 2, num_target_layers - 1)))


def check_feature_layers(layers: tuple[int, ...], num_target_layers: int, what: str = "a head") -> None:
    if not layers or len(set(layers)) != len(layers) or not all(-1 <= i < num_target_layers for i in layers):
        raise ValueError(
            f"{what} reads target layers {list(layers)}, but they must be distinct decoder layers of a "
            f"{num_target_layers}-layer target, in [0, {num_target_layers}), or -1 (the final normed state)"
        )


def arch_from_config(config: dict[str, Any]) -> ModelArch:
    return ModelArch.from_hf_config(SimpleNamespace(**config))


def read_head_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / CONFIG_FILE
    config = json.loads(path.read_text())
    if HEAD_ARCHITECTURE not in config.get("architectures", []):
        raise ValueError(f"{path} is not an EAGLE draft head (architectures must list {HEAD_ARCHITECTURE})")
    return config


class EagleHead(torch.nn.Module):
    """Serving forward over a paged KV cache (one cache layer per head layer)."""

    def __init__(self, arch: ModelArch, draft_vocab_size: int, feature_layers: tuple[int, ...] = FINAL_LAYER) -> None:
        super().__init__()
        self.arch = arch
        self.feature_layers = tuple(feature_layers)
        self.fused = self.feature_layers != FINAL_LAYER
        h = arch.hidden_size
        if self.fused:
            self.fuse_weight = torch.nn.Parameter(torch.empty(h, len(feature_layers) * h), requires_grad=False)
            self.norm = RMSNorm(h, arch.rms_norm_eps)
        self.fc_weight = torch.nn.Parameter(torch.empty(h, 2 * h), requires_grad=False)
        self.fc_bias = torch.nn.Parameter(torch.zeros(h), requires_grad=False)
        self.layers = torch.nn.ModuleList(DecoderLayer(arch, SINGLE) for _ in range(arch.num_layers))
        self.rotary = RotaryEmbedding(arch.rope_parameters, arch.head_dim, arch.max_position_embeddings)
        self.embed_weight = torch.nn.Parameter(torch.empty(arch.vocab_size, h), requires_grad=False)
        self.subset_lm_head = torch.nn.Parameter(torch.empty(draft_vocab_size, h), requires_grad=False)
        self.vocab_subset: torch.Tensor
        self.register_buffer("vocab_subset", torch.zeros(draft_vocab_size, dtype=torch.int64))
        self.backend = TorchPagedAttention()
        self.compiled: CompiledHead | None = None  # set by compile

    def compile(self, templates: bool | None = None) -> None:
        """After loading and packing: the draft forward and logits as compiled graphs (shared/model/compiled_head.py,
        the proposer's `--compile`); `templates`: the products made by the graphs (default: where it pays)."""
        from shared.model.compiled_head import CompiledHead

        self.compiled = CompiledHead(self, templates)

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_subset.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        """The head's dtype (build_head's). Not a packed weight's: where the CPU lacks kernels for a half dtype,
        pack_weight keeps its weights as fp32 holding the same values, and `linear` rounds the products back."""
        return self.embed_weight.dtype

    @property
    def feature_width(self) -> int:
        """Values per position the verifier sends: the hidden size times the layers read."""
        return len(self.feature_layers) * self.arch.hidden_size

    @torch.inference_mode()
    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:  # [T, feature_width] -> [T, hidden]
        """The target's features of real positions -> the head's input g (EAGLE-1: the features themselves), on the
        head's device (they arrive, and are kept, on the CPU)."""
        features = features.to(device=self.embed_weight.device, dtype=self.dtype)
        if not self.fused:
            return features
        return linear(_normalized_layers(features, len(self.feature_layers)), self.fuse_weight)

    @torch.inference_mode()
    def forward(
        self,
        features: torch.Tensor,  # [T, hidden]: g_j, fused real features or the head's own state
        next_ids: torch.Tensor,  # [T]: t_{j+1}
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,  # positions are the head positions j
    ) -> torch.Tensor:  # [T, hidden]: x_j (EAGLE-1: predicted f_{j+1})
        if self.compiled is not None:
            return self.compiled(features.to(self.dtype), next_ids, kv_caches, meta)
        x = torch.cat([features.to(self.dtype), F.embedding(next_ids, self.embed_weight)], dim=-1)
        x = linear(x, self.fc_weight, self.fc_bias)
        cos, signed_sin = rotation_tables(*self.rotary(meta.positions, x.dtype))  # llama.DecoderLayer's form
        delta: torch.Tensor | None = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x, delta = layer(x, delta, cos, signed_sin, k_cache, v_cache, meta, self.backend)
        return x + delta if delta is not None else x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, draft_vocab] fp32
        if self.compiled is not None:
            return self.compiled.logits(hidden)
        return linear(self.norm(hidden) if self.fused else hidden, self.subset_lm_head).float()

    def pack_weights(self) -> None:
        """After loading: the head's weights in oneDNN's layout (parallel.pack_weight)."""
        pack_linears(self)
        for name in ("fc_weight", "subset_lm_head", *(("fuse_weight",) if self.fused else ())):
            setattr(self, name, packed_parameter(getattr(self, name).data))

    @torch.no_grad()
    def load(self, head_state: dict[str, torch.Tensor], target_embedding: torch.Tensor, target_lm_head: torch.Tensor):
        """`head_state` in the file's names (see `reference_forward`); the target's tensors [vocab, hidden]."""
        self.fc_weight.copy_(head_state["fc.weight"])
        self.fc_bias.copy_(head_state["fc.bias"])
        if self.fused:
            self.fuse_weight.copy_(head_state["fuse.weight"])
            self.norm.weight.copy_(head_state["norm.weight"])
        subset = head_state["vocab_subset"].long()
        self.vocab_subset.copy_(subset)
        self.embed_weight.copy_(target_embedding)
        self.subset_lm_head.copy_(target_lm_head[subset])
        layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        for i, layer in enumerate(layers):
            p = f"layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj.load_full_weight([head_state[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"])
            attn.o_proj.load_full_weight(head_state[f"{p}self_attn.o_proj.weight"])
            mlp.gate_up_proj.load_full_weight(
                [head_state[f"{p}mlp.gate_proj.weight"], head_state[f"{p}mlp.up_proj.weight"]]
            )
            mlp.down_proj.load_full_weight(head_state[f"{p}mlp.down_proj.weight"])
            layer.input_layernorm.weight.copy_(head_state[f"{p}input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(head_state[f"{p}post_attention_layernorm.weight"])


def init_head_state(
    arch: ModelArch, vocab_subset: torch.Tensor, seed: int = 0, feature_layers: tuple[int, ...] = FINAL_LAYER
) -> dict[str, torch.Tensor]:
    """Fresh trainable weights (fp32, requires_grad) in the file's names; norms start at 1."""
    gen = torch.Generator().manual_seed(seed)
    h, inter = arch.hidden_size, arch.intermediate_size

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).requires_grad_()

    state = {"fc.weight": normal(h, 2 * h), "fc.bias": torch.zeros(h, requires_grad=True)}
    if tuple(feature_layers) != FINAL_LAYER:
        state["fuse.weight"] = normal(h, len(feature_layers) * h)
        state["norm.weight"] = torch.ones(h, requires_grad=True)
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        state[f"{p}self_attn.q_proj.weight"] = normal(arch.q_size, h)
        state[f"{p}self_attn.k_proj.weight"] = normal(arch.kv_size, h)
        state[f"{p}self_attn.v_proj.weight"] = normal(arch.kv_size, h)
        state[f"{p}self_attn.o_proj.weight"] = normal(h, arch.q_size)
        state[f"{p}mlp.gate_proj.weight"] = normal(inter, h)
        state[f"{p}mlp.up_proj.weight"] = normal(inter, h)
        state[f"{p}mlp.down_proj.weight"] = normal(h, inter)
        state[f"{p}input_layernorm.weight"] = torch.ones(h, requires_grad=True)
        state[f"{p}post_attention_layernorm.weight"] = torch.ones(h, requires_grad=True)
    state["vocab_subset"] = vocab_subset.long()
    return state


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if weight is None else weight * x


def _normalized_layers(features: torch.Tensor, num_layers: int, eps: float = 1e-6) -> torch.Tensor:
    """[..., n * hidden] -> the same with each layer's slice RMS-normalised (no weight)."""
    split = features.unflatten(-1, (num_layers, -1))
    return _rms_norm(split, None, eps).flatten(-2)


def reference_fuse(state: dict[str, torch.Tensor], features: torch.Tensor) -> torch.Tensor:
    """[..., feature_width] real features -> [..., hidden] head input g (EAGLE-1 heads: unchanged)."""
    if "fuse.weight" not in state:
        return features
    num_layers = state["fuse.weight"].shape[1] // state["fuse.weight"].shape[0]
    return F.linear(_normalized_layers(features, num_layers), state["fuse.weight"])


def reference_logits(state: dict[str, torch.Tensor], hidden: torch.Tensor, subset_lm_head: torch.Tensor, eps: float):
    """[..., hidden] head states -> [..., draft_vocab] logits over the subset."""
    if "norm.weight" in state:
        hidden = _rms_norm(hidden, state["norm.weight"], eps)
    return hidden @ subset_lm_head.T


def decoder_layer(
    state: dict[str, torch.Tensor],
    prefix: str,
    arch: ModelArch,
    x: torch.Tensor,  # [B, S, hidden]
    cos: torch.Tensor,  # [B * S, rot_dim]
    sin: torch.Tensor,
    attend,  # (q [B, heads, S, D], k, v [B, kv_heads, S, D]) -> [B, heads, S, D]
    dropout: float = 0.0,
) -> torch.Tensor:
    """One Llama decoder layer of the head as plain differentiable torch; `attend` says who sees whom."""
    batch, seq_len, _ = x.shape
    heads, kv_heads, head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
    y = _rms_norm(x, state[f"{prefix}input_layernorm.weight"], arch.rms_norm_eps)
    q = apply_rotary(F.linear(y, state[f"{prefix}self_attn.q_proj.weight"]).view(-1, heads, head_dim), cos, sin)
    k = apply_rotary(F.linear(y, state[f"{prefix}self_attn.k_proj.weight"]).view(-1, kv_heads, head_dim), cos, sin)
    v = F.linear(y, state[f"{prefix}self_attn.v_proj.weight"]).view(batch, seq_len, kv_heads, head_dim)
    attn = attend(
        q.view(batch, seq_len, heads, head_dim).transpose(1, 2),
        k.view(batch, seq_len, kv_heads, head_dim).transpose(1, 2),
        v.transpose(1, 2),
    )  # [B, heads, S, D]
    attn_out = F.linear(attn.transpose(1, 2).reshape(batch, seq_len, -1), state[f"{prefix}self_attn.o_proj.weight"])
    x = x + F.dropout(attn_out, dropout, training=dropout > 0)
    y = _rms_norm(x, state[f"{prefix}post_attention_layernorm.weight"], arch.rms_norm_eps)
    gate, up = F.linear(y, state[f"{prefix}mlp.gate_proj.weight"]), F.linear(y, state[f"{prefix}mlp.up_proj.weight"])
    mlp_out = F.linear(F.silu(gate) * up, state[f"{prefix}mlp.down_proj.weight"])
    return x + F.dropout(mlp_out, dropout, training=dropout > 0)


def reference_forward(
    state: dict[str, torch.Tensor],
    arch: ModelArch,
    rotary: RotaryEmbedding,
    inputs: torch.Tensor,  # [B, S, hidden]: g_j at positions start..start+S-1 (reference_fuse of real features)
    next_embeds: torch.Tensor,  # [B, S, hidden]: embed(t_{j+1})
    start: int = 0,
) -> torch.Tensor:  # [B, S, hidden]: x_j
    """The head as plain differentiable torch, causal over each whole row (no cache)."""
    batch, seq_len, _ = inputs.shape
    x = F.linear(torch.cat([inputs, next_embeds], dim=-1), state["fc.weight"], state["fc.bias"])
    cos, sin = rotary(torch.arange(start, start + seq_len), x.dtype)  # [S, rot_dim]
    cos, sin = cos.repeat(batch, 1), sin.repeat(batch, 1)
    group = arch.num_heads // arch.num_kv_heads

    def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=default_scale(arch.head_dim))

    for i in range(arch.num_layers):
        x = decoder_layer(state, f"layers.{i}.", arch, x, cos, sin, causal)
    return x


def save_head(folder: str | Path, config: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
    """fp16 weights (the subset ids as int64) and config.json."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: (t.detach().long() if name == "vocab_subset" else t.detach().to(torch.float16)).contiguous()
        for name, t in state.items()
    }
    save_file(tensors, str(folder / WEIGHTS_FILE))
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def load_head_state(folder: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {
        name: t if name == "vocab_subset" else t.float()
        for name, t in load_file(str(Path(folder) / WEIGHTS_FILE)).items()
    }


def build_head(
    folder: str | Path,
    target_embedding: torch.Tensor,
    target_lm_head: torch.Tensor,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    pack: bool = True,
    attention_backend: str = "auto",
):
    """(EagleHead, its ModelArch) from a head folder and the target's embedding and LM head, its weights and
    KV cache in `dtype`; `pack`: its weights laid out for oneDNN or MKL (parallel.pack_weight), else left plain;
    `attention_backend` on the CPU as the target's runner reads it (auto: the cpu kernel where it builds)."""
    config = read_head_config(folder)
    arch = arch_from_config(config)
    if target_embedding.shape != (arch.vocab_size, arch.hidden_size):
        raise ValueError(
            f"the head was trained for a target with vocabulary {arch.vocab_size} and hidden size "
            f"{arch.hidden_size}, but the target's embedding is {tuple(target_embedding.shape)}"
        )
    layers = feature_layers_of(config)
    check_feature_layers(layers, int(config.get("target_num_layers", max(layers) + 1)))
    with torch.device("meta"):
        head = EagleHead(arch, int(config["draft_vocab_size"]), layers)
    head = head.to_empty(device=device).to(dtype)
    head.rotary = RotaryEmbedding(arch.rope_parameters, arch.head_dim, arch.max_position_embeddings).to(device)
    head.load(load_head_state(folder), target_embedding, target_lm_head)
    if torch.device(device).type == "cpu":
        # The cpu kernel where it builds, as the target's runner picks it: a draft position's states then do not
        # depend on the other sequences drafting beside it (gather + SDPA padded each to the longest context, and
        # on Zen 4 a row's fp32 attention moved with that padding: tests/unit/test_compiled_head.py).
        head.backend = select_backend(attention_backend, device, DEFAULT_BLOCK_SIZE, dtype, arch.head_dim)
    if pack:
        head.pack_weights()
    return head.eval(), arch
