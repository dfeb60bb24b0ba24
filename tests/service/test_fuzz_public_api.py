"""Property-based fuzzing of the public API (issue 12): every GenerateRequest / CompleteRequest field, extremes
included, against one real gateway in front of one real verifier (tiny random-weight target) on loopback.

The property: every call ends with OK or a status the API documents for what the request did, never UNKNOWN or
INTERNAL, and an error's message is short, printable and non-empty. Allowed here: OK, INVALID_ARGUMENT,
RESOURCE_EXHAUSTED (a message over --max-request-bytes), DEADLINE_EXCEEDED only for a call with a short deadline,
CANCELLED only for a call the client cancelled. UNAVAILABLE and UNAUTHENTICATED are documented too, but with one
healthy verifier and no API keys they would be a bug here. Meanwhile greedy streams run back to back and must stay
token-for-token equal to plain greedy decoding; afterwards both services are SERVING and every KV block is free.

Both servers run on one event loop in a background thread, so that they keep serving between hypothesis examples;
the test body submits its calls to that loop. A fixed seed (derandomize) and a fixed number of examples keep CI
reproducible and bounded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
from collections.abc import Coroutine
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from gateway.config import GatewayConfig
from gateway.prepare import RequestFields, RequestPreparer
from gateway.server import start_gateway
from shared.errors import InvalidRequestError
from shared.proto_gen.specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from shared.sampling import SamplingParams
from tests.service.test_gateway import free_port
from tests.service.test_proposer_service import MAX_LEN, VOCAB
from tests.service.test_verifier_service import PROMPTS, reference, start_proposer, start_verifier

pytestmark = pytest.mark.timeout(300)

# A small KV cache (48 blocks of 8 tokens; one request needs up to 32): concurrent requests preempt each other.
KV_BLOCKS = 48
CALL_TIMEOUT_S = 30.0  # a call without a short deadline that takes longer is a hang
SHORT_DEADLINE_S = 0.02
# Tokens of each background greedy stream. Not more: at output position 188 of PROMPTS[2] the tiny random target
# has a near-tie that one-token decoding and a longer forward pass round differently (float, not logic).
LONG = 160
# Greedy fuzzed outputs are compared with the reference over this many tokens (random prompts may hold such
# near-ties further out, and the batches they share change how the floats round).
GREEDY_CHECKED = 64
TOKENIZER_VOCAB = 49152
CONFIG = dict(
    host="127.0.0.1",
    port=0,
    health_check_interval_s=0.2,
    drain_timeout_s=0.5,
    default_max_tokens=8,  # an unset max_tokens stays cheap
    max_prompt_chars=4000,  # small limits, so that the fuzzer reaches each of them
    max_prompt_tokens=300,  # above the context (256): both the context check and this limit are reachable
    max_request_bytes=16 * 1024,
)
OK, CANCELLED, DEADLINE = grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED
ALWAYS_ALLOWED = {OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
UNSPECIFIED, STOP, LENGTH = (
    common_pb2.FINISH_REASON_UNSPECIFIED,
    common_pb2.FINISH_REASON_STOP,
    common_pb2.FINISH_REASON_LENGTH,
)

# ---- strategies ---------------------------------------------------------------------------------

INT32 = st.integers(-(2**31), 2**31 - 1)
UINT32 = st.integers(0, 2**32 - 1)
UINT64 = st.integers(0, 2**64 - 1)
TOKEN_IDS = st.one_of(
    st.integers(0, VOCAB - 1),
    st.sampled_from([-1, -(2**31), 2**31 - 1, VOCAB, TOKENIZER_VOCAB - 1, TOKENIZER_VOCAB]),
    INT32,
)
# Values the wire turns into something else are included: float fields are float32 (1e39 -> inf, 1e-50 -> 0).
FLOAT_EXTREMES = [
    0.0,
    -0.0,
    1e-45,
    1e-40,
    1e-6,
    1e-5,
    1.01e-5,
    2e-5,
    -1e-40,
    1.0,
    -1.0,
    3.4e38,
    1e39,
    math.nan,
    math.inf,
    -math.inf,
]


def float_field(usual: st.SearchStrategy[float]) -> st.SearchStrategy[float | None]:
    return st.one_of(st.none(), usual, st.sampled_from(FLOAT_EXTREMES), st.floats(width=32), st.floats())


# Text the tiny model's 128 ids cover: single ASCII characters kept apart by special tokens (so that BPE merges
# nothing), so that text prompts reach generation too.
PIECES = st.sampled_from([*"!#$%&()*+,-./0123456789:;<=>?@ABCXYZ[]^_`abcxyz{|}~"])
SPECIALS = st.sampled_from(["<|im_end|>", "<|endoftext|>", "<|im_start|>"])
LOW_TEXT = st.lists(st.tuples(PIECES, SPECIALS), min_size=1, max_size=6).map(lambda p: "".join(a + b for a, b in p))
# Over --max-prompt-chars (4000) and, beyond 16 KiB, over --max-request-bytes.
LONG_TEXT = st.builds(lambda c, n: c * n, st.characters(), st.sampled_from([3999, 4001, 6000, 17000]))
IDS_TEXT = st.text(st.sampled_from("AZaz09._:@/+=-"), min_size=1, max_size=128)
WILD_IDS_TEXT = st.one_of(
    st.sampled_from(["x" * 128, "x" * 129, "a b", "a\nlevel=ERROR", "\x00", "é", "😀"]), st.text(max_size=200)
)
STOP_STRINGS = st.lists(PIECES, min_size=1, max_size=3).map("".join)
WILD_STOP_STRINGS = st.one_of(st.just(""), st.sampled_from(["x" * 256, "x" * 257]), st.text(max_size=300))

# Per field: (usual values, which are valid; extremes and anything the wire type can carry). None: leave it unset.
FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "request_id": (st.one_of(st.just(""), IDS_TEXT), WILD_IDS_TEXT),
    "session_id": (st.one_of(st.just(""), IDS_TEXT), WILD_IDS_TEXT),
    "prompt": (LOW_TEXT, st.one_of(st.text(max_size=50), LONG_TEXT)),
    "prompt_token_ids": (
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
        st.one_of(
            st.just([]),
            st.lists(TOKEN_IDS, min_size=1, max_size=20),
            st.lists(st.integers(0, VOCAB - 1), min_size=250, max_size=310),
            st.builds(lambda t, n: [t] * n, TOKEN_IDS, st.integers(300, 5000)),
        ),
    ),
    "max_tokens": (
        st.one_of(st.none(), st.integers(1, 8)),
        st.one_of(st.sampled_from([0, 255, 256, 257, 32768, 32769, 2**32 - 1]), UINT32),
    ),
    "temperature": (st.one_of(st.none(), st.just(0.0), st.floats(0, 2)), float_field(st.floats(-2, 2))),
    "top_p": (st.one_of(st.none(), st.floats(0.01, 1)), float_field(st.floats(-1, 2))),
    "top_k": (st.one_of(st.none(), st.integers(0, 200)), st.one_of(st.sampled_from([-1, -(2**31), 2**31 - 1]), INT32)),
    "min_p": (st.one_of(st.none(), st.floats(0, 1)), float_field(st.floats(-1, 2))),
    "seed": (st.one_of(st.none(), UINT64), st.sampled_from([0, 1, 2**63 - 1, 2**63, 2**64 - 1])),
    "stop": (st.lists(STOP_STRINGS, max_size=4), st.lists(st.one_of(STOP_STRINGS, WILD_STOP_STRINGS), max_size=18)),
    "stop_token_ids": (
        st.lists(st.integers(0, VOCAB - 1), max_size=4),
        st.one_of(st.lists(TOKEN_IDS, max_size=4), st.lists(st.integers(0, VOCAB - 1), min_size=60, max_size=70)),
    ),
    "ignore_eos": (st.booleans(), st.booleans()),
    "max_draft_tokens": (st.one_of(st.none(), st.integers(0, 8)), st.sampled_from([0, 1, 4, 2**31, 2**32 - 1])),
}


@st.composite
def request_fields(draw: st.DrawFn) -> dict[str, Any]:
    """The keyword arguments of a GenerateRequest (also a CompleteRequest); unset optionals left out. Usual
    values and wild ones mixed, so that examples reach generation as well as every check."""
    # Most checks are reached only when every other field is valid: often exactly one field is wild.
    wild = draw(st.sampled_from(["none", "one", "one", "one", "some", "all"]))
    wild_one = draw(st.sampled_from(sorted(FIELDS)))
    prompt_kind = draw(st.sampled_from(["prompt_token_ids", "prompt_token_ids", "prompt", "both", "neither"]))
    fields: dict[str, Any] = {}
    for name, (usual, extreme) in FIELDS.items():
        if name in ("prompt", "prompt_token_ids") and prompt_kind not in (name, "both"):
            continue
        is_wild = wild == "all" or (wild == "one" and name == wild_one) or (wild == "some" and draw(st.booleans()))
        value = draw(extreme if is_wild else usual)
        if value is not None:
            fields[name] = value
    return fields


# ---- the servers on their own event loop --------------------------------------------------------


class LoopThread:
    """An event loop running in a background thread; `run` submits a coroutine and waits for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-servers", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = CALL_TIMEOUT_S + 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class Stack:
    """One verifier (tiny target; its proposer drafts with the same weights, so max_draft_tokens and the rejection
    sampler are exercised too) behind one gateway, and client channels to gateway and verifier."""

    async def start(self, tokenizer: Any) -> None:
        self.proposer = await start_proposer()
        self.verifier = await start_verifier([f"127.0.0.1:{self.proposer.port}"], num_kv_blocks=KV_BLOCKS)
        address = f"127.0.0.1:{self.verifier.port}"
        self.gateway = await start_gateway(
            GatewayConfig(verifiers=(address,), http_port=free_port(), **CONFIG), tokenizer=tokenizer
        )
        self.http = httpx.AsyncClient(base_url=self.gateway.http_url, timeout=CALL_TIMEOUT_S)
        self.gateway_channel = grpc.aio.insecure_channel(self.gateway.address)
        self.verifier_channel = grpc.aio.insecure_channel(address)
        self.stub = gateway_pb2_grpc.GatewayStub(self.gateway_channel)
        self.verifier_stub = verifier_pb2_grpc.VerifierStub(self.verifier_channel)
        # The verifier's vocabulary (128, not the tokenizer's 49152) and context reach the gateway by its stats
        # polls; until then the verifier's own checks would answer. Fuzz only once the gateway knows them.
        router = self.gateway.servicer.router
        for _ in range(500):
            if router.vocab_limit() == VOCAB and router.context_limit() == MAX_LEN:
                break
            await asyncio.sleep(0.01)
        assert (router.vocab_limit(), router.context_limit()) == (VOCAB, MAX_LEN)
        self.stop_greedy = asyncio.Event()

    async def greedy_streams(self) -> list[tuple[tuple[int, ...], list[int]]]:
        """Greedy streams, back to back, until the fuzzing is over (at least one, started before it)."""
        results: list[tuple[tuple[int, ...], list[int]]] = []
        while not self.stop_greedy.is_set():
            prompt = tuple(PROMPTS[len(results) % len(PROMPTS)])
            request = gateway_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=LONG, request_id="greedy")
            tokens = [t async for msg in self.stub.Generate(request, timeout=120) for t in msg.token_ids]
            results.append((prompt, tokens))
        return results

    async def call(self, rpc: str, fields: dict[str, Any], action: str) -> list[tuple[grpc.StatusCode, str, list[Any]]]:
        """[(status, details, responses)] of one call, or of identical ones at once (actions "twice", "many");
        "cancel": the client cancels a Generate stream after its first message (a Complete call just waits);
        "short": a deadline of SHORT_DEADLINE_S."""
        copies = {"twice": 2, "many": 6}.get(action)
        if copies:
            return list(await asyncio.gather(*(self._call(rpc, fields, "wait") for _ in range(copies))))
        return [await self._call(rpc, fields, action)]

    async def _call(self, rpc: str, fields: dict[str, Any], action: str) -> tuple[grpc.StatusCode, str, list[Any]]:
        timeout = SHORT_DEADLINE_S if action == "short" else CALL_TIMEOUT_S
        try:
            if rpc == "complete":
                return OK, "", [await self.stub.Complete(gateway_pb2.CompleteRequest(**fields), timeout=timeout)]
            call = self.stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=timeout)
            messages = []
            async for msg in call:
                messages.append(msg)
                if action == "cancel":
                    call.cancel()
                    return CANCELLED, "cancelled by the test", messages
            return OK, "", messages
        except grpc.aio.AioRpcError as err:
            return err.code(), err.details() or "", []

    async def http_call(self, path: str, body: Any) -> tuple[int, dict[str, Any] | None, str]:
        """(status, JSON reply or None, raw text) of one HTTP request; `body` is JSON-encoded unless bytes."""
        content = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
        reply = await self.http.post(path, content=content, headers={"content-type": "application/json"})
        try:
            parsed = reply.json()
        except ValueError:
            parsed = None
        return reply.status_code, parsed, reply.text

    async def health(self) -> list[int]:
        checks = [
            (self.gateway_channel, ""),
            (self.gateway_channel, "specdec.v1.Gateway"),
            (self.verifier_channel, ""),
            (self.verifier_channel, "specdec.v1.Verifier"),
        ]
        return [
            (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=s), timeout=5)).status
            for ch, s in checks
        ]

    async def idle(self) -> tuple[common_pb2.EngineStats, int, int]:
        """Waits (up to 5 s) for every request to end: aborts are applied at the verifier's next step."""
        for _ in range(250):
            stats = (await self.verifier_stub.GetStats(verifier_pb2.VerifierGetStatsRequest(), timeout=5)).stats
            gateway = await self.stub.GetStats(gateway_pb2.GetStatsRequest(), timeout=5)
            state = (stats, gateway.active_requests, self.verifier.loop.num_requests)
            busy = stats.running_requests + stats.waiting_requests + state[1] + state[2]
            if stats.kv_blocks_free == stats.kv_blocks_total and not busy:
                return state
            await asyncio.sleep(0.02)
        return state

    async def stop(self) -> None:
        """Stops what `start` got to start (it may have failed half way)."""
        for name in ("gateway_channel", "verifier_channel"):
            if hasattr(self, name):
                await getattr(self, name).close()
        if hasattr(self, "http"):
            await self.http.aclose()
        if hasattr(self, "gateway"):
            await self.gateway.stop(0)
        if hasattr(self, "verifier"):
            await self.verifier.shutdown(0.5)
        if hasattr(self, "proposer"):
            await self.proposer.shutdown(0.1)


