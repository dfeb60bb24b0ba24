"""Our Llama-family forward over a paged KV cache (RMSNorm, RoPE, GQA, SwiGLU, tied or untied head).

All per-step state (positions, slots, block tables) arrives in `AttentionMetadata`; the module keeps
none, so one instance serves every batch shape, and tensor parallelism only changes the layers in
`parallel.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from shared.model import small_ops
from shared.model.attention import AttentionMetadata, TorchPagedAttention, default_scale, paged_attention, write_kv
from shared.model.config import ModelArch
from shared.model.parallel import (
    SINGLE,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    linear,
    pack_linears,
    pack_weight,
)
from shared.model.rope import RotaryEmbedding, apply_rotation, rotation_tables

if TYPE_CHECKING:
    from shared.model.compiled import CompiledForward


class Embedding(torch.nn.Module):
    """A [vocab, hidden] table used as the embedding and, untied, as the LM head. No random init: weights
    always come from a checkpoint, and nn.Embedding's init pulls in torch._dynamo (seconds at start-up)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if small_ops.takes_norm(x, self.weight):  # one call instead of six ops in the eager forward
            return small_ops.rms_norm(x, self.weight, self.eps)
        # Normalise in fp32 whatever the storage dtype, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm), the same bits as the add then the norm; one call where the kernel runs."""
        if delta is None:
            return x, self(x)
        if small_ops.takes_add_norm(x, delta, self.weight):
            return small_ops.add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self(x)


class Attention(torch.nn.Module):
    def __init__(self, arch: ModelArch, tp: TensorParallel) -> None:
        super().__init__()
        self.num_heads = tp.shard(arch.num_heads, "attention heads")
        # Fewer KV heads than ranks: each rank holds one KV head, replicated on world_size / kv_heads ranks,
        # and its query heads are exactly the ones that use that KV head.
        kv_replicas = tp.kv_head_replicas(arch.num_kv_heads)
        self.num_kv_heads = tp.local_kv_heads(arch.num_kv_heads)
        self.head_dim = arch.head_dim
        self.scale = default_scale(arch.head_dim)
        self.qkv_proj = ColumnParallelLinear(
            arch.hidden_size,
            [arch.q_size, arch.kv_size, arch.kv_size],
            arch.attention_bias,
            tp,
            replicas=[1, kv_replicas, kv_replicas],
        )
        self.o_proj = RowParallelLinear(arch.q_size, arch.hidden_size, arch.attention_bias, tp)

    def forward(self, x, cos, signed_sin, k_cache, v_cache, meta: AttentionMetadata, backend) -> torch.Tensor:
        """cos, signed_sin [T, 1, rot_dim]: rope.rotation_tables' tables."""
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, (H + 2 kv_heads) * D]
        if small_ops.takes_rotation(qkv, cos, k_cache, v_cache):  # the same bits as the ops below, in one call
            q = small_ops.rotate_and_store(qkv, cos, signed_sin, heads, k_cache, v_cache, meta.slot_mapping)
        else:
            qk, v = qkv.split([(heads + kv_heads) * head_dim, kv_heads * head_dim], dim=-1)
            # Queries and keys rotated in one call: half the small ops of a decode step's rotary
            qk = apply_rotation(qk.view(-1, heads + kv_heads, head_dim), cos, signed_sin)  # [T, H + kv_heads, D]
            q, k = qk[:, :heads], qk[:, heads:]  # [T, H, D], [T, kv_heads, D]
            write_kv(k_cache, v_cache, k, v.view(-1, kv_heads, head_dim), meta)
        out = paged_attention(backend, q, k_cache, v_cache, meta, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(out.shape[0], -1))


