"""The sampling law with a bfloat16 target: tokens sampled through speculative decoding (truncated drafts of a
bf16 draft model, accepted and rejected) follow the law of transformers' own model running bfloat16, first and
second output token, chi-square. Negative control: the same drafts reported with a wrong draft law must fail.

A tiny model (the real target's bf16 exactness is tests/integration/test_bf16_exactness.py), so it stays cheap
enough for CI; the fp32 law tests are in test_engine.py, test_engine_truncation.py and test_eagle.py."""

from __future__ import annotations

import pytest
import torch

from shared.model.config import ModelArch
from shared.model.loader import build_model
from shared.sampling import SamplingParams
from tests.law import WrongDraftLaw, first_two_token_counts, law_pvalue, two_token_law
from tests.tiny import tiny_hf_model
from tests.unit.test_engine import VOCAB, engine_with

TEMPERATURE = 1.5


@pytest.fixture(scope="module")
def target_hf_bf16():
    return tiny_hf_model(seed=1, logit_scale=8.0).to(torch.bfloat16)


def bf16_model(hf_model):
    arch = ModelArch.from_hf_config(hf_model.config)
    return build_model(arch, hf_model.state_dict(), torch.bfloat16), arch


def _law_pvalues(target_hf_bf16, wrong_draft_law: bool, n: int) -> tuple[list[float], object]:
    target = bf16_model(target_hf_bf16)
    # The draft model is a second copy of the target, its drafts truncated to their top 8: close enough that a
    # quarter of the drafts are accepted, and claiming them uniform over their 8 ids is far off the real law.
    draft = bf16_model(target_hf_bf16)
    first, second = two_token_law(target_hf_bf16, lambda logits: torch.softmax(logits / TEMPERATURE, -1), VOCAB)
    engine = engine_with(target, draft, k=3, max_num_seqs=64, max_waiting=5000, max_model_len=16)
    engine.drafter.top_n = 8  # truncated drafts
    if wrong_draft_law:
        engine.drafter = WrongDraftLaw(engine.drafter)
    assert engine.runner.model.embed_tokens.weight.dtype == torch.bfloat16
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=4, ignore_eos=True)
    counts = first_two_token_counts(engine, n, lambda i: params, VOCAB)
    return [law_pvalue(counts[0], first, n), law_pvalue(counts[1], second, n)], engine


def test_bf16_sampled_law_matches_transformers_bf16(target_hf_bf16):
    pvalues, engine = _law_pvalues(target_hf_bf16, wrong_draft_law=False, n=3000)
    assert min(pvalues) > 1e-4, pvalues
    assert 0 < engine.stats.accepted_tokens < engine.stats.drafted_tokens  # both paths were exercised


def test_bf16_negative_control_wrong_draft_law_fails(target_hf_bf16):
    pvalues, _ = _law_pvalues(target_hf_bf16, wrong_draft_law=True, n=1500)  # fails by far (p ~ 1e-25)
    assert pvalues[1] < 1e-6, pvalues  # the second token comes from the speculative step