class ErrorLog(logging.Handler):
    """Records ERROR and above from every logger: a handler that failed (grpc logs "Unexpected ... raised by
    servicer method"), an engine step that failed, a task whose exception nobody read. The client may not see
    these (a deadline can hide them)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}"[:500])


@pytest.fixture(scope="module")
def stack(tokenizer):
    portal = LoopThread()
    servers = Stack()
    try:
        portal.run(servers.start(tokenizer))
        yield portal, servers
    finally:
        portal.run(servers.stop())
        portal.close()


# ---- what an OK answer must look like -----------------------------------------------------------


def check_output(rpc: str, sent: Any, responses: list[Any], tokenizer: Any) -> None:
    """`sent`: the request message (its float fields as the wire has them, float32)."""
    if rpc == "generate":
        assert responses and all(r.finish_reason == UNSPECIFIED for r in responses[:-1])
        assert not any(r.HasField("usage") for r in responses[:-1])
    last = responses[-1]
    tokens = [t for r in responses for t in r.token_ids]
    text = "".join(r.text for r in responses)
    assert {r.request_id for r in responses} == {sent.request_id or last.request_id} and last.request_id
    assert all(0 <= t < VOCAB for t in tokens)
    max_tokens = sent.max_tokens if sent.HasField("max_tokens") else CONFIG["default_max_tokens"]
    prompt = tuple(sent.prompt_token_ids) or tuple(tokenizer.encode(sent.prompt))
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), len(tokens))
    assert len(tokens) <= max_tokens and len(prompt) + len(tokens) <= MAX_LEN
    assert not any(s in text for s in sent.stop)  # the text ends before a stop string
    if last.finish_reason == LENGTH:
        assert len(tokens) == max_tokens or len(prompt) + len(tokens) == MAX_LEN
    else:
        assert last.finish_reason == STOP
        if last.HasField("stop_string"):
            assert last.stop_string in sent.stop
        else:  # the tiny target has no end-of-sequence token: only the request's stop ids stop it
            assert tokens and last.stop_token_id == tokens[-1] and last.stop_token_id in sent.stop_token_ids
    temperature = sent.temperature if sent.HasField("temperature") else 0.0
    if SamplingParams(temperature=temperature).is_greedy:  # top_k, top_p, min_p and seed do not matter then
        n = min(len(tokens), GREEDY_CHECKED)
        assert tokens[:n] == reference(prompt, max_tokens)[:n]


# ---- the tests ----------------------------------------------------------------------------------


def test_fuzzed_requests_end_with_a_documented_status_and_hurt_no_other_request(stack, tokenizer):
    portal, servers = stack
    errors = ErrorLog()
    logging.getLogger().addHandler(errors)
    greedy = asyncio.run_coroutine_threadsafe(servers.greedy_streams(), portal.loop)
    seen: dict[str, int] = {}

    @settings(
        max_examples=150,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )
    @given(
        fields=request_fields(),
        rpc=st.sampled_from(["generate", "complete"]),
        action=st.sampled_from(["wait", "wait", "wait", "twice", "many", "cancel", "short"]),
    )
    # Always run, whatever the generated examples happen to cover:
    @example({"prompt": "x" * 17000}, "generate", "wait")  # over --max-request-bytes: RESOURCE_EXHAUSTED
    @example({"prompt_token_ids": [1, 2, 3], "temperature": math.nan}, "complete", "wait")
    @example({"prompt_token_ids": [1, 2, 3], "temperature": 1e-40}, "generate", "wait")  # greedy
    @example({"prompt_token_ids": [7], "max_tokens": MAX_LEN}, "complete", "many")  # to the context's end: preempts
    @example({"prompt": "!<|im_end|>", "temperature": 1.0, "seed": 2**64 - 1}, "generate", "twice")
    @example({"prompt_token_ids": PROMPTS[2], "max_tokens": 100}, "generate", "cancel")
    @example({"prompt_token_ids": PROMPTS[0], "max_tokens": MAX_LEN}, "complete", "short")
    def one_call(fields: dict[str, Any], rpc: str, action: str) -> None:
        sent = (gateway_pb2.GenerateRequest if rpc == "generate" else gateway_pb2.CompleteRequest)(**fields)
        allowed = (
            ALWAYS_ALLOWED
            | ({DEADLINE} if action == "short" else set())
            | ({CANCELLED} if action == "cancel" else set())
        )
        results = portal.run(servers.call(rpc, fields, action))
        for code, details, responses in results:
            event(f"{rpc} {action} {code.name}")
            seen[code.name] = seen.get(code.name, 0) + 1
            assert code in allowed, (code, details)
            if code not in (OK, CANCELLED):
                assert details.strip() and details.isprintable() and len(details) <= 500, details
            elif code == OK:
                check_output(rpc, sent, responses, tokenizer)
        outputs = [[t for r in responses for t in r.token_ids] for code, _, responses in results if code == OK]
        if len(outputs) > 1 and sent.HasField("seed"):  # a seeded request is reproducible, even side by side
            assert all(out == outputs[0] for out in outputs)

    try:
        one_call()
    finally:
        servers.stop_greedy.set()
        logging.getLogger().removeHandler(errors)
    print("fuzz statuses:", seen)  # shown with pytest -s
    assert {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "CANCELLED"} <= set(seen)
    check_nothing_hurt(portal, servers, greedy.result(120), errors)


def check_nothing_hurt(portal: LoopThread, servers: Stack, streams: list[Any], errors: ErrorLog) -> None:
    """After a fuzzing run: the greedy streams beside it were exact, nothing logged an error, both services
    serve, and every request ended with its KV blocks free."""
    assert streams and all(tokens == reference(prompt, LONG) for prompt, tokens in streams)
    assert errors.records == []
    serving = health_pb2.HealthCheckResponse.SERVING
    assert portal.run(servers.health()) == [serving] * 4
    stats, gateway_active, verifier_requests = portal.run(servers.idle())
    assert stats.kv_blocks_free == stats.kv_blocks_total > 0 and stats.kv_blocks_used == 0
    assert (stats.running_requests, stats.waiting_requests, gateway_active, verifier_requests) == (0, 0, 0, 0)


@settings(max_examples=300, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(
    fields=request_fields(),
    vocab=st.sampled_from([None, VOCAB, TOKENIZER_VOCAB]),
    max_model_len=st.sampled_from([None, 1, 16, MAX_LEN]),
)
def test_frontend_refuses_a_request_or_prepares_valid_sampling(tokenizer, fields, vocab, max_model_len):
    """No gRPC: any fields either get InvalidRequestError or a PreparedRequest whose sampling validates (floats as
    Python has them here, not rounded to float32 as the wire would)."""
    frontend = RequestPreparer(tokenizer, GatewayConfig(**CONFIG))
    req = RequestFields(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    try:
        frontend.check_fields(req, vocab)
        prompt_ids = frontend.tokenize(req.prompt) if req.prompt else req.prompt_token_ids
        prepared = frontend.check_context(frontend.prepare(req, prompt_ids, "internal"), max_model_len)
    except InvalidRequestError as err:
        assert str(err).strip() and str(err).isprintable()
        return
    limit = frontend.vocab_limit(vocab)
    prepared.sampling.validate(limit)
    assert prepared.sampling.max_tokens >= prepared.max_tokens >= 1
    assert prepared.max_tokens <= (max_model_len or frontend.config.max_tokens_limit)
    assert prepared.prompt_ids and (not max_model_len or len(prepared.prompt_ids) < max_model_len)
    assert all(0 <= t < limit for t in req.prompt_token_ids)
    assert prepared.request_id == "internal" and prepared.max_tokens_explicit == ("max_tokens" in fields)


# ---- the HTTP endpoints and the output formats (issue 26) ---------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
FORMAT_SPECS = st.one_of(
    st.just(json.dumps(SCHEMA)),
    st.sampled_from(
        ['{"type": "integr"}', "{", "[" * 5000 + "]" * 5000, '{"items":' * 80 + "{}" + "}" * 80, "x" * 270_000]
    ),
    st.text(max_size=40),
)
HTTP_FORMATS = st.one_of(
    st.just({}),
    st.builds(lambda spec: {"guided_json": spec}, FORMAT_SPECS),
    st.builds(
        lambda spec: {"guided_regex": spec},
        st.one_of(st.sampled_from(["[0-9]{3}", "(", "(" * 300 + ")" * 300]), st.text(max_size=20)),
    ),
    st.builds(
        lambda spec: {"guided_grammar": spec}, st.sampled_from(['root ::= "yes" | "no"', "start: x", "root ::= "])
    ),
    st.sampled_from(
        [
            {"response_format": {"type": "json_object"}},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            {"response_format": "json"},
            {"response_format": {"type": "json_schema"}},
            {"structured_outputs": {"regex": "[a-c]+"}},
            {"structured_outputs": {"json": SCHEMA, "regex": "a"}},
            {"guided_choice": ["a", "b"]},
        ]
    ),
)
ROLES = st.one_of(st.sampled_from(["user", "system", "assistant", "", "u" * 65]), st.text(max_size=10))
# Numbers as JSON has them: past every proto type, and of the wrong JSON type.
WILD_NUMBER = st.one_of(
    st.sampled_from([2**31, 2**32, 2**63, 2**64, -(2**63), 10**30, 1e39, -1e39, 0.5, "7", None, True, [1]]), INT32
)
NUMERIC_FIELDS = ["max_tokens", "top_k", "max_draft_tokens", "seed", "temperature", "top_p", "min_p", "logprobs", "n"]


@st.composite
def http_bodies(draw: st.DrawFn) -> tuple[str, Any]:
    """(path, body): a completions or chat body from the gRPC fields' strategies, with wild numbers, formats
    and roles mixed in; sometimes bytes that are not a body at all."""
    kind = draw(st.sampled_from(["completions", "completions", "chat", "raw"]))
    if kind == "raw":
        raw = draw(
            st.sampled_from(
                [
                    b"",
                    b"{",
                    b"[]",
                    b"null",
                    b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}",
                    b"\xff\xfe",
                    b'{"prompt": "hi"}' * 2,
                ]
            )
        )
        return "/v1/completions", raw
    fields = draw(request_fields())
    body: dict[str, Any] = {
        k: v
        for k, v in fields.items()
        if k
        in (
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "stop",
            "stop_token_ids",
            "ignore_eos",
            "max_draft_tokens",
            "session_id",
        )
    }
    for name in draw(st.lists(st.sampled_from(NUMERIC_FIELDS), max_size=2)):
        body[name] = draw(WILD_NUMBER)
    body.update(draw(HTTP_FORMATS))
    body["stream"] = draw(st.booleans())
    if kind == "chat":
        n = draw(st.sampled_from([0, 1, 2, 3, 1025]))
        role, content = draw(ROLES), draw(st.one_of(LOW_TEXT, st.text(max_size=30)))
        body["messages"] = [{"role": role, "content": content}] * n
        body.pop("logprobs", None)
        return "/v1/chat/completions", body
    body["prompt"] = fields.get("prompt") or list(fields.get("prompt_token_ids", [])) or draw(LOW_TEXT)
    return "/v1/completions", body


HTTP_ALLOWED = {200, 400, 404, 413, 429}


def test_fuzzed_http_requests_are_answered_without_500_and_hurt_no_other_request(stack):
    """The same property over the OpenAI HTTP port, structured-output fields and out-of-range numbers
    included: 2xx or a documented 4xx with an OpenAI error body, never 5xx; greedy streams stay exact."""
    portal, servers = stack
    errors = ErrorLog()
    logging.getLogger().addHandler(errors)
    servers.stop_greedy.clear()
    greedy = asyncio.run_coroutine_threadsafe(servers.greedy_streams(), portal.loop)
    seen: dict[int, int] = {}

    @settings(max_examples=120, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(case=http_bodies())
    @example(("/v1/completions", {"prompt": "hi", "top_k": 2**32}))
    @example(("/v1/completions", {"prompt": "hi", "guided_json": "[" * 100_000 + "]" * 100_000}))
    @example(("/v1/chat/completions", {"messages": [{"role": "u" * 5000, "content": "hi"}]}))
    @example(("/v1/completions", {"prompt": [1] * 10_000}))  # over --max-request-bytes (16 KiB): 413
    def one_call(case: tuple[str, Any]) -> None:
        path, body = case
        status, reply, text = portal.run(servers.http_call(path, body))
        seen[status] = seen.get(status, 0) + 1
        event(f"{path} {status}")
        assert status in HTTP_ALLOWED, (status, text[:300])
        if status != 200:
            message = (reply or {}).get("error", {}).get("message", "")
            assert message.strip() and message.isprintable() and len(message) <= 500, text[:300]
            assert "Error:" not in message and "Traceback" not in message  # no exception types or stacks

    try:
        one_call()
    finally:
        servers.stop_greedy.set()
        logging.getLogger().removeHandler(errors)
    print("http fuzz statuses:", seen)
    assert {200, 400, 413} <= set(seen)
    check_nothing_hurt(portal, servers, greedy.result(120), errors)
