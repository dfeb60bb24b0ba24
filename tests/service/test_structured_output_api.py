"""Output formats on both public APIs, against a real gateway in front of a FAKE (recording) verifier
(tests/service/test_gateway.py): each form reaches the verifier as the StructuredOutput in its SamplingParams,
and a schema, regex or grammar that does not compile is refused before routing (INVALID_ARGUMENT / HTTP 400,
the compiler's message) while a good stream on the same gateway goes on. What the output looks like under a
format is the verifier's to enforce; the fake streams the same tokens either way."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import httpx
import openai
import pytest

from shared.grammar import StructuredOutput
from shared.proto_convert import structured_output_from_proto
from shared.proto_gen.specdec.v1 import common_pb2, gateway_pb2, verifier_pb2
from tests.service.test_gateway import Harness, counting, expect_error, free_port, joined, start_fake
from tests.service.test_openai_errors import MODEL, assert_error

pytestmark = pytest.mark.timeout(90)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))
GBNF = 'root ::= "yes" | "no"'
# (format, what the compiler says about it)
BAD_FORMATS: list[tuple[StructuredOutput, str]] = [
    (StructuredOutput("json_schema", '{"type": "integr"}'), "invalid json_schema: Invalid type: integr"),
    (StructuredOutput("json_schema", '{"type": "object"'), "invalid json_schema: not JSON"),
    (StructuredOutput("regex", "[0-9"), "unclosed character class"),
    (StructuredOutput("regex", "(?<=a)b"), "look-around"),
    (StructuredOutput("grammar", "root ::= missing"), "invalid grammar: Rule 'missing' not found"),
    (StructuredOutput("grammar", "start: x y"), 'unknown name: "x"'),
]


def run(coro: Any) -> None:
    asyncio.run(coro)


def sent_format(request: verifier_pb2.VerifierGenerateRequest) -> StructuredOutput | None:
    params = request.sampling_params
    return structured_output_from_proto(params.structured_output) if params.HasField("structured_output") else None


def grpc_format(constraint: StructuredOutput) -> common_pb2.StructuredOutput:
    if constraint.kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    return common_pb2.StructuredOutput(**{constraint.kind: constraint.spec})


def test_grpc_formats_reach_the_verifier_and_bad_ones_are_refused_before_routing(tokenizer):
    good = [
        StructuredOutput("json_schema", SCHEMA_TEXT),
        StructuredOutput("json_object"),
        StructuredOutput("regex", "[0-9]{3}"),
        StructuredOutput("grammar", GBNF),
    ]

    async def scenario() -> None:
        release = asyncio.Event()  # the stream's last message waits for it: still running, however slow the host
        fs = await start_fake(delay=0.01, hold=release)
        async with Harness(tokenizer, [fs]) as h:
            # A stream with a format runs on while bad formats are refused beside it.
            running = asyncio.create_task(
                h.generate(prompt_token_ids=[1, 2], max_tokens=40, structured_output=grpc_format(good[0]))
            )
            while not fs.fake.requests:
                await asyncio.sleep(0.01)
            for constraint, words in BAD_FORMATS:
                bad = grpc_format(constraint)
                await expect_error(
                    h.generate(prompt="hi", structured_output=bad), grpc.StatusCode.INVALID_ARGUMENT, words
                )
                await expect_error(
                    h.stub.Complete(gateway_pb2.CompleteRequest(prompt="hi", structured_output=bad)),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    words,
                )
            await expect_error(
                h.generate(prompt="hi", structured_output=common_pb2.StructuredOutput(regex="")),
                grpc.StatusCode.INVALID_ARGUMENT,
                "structured output regex is empty",
            )
            assert not running.done() and fs.fake.active == 1
            release.set()
            assert joined(await running)[0] == counting(2, 40)
            assert len(fs.fake.requests) == 1  # no bad format reached the verifier

            for constraint in good[1:]:
                reply = await h.stub.Complete(
                    gateway_pb2.CompleteRequest(prompt="hi", max_tokens=4, structured_output=grpc_format(constraint))
                )
                assert reply.usage.completion_tokens == 4
            await h.generate(
                prompt="hi", max_tokens=2, structured_output=common_pb2.StructuredOutput(json_object=False)
            )
            await h.generate(prompt="hi", max_tokens=2)
            assert [sent_format(r) for r in fs.fake.requests] == [*good, None, None]

    run(scenario())


def test_http_formats_reach_the_verifier_and_bad_ones_are_400_with_the_compilers_message(tokenizer):
    chat = [{"role": "user", "content": "Who are you?"}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}

    async def scenario() -> None:
        fs = await start_fake(delay=0.05)
        harness = Harness(tokenizer, [fs], http_port=free_port(), served_model_name=MODEL)
        async with harness as h, httpx.AsyncClient(base_url=h.gateway.http_url) as http:
            body = {
                "model": MODEL,
                "messages": chat,
                "max_tokens": 40,
                "stream": True,
                "response_format": schema_format,
            }
            async with http.stream("POST", "/v1/chat/completions", json=body) as stream:
                assert stream.status_code == 200
                lines = stream.aiter_lines()
                assert (await anext(lines)).startswith("data: ")  # streaming: its verifier call is open
                for constraint, words in BAD_FORMATS:
                    for path, fields in (
                        ("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": chat, "stream": True}),
                    ):
                        bad = {"model": MODEL, **fields, **http_format(constraint)}
                        assert_error(await http.post(path, json=bad), 400, "invalid_request_error", words)
                assert fs.fake.active == 1  # the good stream's verifier call is still open
                rest = [line async for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            finish_reasons = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in rest[:-1]]
            assert finish_reasons[-1] == "length" and len(fs.fake.requests) == 1
            assert sent_format(fs.fake.requests[0]) == StructuredOutput("json_schema", SCHEMA_TEXT)

            # the openai client: response_format, and vLLM's fields through extra_body
            client = openai.AsyncOpenAI(base_url=h.gateway.http_url + "/v1", api_key="unused", max_retries=0)
            reply = await client.chat.completions.create(
                model=MODEL, messages=chat, max_tokens=4, response_format={"type": "json_object"}
            )
            assert reply.choices[0].finish_reason == "length"
            await client.completions.create(
                model=MODEL, prompt="hi", max_tokens=4, extra_body={"structured_outputs": {"regex": "[0-9]{3}"}}
            )
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body={"guided_grammar": GBNF})
            await client.chat.completions.create(
                model=MODEL, messages=chat, max_tokens=4, extra_body={"guided_json": SCHEMA}
            )
            assert [sent_format(r) for r in fs.fake.requests[1:]] == [
                StructuredOutput("json_object"),
                StructuredOutput("regex", "[0-9]{3}"),
                StructuredOutput("grammar", GBNF),
                StructuredOutput("json_schema", SCHEMA_TEXT),
            ]
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(
                    model=MODEL,
                    messages=chat,
                    response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integr"}}},
                )
            assert "Invalid type: integr" in info.value.message
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(
                    model=MODEL,
                    prompt="hi",
                    extra_body={"response_format": {"type": "json_object"}, "guided_regex": "[0-9]+"},
                )
            assert "at most one output format per request" in info.value.message
            assert len(fs.fake.requests) == 5

    run(scenario())


def http_format(constraint: StructuredOutput) -> dict[str, Any]:
    """The HTTP form of a format: JSON schemas as OpenAI's response_format (the schema as an object when it
    parses, else vLLM's JSON-text form), regexes and grammars as vLLM's structured_outputs."""
    if constraint.kind == "json_schema":
        try:
            schema = json.loads(constraint.spec)
        except json.JSONDecodeError:
            return {"structured_outputs": {"json": constraint.spec}}
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    return {"structured_outputs": {constraint.kind: constraint.spec}}
