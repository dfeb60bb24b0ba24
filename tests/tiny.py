"""Tiny random-weight Llama models built in memory, for fast engine and service tests."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shared.model.config import ModelArch
from shared.model.loader import build_model
from shared.model.runner import ForwardItem, ModelRunner


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


def default_width_model(dtype: torch.dtype) -> tuple[torch.nn.Module, ModelArch]:
    """A random two-layer model at the default target's widths (576 hidden, 1536 MLP, 9 heads on 3 KV heads), ours,
    in `dtype`: the shapes whose products decide whether a row's result depends on the other rows."""
    torch.manual_seed(5)
    config = tiny_config(vocab_size=256)
    config.hidden_size, config.intermediate_size = 576, 1536
    config.num_attention_heads, config.num_key_value_heads = 9, 3
    arch = ModelArch.from_hf_config(config)
    return build_model(arch, LlamaForCausalLM(config).eval().state_dict(), dtype), arch


def assert_one_token_steps_equal_scored_rows(runner: ModelRunner, beside: list[int]) -> None:
    """What speculative decoding's exactness leans on: the k + 1 rows of a scoring step give bit for bit the logits
    the one-token steps of plain decoding give, and the same again beside another sequence's `beside` tokens. The
    runner's blocks hold 4 tokens and it has at least 32 of them."""
    table, other = list(range(0, 16)), list(range(16, 32))
    prompt, other_prompt, drafts = [12, 50, 7, 19, 88, 23, 30, 6, 1, 44, 15], [9, 9, 40, 71, 3], [7, 8, 9, 10, 11]
    runner.forward([ForwardItem(table, 0, prompt, 1)])
    runner.forward([ForwardItem(other, 0, other_prompt, 1)])
    one_token_steps = [
        runner.forward([ForwardItem(table, len(prompt) + j, [token], 1)])[0][0] for j, token in enumerate(drafts)
    ]
    scored = runner.forward([ForwardItem(table, len(prompt), drafts, len(drafts))])[0]
    together = runner.forward(
        [
            ForwardItem(table, len(prompt), drafts, len(drafts)),
            ForwardItem(other, len(other_prompt), beside, len(beside)),
        ]
    )[0]
    for j, logits in enumerate(one_token_steps):
        assert torch.equal(logits, scored[j]), j
    assert torch.equal(scored, together)
