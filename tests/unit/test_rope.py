"""RoPE frequencies and rotation against transformers' own implementations."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from shared.model.config import ModelArch
from shared.model.rope import RotaryEmbedding, apply_rotary, apply_rotation, rope_inv_freq, rotation_tables

LLAMA31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# (id, head_dim, max_position_embeddings, rope_parameters)
CONFIGS: list[tuple[str, int, int, dict[str, Any]]] = [
    ("default-64", 64, 2048, {"rope_type": "default", "rope_theta": 10000.0}),
    ("default-128-theta5e5", 128, 8192, {"rope_type": "default", "rope_theta": 500000.0}),
    ("default-16-theta1e6", 16, 512, {"rope_type": "default", "rope_theta": 1e6}),
    ("linear-2", 64, 4096, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    ("linear-8-hd32", 32, 4096, {"rope_type": "linear", "rope_theta": 100000.0, "factor": 8.0}),
    ("llama3.1", 128, 131072, {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA31}),
    (
        "llama3-small",  # wavelengths fall in all three bands
        16,
        512,
        {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    (
        "yarn-4",
        64,
        128,
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
    ),
    (
        "yarn-qwen-long",
        128,
        131072,
        {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768},
    ),
    (
        "yarn-betas-no-truncate",
        64,
        4096,
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 16,
            "beta_slow": 2,
            "truncate": False,
        },
    ),
    (
        "yarn-mscale",
        64,
        4096,
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 256,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
    ),
    (
        "yarn-attention-factor",
        32,
        1024,
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "original_max_position_embeddings": 512,
            "attention_factor": 0.75,
        },
    ),
]


def llama_config(head_dim: int, max_pos: int, params: dict[str, Any]) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        intermediate_size=64,
        num_hidden_layers=1,
        vocab_size=32,
        max_position_embeddings=max_pos,
        rope_parameters=dict(params),
    )


def hf_inv_freq(config: LlamaConfig) -> tuple[torch.Tensor, float]:
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config)


@pytest.mark.parametrize(("head_dim", "max_pos", "params"), [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_inv_freq_matches_transformers(head_dim: int, max_pos: int, params: dict[str, Any]) -> None:
    config = llama_config(head_dim, max_pos, params)
    expected, expected_scaling = hf_inv_freq(config)
    arch = ModelArch.from_hf_config(config)
    inv_freq, scaling = rope_inv_freq(arch.rope_parameters, arch.head_dim, arch.max_position_embeddings)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (head_dim // 2,)
    torch.testing.assert_close(inv_freq, expected, rtol=1e-6, atol=0)
    assert scaling == pytest.approx(expected_scaling, rel=1e-12)
    if params["rope_type"] != "default":  # the scaling changed something, so the comparison above has teeth
        plain = rope_inv_freq({"rope_theta": params["rope_theta"]}, head_dim, max_pos)
        assert not torch.equal(plain[0], inv_freq) or plain[1] != scaling


def test_yarn_without_original_length_uses_max_position_embeddings() -> None:
    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    config = llama_config(64, 256, params)  # transformers fills original_max_position_embeddings = 256
    expected, expected_scaling = hf_inv_freq(config)
    inv_freq, scaling = rope_inv_freq(params, 64, 256)
    torch.testing.assert_close(inv_freq, expected, rtol=1e-6, atol=0)
    assert scaling == pytest.approx(expected_scaling, rel=1e-12)


@pytest.mark.parametrize("rope_type", ["linear", "yarn"])
def test_partial_rotary_factor(rope_type: str) -> None:
    params = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 4.0, "partial_rotary_factor": 0.5}
    if rope_type == "yarn":
        params["original_max_position_embeddings"] = 64
    config = llama_config(64, 256, params)
    expected, _ = ROPE_INIT_FUNCTIONS[rope_type](config)
    inv_freq, _ = rope_inv_freq(params, 64, 256)
    assert inv_freq.shape == (16,)
    torch.testing.assert_close(inv_freq, expected, rtol=1e-6, atol=0)


def test_old_style_rope_scaling_config_is_read() -> None:
    """Configs written before transformers 5 keep rope_theta and rope_scaling {"type": ...} apart."""

    class OldConfig:  # attribute bag, as an older PretrainedConfig would present it
        model_type = "llama"
        vocab_size, hidden_size, num_hidden_layers, num_attention_heads = 32, 64, 1, 4
        intermediate_size, rms_norm_eps, max_position_embeddings = 64, 1e-5, 4096
        rope_theta = 500000.0
        rope_scaling = {"type": "linear", "factor": 4.0}

    arch = ModelArch.from_hf_config(OldConfig())
    assert arch.rope_parameters == {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0}


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "no-such-rope"])
def test_unsupported_rope_types_are_refused(rope_type: str) -> None:
    params = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match=rf"rope_type '{rope_type}' is not supported.*default, linear, llama3, yarn"):
        rope_inv_freq(params, 64, 2048)
    with pytest.raises(ValueError, match="not supported"):
        RotaryEmbedding(params, 64, 2048)


@pytest.mark.parametrize("case", ["default-64", "llama3-small", "yarn-4", "yarn-attention-factor"])
def test_cos_sin_and_rotation_match_transformers(case: str) -> None:
    _, head_dim, max_pos, params = next(c for c in CONFIGS if c[0] == case)
    config = llama_config(head_dim, max_pos, params)
    gen = torch.Generator().manual_seed(0)
    num_tokens, heads, kv_heads = 11, 4, 2
    positions = torch.randint(0, 3 * max_pos, (num_tokens,), generator=gen)  # beyond max_pos too
    q = torch.randn(num_tokens, heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)

    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(q, positions.unsqueeze(0))  # [1, T, D]
    cos, sin = RotaryEmbedding(ModelArch.from_hf_config(config).rope_parameters, head_dim, max_pos)(
        positions, torch.float32
    )
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-6)

    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    torch.testing.assert_close(apply_rotary(q, cos, sin), hf_q[0].transpose(0, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(apply_rotary(k, cos, sin), hf_k[0].transpose(0, 1), rtol=0, atol=1e-5)


def test_apply_rotary_partial_rotates_only_the_leading_dims() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 32, generator=gen)
    positions = torch.arange(5) * 7
    cos, sin = RotaryEmbedding({"rope_theta": 10000.0, "partial_rotary_factor": 0.5}, 32, 128)(positions, x.dtype)
    assert cos.shape == (5, 16)
    out = apply_rotary(x, cos, sin)
    head = x[..., :16].transpose(0, 1)[None]  # [1, heads, T, 16]
    expected, _ = apply_rotary_pos_emb(head, head, cos[None], sin[None])
    torch.testing.assert_close(out[..., :16], expected[0].transpose(0, 1), rtol=0, atol=1e-6)
    assert torch.equal(out[..., 16:], x[..., 16:])


def test_apply_rotary_preserves_norms_and_relative_angles() -> None:
    """Independent of transformers: a rotation keeps norms, and q.k depends only on the position difference."""
    gen = torch.Generator().manual_seed(2)
    rope = RotaryEmbedding({"rope_theta": 10000.0}, 16, 64)
    q, k = torch.randn(1, 1, 16, generator=gen), torch.randn(1, 1, 16, generator=gen)

    def score(pq: int, pk: int) -> float:
        cq, sq = rope(torch.tensor([pq]), torch.float32)
        ck, sk = rope(torch.tensor([pk]), torch.float32)
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum().item()

    cos, sin = rope(torch.tensor([37]), torch.float32)
    assert apply_rotary(q, cos, sin).norm().item() == pytest.approx(q.norm().item(), rel=1e-5)
    assert score(10, 3) == pytest.approx(score(107, 100), abs=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), abs=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_apply_rotation_equals_transformers_rotate_half_bit_for_bit(dtype: torch.dtype, partial: float) -> None:
    """The model's rotation (rolled halves times a sin whose first half is negated, tables made once a forward) is
    transformers' (its rotate_half's negated half times sin) to the last bit, given the same cos and sin: negation
    is exact in any float format."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 5, 64, generator=gen).to(dtype)  # [T, heads, head_dim]
    rope = RotaryEmbedding({"rope_theta": 10000.0, "partial_rotary_factor": partial}, 64, 4096)
    cos, sin = rope(torch.tensor([0, 1, 2, 3, 500, 1777, 4095]), dtype)
    rot_dim = cos.shape[-1]
    head = x[..., :rot_dim].transpose(0, 1)[None]  # [1, heads, T, rot_dim]
    expected, _ = apply_rotary_pos_emb(head, head, cos[None], sin[None])
    out = apply_rotation(x, *rotation_tables(cos, sin))
    assert not torch.equal(out, x)
    assert torch.equal(out[..., :rot_dim], expected[0].transpose(0, 1))
    assert torch.equal(out[..., rot_dim:], x[..., rot_dim:])
    assert torch.equal(apply_rotary(x, cos, sin), out)
