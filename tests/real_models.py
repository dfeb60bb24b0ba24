"""Real default models, loaded once per test session, and transformers' greedy reference outputs.

Imported by tests/conftest.py so integration and end-to-end tests share one set of references."""

from __future__ import annotations

import pytest
import torch

from shared.model.loader import load_hf_model, load_model, load_tokenizer
from shared.settings import default_draft_model, default_target_model
from tests.prompts import encode_prompts

MAX_NEW_TOKENS = 128


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(default_target_model())


@pytest.fixture(scope="session")
def target():
    return load_model(default_target_model())


@pytest.fixture(scope="session")
def draft():
    return load_model(default_draft_model())


@pytest.fixture(scope="session")
def hf_target():
    """transformers' own model of the target: the reference for greedy outputs and logprobs."""
    return load_hf_model(default_target_model())


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    return encode_prompts(tokenizer)


@pytest.fixture(scope="session")
def greedy_references(prompts) -> list[list[int]]:
    """transformers' greedy `generate` of the target alone, one prompt at a time (no padding)."""
    hf = load_hf_model(default_target_model())
    refs = []
    for ids in prompts:
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        refs.append(out[0, len(ids) :].tolist())
    del hf
    return refs
