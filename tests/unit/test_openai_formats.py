"""The HTTP API's output formats -> StructuredOutput, through the request bodies' own parsing (pydantic, then
to_fields), for both endpoints: OpenAI's response_format, vLLM's structured_outputs and guided_* fields, and
every malformed shape as a 400 naming the field. Also the gateway's format check (gateway/format_check.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.format_check import FormatChecker
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from shared.errors import InvalidRequestError
from shared.grammar import StructuredOutput

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["b"]}
SCHEMA_TEXT = '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}},"required":["b"]}'
GBNF = 'root ::= "yes" | "no"'


def translate(fields: dict[str, Any], chat: bool) -> StructuredOutput | None:
    if chat:
        body: Any = ChatCompletionRequest.model_validate_json(
            json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields})
        )
    else:
        body = CompletionRequest.model_validate_json(json.dumps({"prompt": "hi", **fields}))
    return body.to_fields().structured_output


GOOD: list[tuple[dict[str, Any], StructuredOutput | None]] = [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}},
        StructuredOutput("json_schema", SCHEMA_TEXT),  # compact, key order kept
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
        StructuredOutput("json_schema", SCHEMA_TEXT),
    ),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json_schema", SCHEMA_TEXT)),
    ({"structured_outputs": {"json": '{"type": "integer"}'}}, StructuredOutput("json_schema", '{"type": "integer"}')),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, StructuredOutput("regex", "[0-9]{3}")),
    ({"structured_outputs": {"grammar": GBNF}}, StructuredOutput("grammar", GBNF)),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
    ({"structured_outputs": {"json_object": False}}, None),
    (
        {"structured_outputs": {"regex": "a+", "json": None, "disable_any_whitespace": True, "disable_fallback": True}},
        StructuredOutput("regex", "a+"),
    ),
    ({"guided_json": SCHEMA}, StructuredOutput("json_schema", SCHEMA_TEXT)),
    ({"guided_json": "true"}, StructuredOutput("json_schema", "true")),
    ({"guided_regex": r"\d+"}, StructuredOutput("regex", r"\d+")),
    ({"guided_grammar": "start: /[a-z]+/"}, StructuredOutput("grammar", "start: /[a-z]+/")),
    ({"response_format": {"type": "text"}, "guided_regex": "x"}, StructuredOutput("regex", "x")),
    ({"guided_decoding_backend": "xgrammar", "guided_regex": "x"}, StructuredOutput("regex", "x")),  # ignored
]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize(("fields", "expected"), GOOD)
def test_each_form_becomes_its_structured_output(fields, expected, chat):
    assert translate(fields, chat) == expected


BAD: list[tuple[dict[str, Any], str]] = [
    ({"response_format": "json"}, "response_format must be an object"),
    ({"response_format": {}}, "response_format.type must be"),
    ({"response_format": {"type": "xml"}}, "response_format.type must be 'text', 'json_object' or 'json_schema'"),
    ({"response_format": {"type": "structural_tag"}}, "structural_tag is not supported"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r"}}}, "json_schema.schema is missing"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": "{}"}}},
        "response_format.json_schema.schema must be a JSON Schema object, got str",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
        "response_format.json_schema.schema must be a JSON Schema object, got list",
    ),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}}, "json_schema.name"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
        "json_schema.strict must be true or false",
    ),
    ({"structured_outputs": "[0-9]"}, "structured_outputs must be an object"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex must be a string"),
    ({"structured_outputs": {"grammar": ["a"]}}, "structured_outputs.grammar must be a string"),
    ({"structured_outputs": {"json": 5}}, "structured_outputs.json must be a JSON Schema object (or its JSON text)"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object must be true or false"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs.choice is not supported"),
    ({"structured_outputs": {"whitespace_pattern": " *"}}, "structured_outputs.whitespace_pattern is not supported"),
    ({"structured_outputs": {"regx": "a"}}, "structured_outputs.regx is not a structured_outputs field"),
    ({"structured_outputs": {"regex": "a", "grammar": GBNF}}, "at most one output format per request, got 2"),
    ({"structured_outputs": {"regex": ""}}, "structured output regex is empty"),
    ({"guided_json": [1]}, "guided_json must be a JSON Schema object"),
    ({"guided_regex": 1}, "guided_regex must be a string"),
    ({"guided_grammar": {"a": 1}}, "guided_grammar must be a string"),
    ({"guided_choice": ["a"]}, "guided_choice is not supported"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern is not supported"),
    (
        {"response_format": {"type": "json_object"}, "guided_regex": "x"},
        "at most one output format per request, got 2: response_format, guided_regex",
    ),
    (
        {"structured_outputs": {"json_object": True}, "guided_json": {}, "guided_grammar": GBNF},
        "got 3: structured_outputs.json_object, guided_json, guided_grammar",
    ),
    ({"guided_regex": "x" * (256 * 1024 + 1)}, "structured output regex is longer than"),
]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize(("fields", "words"), BAD)
def test_each_malformed_form_is_a_clear_invalid_request(fields, words, chat):
    with pytest.raises(InvalidRequestError) as info:
        checked = translate(fields, chat)
        assert checked is not None
        checked.validate()  # the length and emptiness checks: SamplingParams.validate in check_fields
    assert words in str(info.value)


def test_the_format_check_gives_the_compilers_message_and_caches(tokenizer):
    checker = FormatChecker(tokenizer)
    checker.check(StructuredOutput("json_schema", SCHEMA_TEXT))
    checker.check(StructuredOutput("grammar", GBNF))
    for constraint, words in [
        (StructuredOutput("json_schema", '{"type": "integr"}'), "invalid json_schema: Invalid type: integr"),
        (StructuredOutput("regex", "[0-9"), "unclosed character class"),
        (StructuredOutput("grammar", "root ::= missing"), "invalid grammar:"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            checker.check(constraint)
        assert words in str(info.value)
    compiler = checker._get_compiler()
    assert compiler is not None and compiler is checker._get_compiler()  # built once
    assert StructuredOutput("grammar", GBNF) in compiler._cache


def test_a_tokenizer_llguidance_cannot_read_leaves_the_check_to_the_verifiers():
    class NoVocabulary:
        eos_token_id = 0

        def __len__(self) -> int:
            return 10

    checker = FormatChecker(NoVocabulary())
    checker.check(StructuredOutput("regex", "[0-9"))  # passes through: the verifier compiles and refuses it
    assert checker._get_compiler() is None
