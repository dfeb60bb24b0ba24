"""Structured output on the real models: greedy output token for token equal to transformers' greedy generation
with the same grammar engine's logits processor, with no drafter, the n-gram drafter and the draft model, at
batch 1 and in a mixed batch of 8 where constrained and free requests share the batch; and 200 sampled (T = 1,
seeded) JSON outputs that all validate against their schema.

Every (drafter, k) runs at batch 1 (one case of each format; every case under SPECDEC_FULL_MATRIX=1, `make
test-full`); in the mixed batch of 8 the target alone and one k of each drafter (every k under the full matrix).
The same matrix on tiny models: tests/unit/test_structured_engine.py."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
import torch

from proposer_service.ngram import NgramDrafter
from shared.drafting import Drafter
from shared.grammar import GrammarLogitsProcessor, StructuredOutput
from shared.model.build import CacheConfig
from shared.sampling import SamplingParams
from specdec_local.builder import build_engine, enable_structured_output, make_draft_model_drafter
from tests.prompts import CHAT_PROMPTS
from tests.unit.test_structured_engine import run_params
from verifier_service.engine import Engine, EngineConfig

pytestmark = pytest.mark.slow
FULL_MATRIX = os.environ.get("SPECDEC_FULL_MATRIX") == "1"
MAX_TOKENS = 48

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 16},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
FORMATS = {
    "json_schema": StructuredOutput("json_schema", json.dumps(PERSON)),
    "regex": StructuredOutput("regex", r"(Yes|No), because [a-z ,]{10,60}\."),
    "grammar": StructuredOutput("grammar", 'start: item (", " item)+ "."\nitem: /[A-Z][a-z]{2,12}/'),
}
QUESTIONS = {
    "json_schema": ["Describe a famous scientist as JSON.", "Invent a character for a story, as JSON."],
    "regex": ["Is the sea salty?", "Can cats swim?"],
    "grammar": ["Name some planets.", "List a few fruits."],
}
CASES = [(fmt, q) for fmt, qs in QUESTIONS.items() for q in qs]  # 6 constrained requests


@pytest.fixture(scope="module")
def grammar(tokenizer, target):
    """The compiler the reference's logits processor uses (the engine builds its own the same way)."""
    from shared.grammar import GrammarCompiler

    arch = target[1]
    return GrammarCompiler(tokenizer, arch.vocab_size, arch.eos_token_ids)


def chat(tokenizer, text: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def constrained_cases(tokenizer, hf_target, grammar):
    """(prompt, format, transformers' constrained greedy output) per case."""
    cases = []
    for fmt, question in CASES:
        prompt = chat(tokenizer, question)
        processor = GrammarLogitsProcessor(grammar, [FORMATS[fmt]], len(prompt))
        with torch.no_grad():
            out = hf_target.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, logits_processor=[processor]
            )
        cases.append((prompt, FORMATS[fmt], out[0, len(prompt) :].tolist()))
    return cases


def make(target, draft, tokenizer, kind: str, k: int, max_num_seqs: int) -> Engine:
    config = EngineConfig(num_speculative_tokens=k, max_num_seqs=max_num_seqs, max_model_len=1024, adaptive_k=False)
    drafter: Drafter | None = None
    if kind == "ngram":
        drafter = NgramDrafter()
    elif kind == "draft":
        drafter = make_draft_model_drafter(*draft, config, CacheConfig())
    engine = build_engine(target, drafter, config, CacheConfig(block_size=16))
    enable_structured_output(engine, tokenizer)  # the verifier's masks and the drafter's
    return engine


COMBOS = [("none", 0)] + [(kind, k) for kind in ("ngram", "draft") for k in (1, 3, 5)]


def batch1_assignment() -> list[tuple[str, int, list[int]]]:
    """Every combination with one case of each format (JSON schema, regex, grammar); every case under the full
    matrix."""
    if FULL_MATRIX:
        return [(kind, k, list(range(len(CASES)))) for kind, k in COMBOS]
    return [(kind, k, [c % 2, 2 + c % 2, 4 + c % 2]) for c, (kind, k) in enumerate(COMBOS)]


