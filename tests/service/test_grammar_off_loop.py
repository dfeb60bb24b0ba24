"""A request's output format never stalls the verifier (issue 26, point 2), over real gRPC on loopback.

Compiling a large JSON schema takes from a fraction of a second to seconds. The verifier builds each request's
matcher in its own small thread pool while the engine keeps stepping, caches compiled matchers (a repeat costs
a copy), and refuses what is too deep to compile with INVALID_ARGUMENT. The test: three requests carrying
distinct ~250 kB schemas (3,500 string properties with patterns) arrive beside a running greedy stream, whose
tokens must keep coming while the schemas compile and stay exactly the plain greedy output. "Keep coming" is
counted, not timed: a verifier that compiles on its event loop (or under the engine's lock) delivers no token
while a compile runs, whatever the machine's speed, while a bound on the gap between tokens failed on a busy CI
machine (0.66 s against 0.5 s) with the compiles off the loop.
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
# Tokens of the stream that must arrive while the formats compile: here 40-60 do (3 compiles of 0.3 s each, a
# step every 15 ms); none can when a compile holds the event loop.
MIN_TOKENS_DURING_COMPILES = 5


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


def timed_compiles(compiler: GrammarCompiler) -> list[tuple[float, float]]:
    """The (start, end) of every compile call from now on, by time.monotonic (the grammar threads append)."""
    intervals: list[tuple[float, float]] = []
    compile_one = compiler.compile

    def timed(constraint: StructuredOutput):
        started = time.monotonic()
        try:
            return compile_one(constraint)
        finally:
            intervals.append((started, time.monotonic()))

    compiler.compile = timed  # type: ignore[method-assign]
    return intervals


async def stream_beside_large_schemas(server) -> tuple[list[int], int, list]:
    """A greedy stream; at its third message, three large formats arrive. Returns the stream's tokens, how many
    of its messages arrived while a format compiled, and the formats' outputs."""
    intervals = timed_compiles(server.loop.engine.grammar)
    specs = [large_schema(f"p{j}_") for j in range(3)]
    assert all(200_000 < len(s) <= 256 * 1024 for s in specs)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        arrivals: list[float] = []
        tokens: list[int] = []
        schemas: list[asyncio.Task] = []
        async for msg in stub.Generate(request(PROMPTS[2], STREAM_TOKENS), timeout=60):
            arrivals.append(time.monotonic())
            tokens += msg.token_ids
            if len(arrivals) == 3:  # the stream is running: the large formats arrive now
                schemas = [asyncio.create_task(collect(stub, schema_request(s))) for s in specs]
        outputs = await asyncio.gather(*schemas)
    assert len(intervals) == 3, intervals
    during = sum(any(start < t < end for start, end in intervals) for t in arrivals)
    return tokens, during, outputs


def test_large_schemas_beside_a_running_stream_leave_its_tokens_coming_and_exact():
    async def scenario() -> None:
        server = await start_verifier(step_delay_s=0.01)
        server.loop.engine.grammar = char_compiler()
        try:
            tokens, during, outputs = await stream_beside_large_schemas(server)
            assert tokens == reference(tuple(PROMPTS[2]), STREAM_TOKENS)
            assert during >= MIN_TOKENS_DURING_COMPILES, f"{during} tokens arrived while the formats compiled"
            assert [len(out) for out, _ in outputs] == [2, 2, 2]
            assert all(out[0] == ord("{") - 32 for out, _ in outputs)  # the format holds: '{' first
            # A repeat of a compiled format costs a copy of the cached matcher, not a compile.
            compiled = server.loop.engine.grammar.compilations
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                repeat, _ = await collect(verifier_pb2_grpc.VerifierStub(channel), schema_request(large_schema("p0_")))
            assert repeat == outputs[0][0] and server.loop.engine.grammar.compilations == compiled
        finally:
            await server.shutdown(0.5)

    asyncio.run(scenario())


def test_the_count_catches_a_verifier_that_compiles_on_its_event_loop():
    """The check above can fail: with the matcher built on the event loop, no token arrives during a compile."""

    async def scenario() -> None:
        server = await start_verifier(step_delay_s=0.01)
        server.loop.engine.grammar = char_compiler()

        async def on_the_loop(params, prompt_ids, output_offset):
            if params.structured_output is None:
                return None
            return server.loop.engine.build_grammar(params, list(prompt_ids), output_offset)

        server.loop._build_grammar = on_the_loop
        try:
            tokens, during, _ = await stream_beside_large_schemas(server)
            assert tokens == reference(tuple(PROMPTS[2]), STREAM_TOKENS) and during == 0
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
