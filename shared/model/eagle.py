"""EAGLE-style draft head (Li et al. 2024) with a frequency-ranked vocabulary subset (FR-Spec, Zhao et al. 2025).

At head position j the input is [f_j ; embed(t_{j+1})]: the target's final hidden state after reading
tokens[: j + 1] and the embedding of the token that followed. fc (2h -> h) and Llama decoder layer(s) turn it
into a prediction of f_{j+1}; the target's own LM head, restricted to the subset, turns that into logits for
t_{j+2}. Drafting feeds the head its own predicted features after the last real one.

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
from typing import Any

import torch
import torch.nn.functional as F

from shared.model.attention import AttentionMetadata, TorchPagedAttention, default_scale
from shared.model.config import ModelArch
from shared.model.llama import DecoderLayer
from shared.model.parallel import SINGLE, linear, pack_linears, pack_weight
from shared.model.rope import RotaryEmbedding, apply_rotary

HEAD_ARCHITECTURE = "SpecdecEagleHead"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def head_config(target_arch: ModelArch, num_layers: int, draft_vocab_size: int, **extra: Any) -> dict[str, Any]:
    """config.json of a head for `target_arch`: its layers have the target's shape."""
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
        **extra,
    }


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

    def __init__(self, arch: ModelArch, draft_vocab_size: int) -> None:
        super().__init__()
        self.arch = arch
        h = arch.hidden_size
        self.fc_weight = torch.nn.Parameter(torch.empty(h, 2 * h), requires_grad=False)
        self.fc_bias = torch.nn.Parameter(torch.zeros(h), requires_grad=False)
        self.layers = torch.nn.ModuleList(DecoderLayer(arch, SINGLE) for _ in range(arch.num_layers))
        self.rotary = RotaryEmbedding(arch.rope_parameters, arch.head_dim, arch.max_position_embeddings)
        self.embed_weight = torch.nn.Parameter(torch.empty(arch.vocab_size, h), requires_grad=False)
        self.subset_lm_head = torch.nn.Parameter(torch.empty(draft_vocab_size, h), requires_grad=False)
        self.vocab_subset: torch.Tensor
        self.register_buffer("vocab_subset", torch.zeros(draft_vocab_size, dtype=torch.int64))
        self.backend = TorchPagedAttention()

    @property
    def draft_vocab_size(self) -> int:
        return self.subset_lm_head.shape[0]

    @torch.inference_mode()
    def forward(
        self,
        features: torch.Tensor,  # [T, hidden]: f_j, real or predicted
        next_ids: torch.Tensor,  # [T]: t_{j+1}
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,  # positions are the head positions j
    ) -> torch.Tensor:  # [T, hidden]: predicted f_{j+1}
        x = torch.cat([features.to(self.fc_weight.dtype), F.embedding(next_ids, self.embed_weight)], dim=-1)
        x = linear(x, self.fc_weight, self.fc_bias)
        cos, sin = self.rotary(meta.positions, x.dtype)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, k_cache, v_cache, meta, self.backend)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, draft_vocab] fp32
        return linear(hidden, self.subset_lm_head).float()

    def pack_weights(self) -> None:
        """After loading: the head's weights in oneDNN's layout (parallel.pack_weight)."""
        pack_linears(self)
        for name in ("fc_weight", "subset_lm_head"):
            setattr(self, name, torch.nn.Parameter(pack_weight(getattr(self, name).data), requires_grad=False))

    @torch.no_grad()
    def load(self, head_state: dict[str, torch.Tensor], target_embedding: torch.Tensor, target_lm_head: torch.Tensor):
        """`head_state` in the file's names (see `reference_forward`); the target's tensors [vocab, hidden]."""
        self.fc_weight.copy_(head_state["fc.weight"])
        self.fc_bias.copy_(head_state["fc.bias"])
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


def init_head_state(arch: ModelArch, vocab_subset: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
    """Fresh trainable weights (fp32, requires_grad) in the file's names; norms start at 1."""
    gen = torch.Generator().manual_seed(seed)
    h, inter = arch.hidden_size, arch.intermediate_size

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).requires_grad_()

    state = {"fc.weight": normal(h, 2 * h), "fc.bias": torch.zeros(h, requires_grad=True)}
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


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_forward(
    state: dict[str, torch.Tensor],
    arch: ModelArch,
    rotary: RotaryEmbedding,
    features: torch.Tensor,  # [B, S, hidden]: f_j at positions start..start+S-1
    next_embeds: torch.Tensor,  # [B, S, hidden]: embed(t_{j+1})
    start: int = 0,
) -> torch.Tensor:  # [B, S, hidden]: predicted f_{j+1}
    """The head as plain differentiable torch, causal over each whole row (no cache)."""
    batch, seq_len, _ = features.shape
    x = F.linear(torch.cat([features, next_embeds], dim=-1), state["fc.weight"], state["fc.bias"])
    cos, sin = rotary(torch.arange(start, start + seq_len), x.dtype)  # [S, rot_dim]
    heads, kv_heads, head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        y = _rms_norm(x, state[f"{p}input_layernorm.weight"], arch.rms_norm_eps)
        q = F.linear(y, state[f"{p}self_attn.q_proj.weight"]).view(batch * seq_len, heads, head_dim)
        k = F.linear(y, state[f"{p}self_attn.k_proj.weight"]).view(batch * seq_len, kv_heads, head_dim)
        v = F.linear(y, state[f"{p}self_attn.v_proj.weight"]).view(batch, seq_len, kv_heads, head_dim)
        q = apply_rotary(q, cos.repeat(batch, 1), sin.repeat(batch, 1)).view(batch, seq_len, heads, head_dim)
        k = apply_rotary(k, cos.repeat(batch, 1), sin.repeat(batch, 1)).view(batch, seq_len, kv_heads, head_dim)
        group = heads // kv_heads
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=default_scale(head_dim)
        )  # [B, heads, S, D]
        x = x + F.linear(attn.transpose(1, 2).reshape(batch, seq_len, -1), state[f"{p}self_attn.o_proj.weight"])
        y = _rms_norm(x, state[f"{p}post_attention_layernorm.weight"], arch.rms_norm_eps)
        gate, up = F.linear(y, state[f"{p}mlp.gate_proj.weight"]), F.linear(y, state[f"{p}mlp.up_proj.weight"])
        x = x + F.linear(F.silu(gate) * up, state[f"{p}mlp.down_proj.weight"])
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


def build_head(folder: str | Path, target_embedding: torch.Tensor, target_lm_head: torch.Tensor, device: str = "cpu"):
    """(EagleHead, its ModelArch) from a head folder and the target's embedding and LM head."""
    config = read_head_config(folder)
    arch = arch_from_config(config)
    if target_embedding.shape != (arch.vocab_size, arch.hidden_size):
        raise ValueError(
            f"the head was trained for a target with vocabulary {arch.vocab_size} and hidden size "
            f"{arch.hidden_size}, but the target's embedding is {tuple(target_embedding.shape)}"
        )
    with torch.device("meta"):
        head = EagleHead(arch, int(config["draft_vocab_size"]))
    head = head.to_empty(device=device)
    head.rotary = RotaryEmbedding(arch.rope_parameters, arch.head_dim, arch.max_position_embeddings).to(device)
    head.load(load_head_state(folder), target_embedding, target_lm_head)
    head.pack_weights()
    return head.eval(), arch