@pytest.mark.parametrize(("kind", "k", "cases"), batch1_assignment())
def test_batch_1(target, draft, tokenizer, constrained_cases, kind, k, cases):
    engine = make(target, draft, tokenizer, kind, k, max_num_seqs=1)
    for c in cases:
        prompt, fmt, ref = constrained_cases[c]
        outs = run_params(engine, {"r": (prompt, SamplingParams(max_tokens=MAX_TOKENS, structured_output=fmt))})
        assert outs["r"] == ref, f"{kind} k={k} case {CASES[c]}"
    if kind != "none":
        assert engine.stats.drafted_tokens > 0  # constrained requests were drafted for


# At batch 8 in CI: the target alone and one k of each drafter (every k at batch 1 above); all under the full matrix.
BATCH8_COMBOS = COMBOS if FULL_MATRIX else [("none", 0), ("ngram", 3), ("draft", 3)]


@pytest.mark.parametrize(("kind", "k"), BATCH8_COMBOS)
def test_mixed_batch_of_8(target, draft, tokenizer, constrained_cases, prompts, greedy_references, kind, k):
    """6 constrained requests (3 formats) and 2 free ones in one batch of 8."""
    engine = make(target, draft, tokenizer, kind, k, max_num_seqs=8)
    requests = {
        f"c{i}": (prompt, SamplingParams(max_tokens=MAX_TOKENS, structured_output=fmt))
        for i, (prompt, fmt, _) in enumerate(constrained_cases)
    }
    requests.update({f"free{i}": (prompts[i], SamplingParams(max_tokens=MAX_TOKENS)) for i in (0, 1)})
    outs = run_params(engine, requests)
    for i, (_, _, ref) in enumerate(constrained_cases):
        assert outs[f"c{i}"] == ref, f"{kind} k={k} batch 8, case {CASES[i]}"
    for i in (0, 1):
        assert outs[f"free{i}"] == greedy_references[i][:MAX_TOKENS], f"{kind} k={k} batch 8, free prompt {i}"
    assert (engine.stats.drafted_tokens > 0) == (kind != "none")
    text = tokenizer.decode(outs["c0"], skip_special_tokens=True)
    assert set(json.loads(text)) == {"name", "age", "city"}, text


SCHEMAS = [  # bounded: at T = 1 an unbounded number or an open object could run past max_tokens
    PERSON,
    {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no", "maybe"]},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        },
        "required": ["answer", "confidence"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "count": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["ok", "count"],
        "additionalProperties": False,
    },
]


def test_200_sampled_outputs_validate_against_their_schema(target, draft, tokenizer):
    """T = 1, seeded, n-gram drafter at k = 3 (JSON repeats its keys): every one of 200 outputs is complete JSON
    valid under its schema."""
    arch = target[1]
    engine = make(target, draft, tokenizer, "ngram", 3, max_num_seqs=64)
    questions = [q for qs in QUESTIONS.values() for q in qs] + CHAT_PROMPTS[:4]
    requests = {}
    for i in range(200):
        schema = SCHEMAS[i % len(SCHEMAS)]
        params = SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=96,
            structured_output=StructuredOutput("json_schema", json.dumps(schema)),
        )
        requests[str(i)] = (chat(tokenizer, questions[i % len(questions)]), params)
    outs = run_params(engine, requests)
    assert len(outs) == 200
    eos = set(arch.eos_token_ids)
    for i, ids in outs.items():
        assert ids[-1] in eos, f"request {i} hit max_tokens before its JSON ended"
        document = json.loads(tokenizer.decode(ids, skip_special_tokens=True))
        jsonschema.validate(document, SCHEMAS[int(i) % len(SCHEMAS)])
    assert engine.stats.accepted_tokens > 0
