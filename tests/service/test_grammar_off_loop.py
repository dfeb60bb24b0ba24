"""A request's output format never stalls the verifier (issue 26, point 2), over real gRPC on loopback.

Compiling a large JSON schema takes from a fraction of a second to seconds. The verifier builds each request's
matcher in its own small thread pool while the engine keeps stepping, caches compiled matchers (a repeat costs
a copy), and refuses what is too deep to compile with INVALID_ARGUMENT. The test: three requests carrying
distinct ~250 kB schemas (3,500 string properties with patterns) arrive beside a running greedy stream, whose
tokens must keep coming (no gap over 0.5 s) and stay exactly the plain greedy output.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import llguidance
import pytest
from llguidance._tokenizer import TokenizerWrapper

from shared.grammar import MAX_SCHEMA_DEPTH, GrammarCompiler, StructuredOutput
from shared.proto_gen.specdec.v1 import common_pb2, verifier_pb2_grpc
from tests.service.test_proposer_service import VOCAB
from tests.service.test_verifier_service import PROMPTS, collect, reference, request, start_verifier

pytestmark = pytest.mark.timeout(120)

EOS = VOCAB - 1
STREAM_TOKENS = 160
MAX_GAP_S = 0.5  # main (matchers built on the event loop under the engine lock): 0.8-2.5 s here


class _CharTokenizer:
    """The tiny model's 128 ids as a tokenizer: ids 0-94 are the printable ASCII characters, the rest special."""

    eos_token_id = EOS
    bos_token_id = None
    tokens = [bytes([32 + i]) for i in range(95)] + [b"\xff<t%d>" % i for i in range(95, EOS)] + [b"\xff<eos>"]
    special_token_ids = [EOS]

    def __call__(self, text: str | bytes) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        return [b - 32 for b in data]


def char_compiler() -> GrammarCompiler:
    return GrammarCompiler(llguidance.LLTokenizer(TokenizerWrapper(_CharTokenizer()), n_vocab=VOCAB), VOCAB, (EOS,))


def large_schema(tag: str, properties: int = 3500) -> str:
    """~250 kB: thousands of required string properties with patterns (under the 256 KiB spec limit)."""
    names = [f"{tag}{i}" for i in range(properties)]
    pattern = {"type": "string", "pattern": "[a-z]{3,9}[0-9]{2}"}
    return json.dumps({"type": "object", "properties": {n: pattern for n in names}, "required": names})


def schema_request(spec: str, max_tokens: int = 2):
    return request([1, 2, 3], max_tokens, params={"structured_output": common_pb2.StructuredOutput(json_schema=spec)})


def test_large_schemas_beside_a_running_stream_leave_its_tokens_on_time_and_exact():
    async def scenario() -> None:
        server = await start_verifier(step_delay_s=0.01)
        server.loop.engine.grammar = char_compiler()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                arrivals: list[float] = []
                tokens: list[int] = []
                call = stub.Generate(request(PROMPTS[2], STREAM_TOKENS), timeout=60)
                schemas: list[asyncio.Task] = []
                async for msg in call:
                    arrivals.append(time.monotonic())
                    tokens += msg.token_ids
                    if len(arrivals) == 3:  # the stream is running: the large formats arrive now
                        specs = [large_schema(f"p{j}_") for j in range(3)]
                        assert all(200_000 < len(s) <= 256 * 1024 for s in specs)
                        schemas = [asyncio.create_task(collect(stub, schema_request(s))) for s in specs]
                gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
                assert tokens == reference(tuple(PROMPTS[2]), STREAM_TOKENS)
                assert max(gaps) < MAX_GAP_S, f"the stream waited {max(gaps):.3f} s between two tokens"
                outputs = await asyncio.gather(*schemas)
                assert [len(out) for out, _ in outputs] == [2, 2, 2]
                assert all(out[0] == ord("{") - 32 for out, _ in outputs)  # the format holds: '{' first
                # A repeat of a compiled format costs a copy of the cached matcher, not a compile.
                compiled = server.loop.engine.grammar.compilations
                repeat, _ = await collect(stub, schema_request(large_schema("p0_")))
                assert repeat == outputs[0][0] and server.loop.engine.grammar.compilations == compiled
        finally:
            await server.shutdown(0.5)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "spec, words",
    [
        ("[" * 100_000 + "]" * 100_000, "nested deeper than"),  # json.loads alone would raise RecursionError
        ('{"items":' * (MAX_SCHEMA_DEPTH + 1) + "{}" + "}" * (MAX_SCHEMA_DEPTH + 1), "nested deeper than"),
        ('{"type": "integr"}', "invalid json_schema"),
    ],
)
def test_a_schema_too_deep_or_wrong_is_invalid_argument_and_the_verifier_serves_on(spec, words):
    async def scenario() -> None:
        server = await start_verifier()
        server.loop.engine.grammar = char_compiler()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await collect(stub, schema_request(spec))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
                tokens, _ = await collect(stub, request(PROMPTS[0], 8))
                assert tokens == reference(tuple(PROMPTS[0]), 8)
        finally:
            await server.shutdown(0.5)

    asyncio.run(scenario())


def test_the_compiler_checks_depth_without_recursion():
    compiler = char_compiler()
    shallow = '{"items":' * (MAX_SCHEMA_DEPTH - 2) + "{}" + "}" * (MAX_SCHEMA_DEPTH - 2)
    compiler.matcher(StructuredOutput("json_schema", shallow))  # at the limit: compiles
    for _ in range(2):  # a bad format is refused from the cache the second time, with the same message
        with pytest.raises(ValueError, match="nested deeper than"):
            compiler.matcher(StructuredOutput("json_schema", "[" * 100_000 + "]" * 100_000))
    assert compiler.compilations == 2
