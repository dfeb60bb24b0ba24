"""Tiny random-weight Llama models built in memory, for fast engine and service tests."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shared.model.config import ModelArch
from shared.model.loader import build_model


def tiny_config(vocab_size: int = 96, layers: int = 2, seed_offset: int = 0) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        eos_token_id=vocab_size - 1,
        bos_token_id=0,
        pad_token_id=0,
    )


def tiny_hf_model(seed: int, vocab_size: int = 96, layers: int = 2, logit_scale: float = 1.0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(vocab_size, layers)).eval()
    with torch.no_grad():
        # Random init gives near-uniform logits; sharpen them so greedy choices have clear margins.
        model.lm_head.weight.mul_(logit_scale)
    return model


def ours(hf_model: LlamaForCausalLM):
    arch = ModelArch.from_hf_config(hf_model.config)
    return build_model(arch, hf_model.state_dict()), arch


def hf_greedy(hf_model: LlamaForCausalLM, prompt: list[int], max_new_tokens: int, eos: bool = True) -> list[int]:
    kwargs = {} if eos else {"eos_token_id": None}
    out = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kwargs
    )
    return out[0, len(prompt) :].tolist()


# The engine tests' pair, module-scoped: `from tests.tiny import tiny_target_hf, tiny_target, tiny_weak_draft` in a
# test module gives it the fixtures target_hf, target and weak_draft (shadowing the real-model ones there only).
@pytest.fixture(scope="module", name="target_hf")
def tiny_target_hf() -> LlamaForCausalLM:
    return tiny_hf_model(seed=1, logit_scale=8.0)


@pytest.fixture(scope="module", name="target")
def tiny_target(target_hf: LlamaForCausalLM):
    return ours(target_hf)


@pytest.fixture(scope="module", name="weak_draft")
def tiny_weak_draft():
    return ours(tiny_hf_model(seed=2, layers=1, logit_scale=8.0))