class MLP(torch.nn.Module):
    def __init__(self, arch: ModelArch, tp: TensorParallel) -> None:
        super().__init__()
        self.inter = tp.shard(arch.intermediate_size, "MLP intermediate size")
        self.gate_up_proj = ColumnParallelLinear(
            arch.hidden_size, [arch.intermediate_size, arch.intermediate_size], arch.mlp_bias, tp
        )
        self.down_proj = RowParallelLinear(arch.intermediate_size, arch.hidden_size, arch.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 inter]
        if small_ops.takes_silu(gate_up):  # one call instead of a split, a SiLU and a multiply
            return self.down_proj(small_ops.silu_mul(gate_up, self.inter))
        gate, up = gate_up.split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(torch.nn.Module):
    def __init__(self, arch: ModelArch, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch, tp)

    def forward(self, x, delta, cos, signed_sin, k_cache, v_cache, meta, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream in as x + delta (delta None: x alone), out the same way: each residual add runs with
        the norm after it (add_and_norm), the last one with the next layer's first norm."""
        x, normed = self.input_layernorm.add_and_norm(x, delta)
        x, normed = self.post_attention_layernorm.add_and_norm(
            x, self.self_attn(normed, cos, signed_sin, k_cache, v_cache, meta, backend)
        )
        return x, self.mlp(normed)


class LlamaModel(torch.nn.Module):
    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp
        # Embedding and LM head are replicated: at 49k x 576 they are small next to the blocks, and
        # replication keeps the sampler's full-vocabulary logits free of an extra all-gather.
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = torch.nn.ModuleList(DecoderLayer(arch, tp) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = RotaryEmbedding(arch.rope_parameters, arch.head_dim, arch.max_position_embeddings)
        self.lm_head = None if arch.tie_word_embeddings else Embedding(arch.vocab_size, arch.hidden_size)
        self.backend = TorchPagedAttention()
        self.packed_lm_head: torch.Tensor | None = None  # set by pack_weights
        self.compiled: CompiledForward | None = None  # set by compile

    def compile(self, templates: bool | None = None) -> None:
        """After loading and packing: the forward as one compiled graph (shared/model/compiled.py, `--compile`);
        `templates`: the products made by the graph itself (default: where `products_in_graph` says it pays)."""
        from shared.model.compiled import CompiledForward

        self.compiled = CompiledForward(self, templates)

    def pack_weights(self) -> None:
        """After loading: every linear weight in oneDNN's layout (parallel.pack_weight). The LM head is packed
        as a copy, since the embedding (tied) and the EAGLE head still read its plain rows."""
        pack_linears(self)
        packed = pack_weight(self.lm_head_weight)
        self.packed_lm_head = packed if packed is not self.lm_head_weight else None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: [num_blocks, block_size, kv_heads, D] x2
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        return self.forward_with_layers(input_ids, kv_caches, meta, ())[0]

    @torch.inference_mode()
    def forward_with_layers(
        self,
        input_ids: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        layers: tuple[int, ...],  # decoder layer i: its output (the residual stream); -1: the final normed state
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [T, hidden], [T, len(layers) * hidden] or None
        """The final normed hidden states and, concatenated in `layers`' order, those of the given layers: the
        features an EAGLE-3-style head reads (a low, a middle and a high layer), from the same pass."""
        if self.compiled is not None:
            return self.compiled(input_ids, kv_caches, meta, layers)
        x = self.embed_tokens(input_ids)
        cos, signed_sin = rotation_tables(*self.rotary(meta.positions, x.dtype))  # [T, 1, rot_dim] x2
        captured: dict[int, torch.Tensor] = {}
        delta: torch.Tensor | None = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, delta = layer(x, delta, cos, signed_sin, k_cache, v_cache, meta, self.backend)
            if i in layers:
                captured[i] = x + delta
        final = self.norm.add_and_norm(x, delta)[1]
        captured[-1] = final
        return final, torch.cat([captured[i] for i in layers], dim=-1) if layers else None

    @property
    def lm_head_weight(self) -> torch.Tensor:  # [vocab, hidden]
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] fp32
        if self.compiled is not None and self.compiled.templates:
            return self.compiled.logits(hidden)
        weight = self.lm_head_weight if self.packed_lm_head is None else self.packed_lm_head
        return linear(hidden, weight).float()

    @torch.no_grad()
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load from transformers' LlamaForCausalLM parameter names (full, unsharded tensors)."""
        get = state.__getitem__
        self.embed_tokens.weight.copy_(get("model.embed_tokens.weight"))
        self.norm.weight.copy_(get("model.norm.weight"))
        if self.lm_head is not None:
            self.lm_head.weight.copy_(get("lm_head.weight"))
        layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        for i, layer in enumerate(layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [get(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
            qkv_bias = [get(f"{p}self_attn.{n}_proj.bias") for n in "qkv"] if attn.qkv_proj.bias is not None else None
            attn.qkv_proj.load_full_weight(qkv, qkv_bias)
            attn.o_proj.load_full_weight(get(f"{p}self_attn.o_proj.weight"), state.get(f"{p}self_attn.o_proj.bias"))
            gate_up = [get(f"{p}mlp.gate_proj.weight"), get(f"{p}mlp.up_proj.weight")]
            gate_up_bias = None
            if mlp.gate_up_proj.bias is not None:
                gate_up_bias = [get(f"{p}mlp.gate_proj.bias"), get(f"{p}mlp.up_proj.bias")]
            mlp.gate_up_proj.load_full_weight(gate_up, gate_up_bias)
            mlp.down_proj.load_full_weight(get(f"{p}mlp.down_proj.weight"), state.get(f"{p}mlp.down_proj.bias"))
            layer.input_layernorm.weight.copy_(get(f"{p}input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(get(f"{p}post_attention_layernorm.weight"))
