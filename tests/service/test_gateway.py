"""The gateway as a real grpc.aio server on loopback, in front of FAKE verifiers (scripted token streams).

The fakes isolate the gateway: they stream token ids the test chooses, report health through the
standard grpc.health.v1 service, can fail mid-stream, hang until cancelled, or return error statuses.
The default fake is a "counting model": the token at absolute position p is 1000 + p, so a request
resumed elsewhere must produce exactly what an uninterrupted one would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from gateway import health_probe
from gateway.config import GatewayConfig, load_gateway_config
from gateway.router import rendezvous_order, rendezvous_pick
from gateway.server import RunningGateway, start_gateway
from shared.grpc_server import add_health_and_reflection, new_server, set_serving
from shared.model.loader import load_tokenizer
from shared.proto_gen.specdec.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from shared.settings import default_target_model
from specdec_local.processes import free_port

pytestmark = pytest.mark.timeout(60)

VERIFIER_SERVICE = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_target_model())


def counting(prompt_len: int, n: int) -> list[int]:
    return [1000 + prompt_len + i for i in range(n)]


def ONE_CHUNK(request: verifier_pb2.VerifierGenerateRequest) -> list[list[int]]:
    """With hang=True: one step's tokens, then the stream stays open (a long generation)."""
    return [counting(len(request.prompt_token_ids), 2)]


@dataclass
class FakeVerifier(verifier_pb2_grpc.VerifierServicer):
    name: str
    script: Callable[[verifier_pb2.VerifierGenerateRequest], list[list[int]]] | None = None
    chunk_size: int = 2
    finish_reason: int = LENGTH
    stop_token_id: int | None = None
    hang: bool = False  # after the script: keep the stream open until cancelled
    abort_at_end: bool = False  # after the script: die (UNAVAILABLE) instead of sending the final message
    fail_after: int | None = None  # abort with UNAVAILABLE once this many tokens were sent
    stall_after: int | None = None  # go silent (stream open, health fine) once this many tokens were sent
    error: tuple[grpc.StatusCode, str] | None = None  # abort at once with this status
    delay: float = 0.0
    failures_left: dict[str, int] = field(default_factory=lambda: {"n": 1 << 30})  # may be shared between fakes
    requests: list[verifier_pb2.VerifierGenerateRequest] = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    active: int = 0
    time_remaining: list[float | None] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = ()  # reported in GetStats
    keepalive_s: float = 0.0  # first: empty messages every 0.1 s for this long (the request waits its turn)
    hold: asyncio.Event | None = None  # the final message waits until the test sets this
    max_model_len: int = MAX_MODEL_LEN  # reported in GetStats

    def chunks(self, request: verifier_pb2.VerifierGenerateRequest) -> list[list[int]]:
        if self.script is not None:
            return self.script(request)
        ids = counting(len(request.prompt_token_ids), request.max_tokens)
        return [ids[i : i + self.chunk_size] for i in range(0, len(ids), self.chunk_size)]

    async def Generate(self, request, context):
        self.requests.append(request)
        self.time_remaining.append(context.time_remaining())
        self.active += 1
        try:
            if self.error is not None:
                await context.abort(*self.error)
            chunks = self.chunks(request)
            sent = 0
            for _ in range(round(self.keepalive_s / 0.1)):
                await context.write(verifier_pb2.VerifierGenerateResponse())
                await asyncio.sleep(0.1)
            for i, chunk in enumerate(chunks):
                if self.fail_after is not None and sent >= self.fail_after and self.failures_left["n"] > 0:
                    self.failures_left["n"] -= 1
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} is going down")
                if self.stall_after is not None and sent >= self.stall_after and self.failures_left["n"] > 0:
                    self.failures_left["n"] -= 1
                    await asyncio.Event().wait()  # until the gateway gives up and cancels the call
                sent += len(chunk)
                steps = i + 1
                # Running counts in every message, as the verifier sends them (3 drafts per step, see below).
                msg = verifier_pb2.VerifierGenerateResponse(
                    token_ids=chunk, drafted_tokens=3 * steps, accepted_tokens=sent - steps
                )
                if i == len(chunks) - 1 and self.hold is not None:
                    await self.hold.wait()
                if i == len(chunks) - 1 and not (self.hang or self.abort_at_end):
                    msg.finish_reason = self.finish_reason
                    if self.stop_token_id is not None:
                        msg.stop_token_id = self.stop_token_id
                    # Pretend 3 drafts per step, all but the bonus token accepted.
                    msg.usage.CopyFrom(
                        common_pb2.Usage(
                            prompt_tokens=len(request.prompt_token_ids),
                            completion_tokens=sent,
                            drafted_tokens=3 * steps,
                            accepted_tokens=sent - steps,
                            num_steps=steps,
                            mean_accepted_length=sent / steps,
                        )
                    )
                await context.write(msg)
                if self.delay:
                    await asyncio.sleep(self.delay)
            if self.hang:
                await asyncio.Event().wait()
            if self.abort_at_end:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} died")
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        finally:
            self.active -= 1

    async def GetStats(self, request, context):
        return verifier_pb2.VerifierGetStatsResponse(
            stats=common_pb2.EngineStats(running_requests=self.active),
            model="fake",
            max_model_len=self.max_model_len,
            vocab_size=49152,
            eos_token_ids=self.eos_token_ids,
        )


@dataclass
class FakeServer:
    fake: FakeVerifier
    server: grpc.aio.Server
    health: Any
    address: str

    async def set_serving(self, serving: bool) -> None:
        await set_serving(self.health, [VERIFIER_SERVICE], serving)


async def start_fake(name: str = "v", **kwargs: Any) -> FakeServer:
    fake = FakeVerifier(name, **kwargs)
    server = new_server()
    verifier_pb2_grpc.add_VerifierServicer_to_server(fake, server)
    health = add_health_and_reflection(server, [VERIFIER_SERVICE])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    fs = FakeServer(fake, server, health, f"127.0.0.1:{port}")
    await fs.set_serving(True)
    return fs


class Harness:
    def __init__(self, tokenizer: Any, fakes: list[FakeServer], extra: list[str] | None = None, **config: Any):
        self.tokenizer = tokenizer
        self.fakes = fakes
        self.verifiers = tuple(f.address for f in fakes) + tuple(extra or ())
        # Backend details in GetStats and reflection are off by default (tests of the defaults say so); on here.
        settings: dict[str, Any] = {
            "health_check_interval_s": 0.1,
            "health_check_timeout_s": 2.0,
            "expose_backends": True,
            "enable_reflection": True,
            "http_port": 0,
            **config,
        }
        self.config = GatewayConfig(verifiers=self.verifiers, host="127.0.0.1", port=0, drain_timeout_s=0.5, **settings)
        self.gateway: RunningGateway
        self.channel: grpc.aio.Channel
        self.stub: gateway_pb2_grpc.GatewayStub

    async def __aenter__(self) -> Harness:
        self.gateway = await start_gateway(self.config, tokenizer=self.tokenizer)
        self.channel = grpc.aio.insecure_channel(self.gateway.address)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.channel.close()
        await self.gateway.stop(0)
        for f in self.fakes:
            await f.server.stop(0)

    async def generate(self, **fields: Any) -> list[gateway_pb2.GenerateResponse]:
        timeout = fields.pop("timeout", 10)
        return [r async for r in self.stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=timeout)]

    async def backend_of(self, fs: FakeServer) -> Any:
        stats = await self.stub.GetStats(gateway_pb2.GetStatsRequest())
        return next(b for b in stats.backends if b.address == fs.address)

    async def wait_healthy(self, fs: FakeServer, healthy: bool, timeout: float = 5.0) -> None:
        async def poll() -> None:
            while (await self.backend_of(fs)).healthy != healthy:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(poll(), timeout)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def joined(responses: list[gateway_pb2.GenerateResponse]) -> tuple[list[int], str]:
    return [t for r in responses for t in r.token_ids], "".join(r.text for r in responses)


async def expect_error(awaitable: Any, code: grpc.StatusCode, match: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await awaitable
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details(), info.value.details()
    return info.value.details()


# -- streaming, text, usage ----------------------------------------------------------------------------


def test_streams_utf8_safe_text_one_token_at_a_time(tokenizer):
    text = "Hello 😀 世界! naïve 你好🎉 done"
    ids = tokenizer.encode(text)

    async def scenario() -> None:
        fs = await start_fake(script=lambda req: [[t] for t in ids], finish_reason=STOP, stop_token_id=2)
        async with Harness(tokenizer, [fs]) as h:
            responses = await h.generate(prompt="Say hi", temperature=0.5, top_p=0.9, seed=7, request_id="r1")
            got_ids, got_text = joined(responses)
            assert got_ids == ids
            assert got_text == text
            assert all("\ufffd" not in r.text for r in responses)
            assert any(r.token_ids and not r.text for r in responses)  # held back: a partial character
            assert len(responses) == len(ids)  # one message per verifier message
            assert {r.request_id for r in responses} == {"r1"}
            last = responses[-1]
            assert [r.finish_reason for r in responses[:-1]] == [0] * (len(responses) - 1)
            assert last.finish_reason == STOP and last.stop_token_id == 2
            prompt_ids = tokenizer.encode("Say hi")
            assert last.usage.prompt_tokens == len(prompt_ids)
            assert last.usage.completion_tokens == len(ids)
            assert last.usage.drafted_tokens == 3 * len(ids) and last.usage.accepted_tokens == 0
            assert last.usage.num_steps == len(ids) and last.usage.mean_accepted_length == 1.0
            # The verifier gets token ids, every sampling field explicitly, and the defaults resolved.
            req = fs.fake.requests[0]
            assert list(req.prompt_token_ids) == prompt_ids
            # The verifier gets the gateway's own id, never the client's (two clients may both send "r1").
            assert req.request_id not in ("", "r1") and req.max_tokens == MAX_MODEL_LEN  # default 128, clamped
            sp = req.sampling_params
            assert sp.HasField("top_k") and sp.HasField("min_p") and sp.seed == 7
            assert sp.temperature == pytest.approx(0.5) and sp.top_p == pytest.approx(0.9)

    run(scenario())


def test_complete_returns_the_whole_completion(tokenizer):
    async def scenario() -> None:
        fs = await start_fake()
        async with Harness(tokenizer, [fs]) as h:
            resp = await h.stub.Complete(gateway_pb2.CompleteRequest(prompt_token_ids=[1, 2, 3], max_tokens=9))
            expected = counting(3, 9)
            assert list(resp.token_ids) == expected
            assert resp.text == tokenizer.decode(expected, clean_up_tokenization_spaces=False)
            assert resp.finish_reason == LENGTH and resp.request_id
            assert resp.usage.completion_tokens == 9 and resp.usage.num_steps == 5
            assert resp.usage.drafted_tokens == 15 and resp.usage.accepted_tokens == 4

    run(scenario())


def test_stop_string_truncates_text_and_cancels_the_verifier_call(tokenizer):
    ids = tokenizer.encode("The answer is 42. END of story, and more text")

    async def scenario() -> None:
        fs = await start_fake(script=lambda req: [[t] for t in ids], hang=True)
        async with Harness(tokenizer, [fs]) as h:
            responses = await h.generate(prompt="Q", stop=["END", "never"])
            got_ids, got_text = joined(responses)
            assert got_text == "The answer is 42. "
            last = responses[-1]
            assert last.finish_reason == STOP and last.stop_string == "END"
            # Token ids up to the one that completed the stop string are reported, none after it.
            assert got_ids == ids[: len(got_ids)] and len(got_ids) < len(ids)
            assert "END" in tokenizer.decode(got_ids)
            assert "END" not in tokenizer.decode(got_ids[:-1])
            assert last.usage.completion_tokens == len(got_ids)
            await asyncio.wait_for(fs.fake.cancelled.wait(), 5)
            # Text that could begin the stop string was held back, never sent and then taken back.
            assert not any(r.text.endswith(("E", "EN")) for r in responses)

    run(scenario())


# -- bad input -----------------------------------------------------------------------------------------

BAD_REQUESTS: list[tuple[dict[str, Any], str]] = [
    ({}, "prompt is empty"),
    ({"prompt": "hi", "prompt_token_ids": [1]}, "exactly one of prompt and prompt_token_ids"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens must be at least 1"),
    ({"prompt": "hi", "max_tokens": 100_000}, "max_tokens must be at most 32768"),
    ({"prompt": "hi", "max_tokens": 65}, f"max_tokens must be at most {MAX_MODEL_LEN} (the model's context length)"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature must be >= 0"),
    ({"prompt": "hi", "temperature": float("nan")}, "temperature must be a finite number"),
    ({"prompt": "hi", "top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"prompt": "hi", "top_k": -1}, "top_k must be >= 0"),
    ({"prompt": "hi", "min_p": 2.0}, "min_p must be in [0, 1]"),
    ({"prompt_token_ids": [1, 49152]}, "outside the vocabulary [0, 49152)"),
    ({"prompt_token_ids": [-3, 5]}, "outside the vocabulary"),
    ({"prompt": "hi", "stop_token_ids": [99999]}, "stop_token_ids [99999] are outside the vocabulary"),
    ({"prompt": "hi", "stop": ["ok", ""]}, "stop string 1 is empty"),
    ({"prompt": "hi", "stop": [str(i) for i in range(17)]}, "at most 16 stop strings"),
    ({"prompt": "hi", "stop": ["x" * 257]}, "stop string 0 has 257 characters; the limit is 256"),
    ({"prompt": "hi", "stop_token_ids": list(range(65))}, "at most 64 stop token ids"),
    ({"prompt_token_ids": [5] * MAX_MODEL_LEN}, f"the prompt has {MAX_MODEL_LEN} tokens; the context limit is"),
]


def test_bad_input_is_invalid_argument_and_leaves_running_requests_alone(tokenizer):
    async def scenario() -> None:
        # The running request's last message waits for the test, so it is still running however slowly
        # the bad requests go by (a fixed delay per message lost that race on a loaded CI machine).
        release = asyncio.Event()
        fs = await start_fake(delay=0.01, hold=release)
        async with Harness(tokenizer, [fs]) as h:
            running = asyncio.create_task(h.generate(prompt_token_ids=[1, 2], max_tokens=40))
            await asyncio.sleep(0.05)
            for fields, message in BAD_REQUESTS:
                await expect_error(h.generate(**fields), grpc.StatusCode.INVALID_ARGUMENT, message)
                await expect_error(
                    h.stub.Complete(gateway_pb2.CompleteRequest(**fields)), grpc.StatusCode.INVALID_ARGUMENT, message
                )
            assert not running.done()
            release.set()
            ids, _ = joined(await running)
            assert ids == counting(2, 40)
            assert len(fs.fake.requests) == 1  # no bad request reached the verifier

    run(scenario())


def test_bytes_that_are_not_the_request_message_are_invalid_argument_on_every_server(tokenizer):
    """grpcio answers a message that does not parse with UNKNOWN and the exception's class, as if the server had
    failed; every service's server (shared/grpc_server.py) says INVALID_ARGUMENT and which message it wanted."""
    corrupt = b"\xff\xff\xff"

    def raw(channel: grpc.aio.Channel, method: str, streaming: bool) -> Any:
        make = channel.unary_stream if streaming else channel.unary_unary
        call = make(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)(corrupt)

        async def drain() -> None:
            async for _ in call:
                pass

        return drain() if streaming else call

    async def scenario() -> None:
        fs = await start_fake()
        async with Harness(tokenizer, [fs]) as h, grpc.aio.insecure_channel(fs.address) as to_verifier:
            for channel, method, streaming, message in [
                (h.channel, "/specdec.v1.Gateway/Generate", True, "specdec.v1.GenerateRequest"),
                (h.channel, "/specdec.v1.Gateway/Complete", False, "specdec.v1.CompleteRequest"),
                (to_verifier, "/specdec.v1.Verifier/Generate", True, "specdec.v1.VerifierGenerateRequest"),
                (to_verifier, "/specdec.v1.Verifier/GetStats", False, "specdec.v1.VerifierGetStatsRequest"),
            ]:
                details = await expect_error(
                    raw(channel, method, streaming), grpc.StatusCode.INVALID_ARGUMENT, "the request is not a valid"
                )
                assert message in details and "DecodeError" not in details
            assert fs.fake.requests == []
            ids, _ = joined(await h.generate(prompt_token_ids=[1, 2], max_tokens=4))  # both serve on
            assert ids == counting(2, 4)

    run(scenario())


def test_verifier_errors_pass_through_unchanged(tokenizer):
    async def scenario() -> None:
        fs = await start_fake()
        async with Harness(tokenizer, [fs]) as h:
            for code, message in [
                (grpc.StatusCode.RESOURCE_EXHAUSTED, "64 requests are already waiting; retry later"),
                (grpc.StatusCode.INVALID_ARGUMENT, "the prompt has 9000 tokens; the context limit is 8192"),
            ]:
                fs.fake.error = (code, message)
                details = await expect_error(h.generate(prompt="hi"), code, message)
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # its only verifier is full: load shed, with a hint
                    assert details.startswith("every verifier's queue is full") and "retry in 1 s" in details
                else:
                    assert details == message
            fs.fake.error = None
            assert joined(await h.generate(prompt_token_ids=[7], max_tokens=3))[0] == counting(1, 3)

    run(scenario())


# -- health and availability ---------------------------------------------------------------------------


def test_unavailable_when_the_only_verifier_is_down_or_unhealthy(tokenizer):
    async def scenario() -> None:
        down = f"127.0.0.1:{free_port()}"  # nothing listens there
        async with Harness(tokenizer, [], extra=[down]) as h:
            await expect_error(h.generate(prompt="hi"), grpc.StatusCode.UNAVAILABLE, "no healthy verifier")
            await expect_error(
                h.stub.Complete(gateway_pb2.CompleteRequest(prompt="hi")),
                grpc.StatusCode.UNAVAILABLE,
                "0 of 1 configured verifier",
            )
            # Bad input is still reported as bad input.
            await expect_error(h.generate(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")

        fs = await start_fake()
        async with Harness(tokenizer, [fs]) as h:
            assert joined(await h.generate(prompt_token_ids=[1], max_tokens=2))[0] == counting(1, 2)
            await fs.set_serving(False)
            await h.wait_healthy(fs, False)
            await expect_error(h.generate(prompt="hi"), grpc.StatusCode.UNAVAILABLE, "no healthy verifier")
            await fs.set_serving(True)
            await h.wait_healthy(fs, True)
            assert joined(await h.generate(prompt_token_ids=[1], max_tokens=2))[0] == counting(1, 2)

    run(scenario())


def test_a_verifier_back_since_the_last_check_is_found_by_the_request_itself(tokenizer):
    async def scenario() -> None:
        fs = await start_fake()
        # Periodic checks far apart: only the on-demand re-check can notice the verifier is back.
        async with Harness(tokenizer, [fs], health_check_interval_s=60.0) as h:
            await fs.set_serving(False)
            await h.gateway.pool.check(h.gateway.pool[fs.address])
            assert not (await h.backend_of(fs)).healthy
            await fs.set_serving(True)
            assert joined(await h.generate(prompt_token_ids=[1], max_tokens=2))[0] == counting(1, 2)

    run(scenario())


def test_gateway_readiness_follows_verifier_health(tokenizer):
    async def scenario() -> None:
        fs = await start_fake()
        async with Harness(tokenizer, [fs]) as h:
            address, service = h.gateway.address, "specdec.v1.Gateway"
            assert await asyncio.to_thread(health_probe.main, [address, "--service", service]) == 0
            await fs.set_serving(False)
            await h.wait_healthy(fs, False)
            for _ in range(100):  # the readiness update follows the backend's state change
                ok, state = await asyncio.to_thread(health_probe.check_once, address, service)
                if not ok:
                    break
                await asyncio.sleep(0.02)
            assert not ok and state == "NOT_SERVING"
            assert await asyncio.to_thread(health_probe.main, [address]) == 0  # liveness is unaffected
            await fs.set_serving(True)
            assert await asyncio.to_thread(health_probe.main, [address, "--service", service, "--wait", "5"]) == 0

    run(scenario())


def test_gateway_health_reflection_stats_and_probe(tokenizer):
    async def scenario() -> None:
        fs = await start_fake()
        async with Harness(tokenizer, [fs]) as h:
            assert await asyncio.to_thread(health_probe.main, [h.gateway.address]) == 0
            assert await asyncio.to_thread(health_probe.main, [fs.address, "--service", VERIFIER_SERVICE]) == 0
            assert await asyncio.to_thread(health_probe.main, [f"127.0.0.1:{free_port()}"]) == 1
            await h.generate(prompt_token_ids=[1], max_tokens=2)
            stats = await h.stub.GetStats(gateway_pb2.GetStatsRequest())
            assert stats.total_requests == 1 and stats.active_requests == 0
            (backend,) = stats.backends
            assert backend.address == fs.address and backend.healthy and backend.HasField("engine")

    run(scenario())


# -- routing -------------------------------------------------------------------------------------------


def test_sessions_stick_to_one_verifier_and_only_a_lost_verifiers_sessions_move(tokenizer):
    sessions = [f"chat-{i}" for i in range(12)]

    async def scenario() -> None:
        fakes = [await start_fake(f"v{i}") for i in range(3)]
        by_address = {f.address: f for f in fakes}
        async with Harness(tokenizer, fakes) as h:

            async def where(session: str) -> str:
                before = {a: len(f.fake.requests) for a, f in by_address.items()}
                await h.generate(prompt_token_ids=[1, 2], max_tokens=1, session_id=session)
                (address,) = [a for a, f in by_address.items() if len(f.fake.requests) > before[a]]
                assert by_address[address].fake.requests[-1].session_id == session
                return address

            first = {s: await where(s) for s in sessions}
            assert len(set(first.values())) >= 2
            assert first == {s: rendezvous_pick(s, h.verifiers) for s in sessions}
            assert {s: await where(s) for s in sessions} == first  # sticky

            lost = fakes[0]
            await lost.server.stop(0)
            await h.wait_healthy(lost, False)
            after = {s: await where(s) for s in sessions}
            for s in sessions:
                if first[s] == lost.address:
                    assert after[s] == rendezvous_order(s, h.verifiers)[1]
                else:
                    assert after[s] == first[s]

    run(scenario())


def test_requests_without_session_go_to_the_least_loaded_verifier(tokenizer):
    async def scenario() -> None:
        fakes = [await start_fake(f"v{i}", script=ONE_CHUNK, hang=True) for i in range(3)]
        async with Harness(tokenizer, fakes) as h:

            async def open_stream() -> tuple[Any, str]:
                call = h.stub.Generate(gateway_pb2.GenerateRequest(prompt_token_ids=[1], max_tokens=4))
                first = await call.read()  # the request is now running on some verifier
                return call, first.request_id

            opened = [await open_stream() for _ in range(3)]
            calls = {request_id: call for call, request_id in opened}
            assert [f.fake.active for f in fakes] == [1, 1, 1]  # one each
            # Free the middle verifier: the next request must go there.
            freed = fakes[1]
            calls.pop(freed.fake.requests[0].request_id).cancel()
            await asyncio.wait_for(freed.fake.cancelled.wait(), 5)
            while (await h.backend_of(freed)).active_requests:
                await asyncio.sleep(0.01)
            call, request_id = await open_stream()
            assert freed.fake.requests[-1].request_id == request_id
            assert [f.fake.active for f in fakes] == [1, 1, 1]
            for c in [*calls.values(), call]:
                c.cancel()

    run(scenario())


# -- cancellation, deadlines -----------------------------------------------------------------------------


def test_client_cancellation_cancels_the_verifier_call(tokenizer):
    async def scenario() -> None:
        fs = await start_fake(script=ONE_CHUNK, hang=True)
        async with Harness(tokenizer, [fs]) as h:
            call = h.stub.Generate(gateway_pb2.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=10))
            first = await call.read()
            assert list(first.token_ids) == counting(2, 2)
            call.cancel()
            await asyncio.wait_for(fs.fake.cancelled.wait(), 5)
            stats = await h.stub.GetStats(gateway_pb2.GetStatsRequest())
            assert stats.active_requests == 0 and stats.backends[0].active_requests == 0

    run(scenario())


def test_deadline_is_passed_to_the_verifier_and_enforced(tokenizer):
    async def scenario() -> None:
        fs = await start_fake(script=ONE_CHUNK, hang=True)
        async with Harness(tokenizer, [fs]) as h:
            await expect_error(
                h.generate(prompt_token_ids=[1], max_tokens=10, timeout=0.5), grpc.StatusCode.DEADLINE_EXCEEDED, ""
            )
            await asyncio.wait_for(fs.fake.cancelled.wait(), 5)
            (remaining,) = fs.fake.time_remaining
            assert remaining is not None and remaining < 0.6  # grpc-timeout is rounded on the wire

    run(scenario())


# -- resume after a verifier failure ---------------------------------------------------------------------


def test_request_resumes_on_another_verifier_when_its_verifier_dies(tokenizer):
    async def scenario() -> None:
        once = {"n": 1}  # exactly one verifier call fails, whichever verifier gets the request first
        fakes = [await start_fake(f"v{i}", fail_after=5, failures_left=once) for i in range(2)]
        async with Harness(tokenizer, fakes) as h:
            prompt = [1, 2, 3]
            responses = await h.generate(prompt_token_ids=prompt, max_tokens=20, session_id="s")
            ids, text = joined(responses)
            assert ids == counting(len(prompt), 20)  # the concatenation, as if nothing had happened
            assert text == tokenizer.decode(ids, clean_up_tokenization_spaces=False)
            last = responses[-1]
            assert last.finish_reason == LENGTH and last.usage.completion_tokens == 20
            assert last.usage.prompt_tokens == len(prompt)
            first_try, resumed = sorted(
                (r for f in fakes for r in f.fake.requests), key=lambda r: len(r.prompt_token_ids)
            )
            assert list(first_try.prompt_token_ids) == prompt and first_try.max_tokens == 20
            assert list(resumed.prompt_token_ids) == prompt + ids[:6]  # 3 chunks of 2 were sent before the failure
            assert resumed.max_tokens == 14
            # Seeded sampling goes on from output position 6 on the new verifier.
            assert first_try.output_offset == 0 and resumed.output_offset == 6
            assert resumed.request_id == first_try.request_id
            # Usage covers both segments: the dead one's drafts come from its running counts (3 steps: 9
            # drafted, 3 accepted), the resumed one's from its final usage (7 steps: 21 drafted, 7 accepted).
            assert last.usage.num_steps == 10
            assert (last.usage.drafted_tokens, last.usage.accepted_tokens) == (30, 10)
            stats = await h.stub.GetStats(gateway_pb2.GetStatsRequest())
            assert stats.resumed_requests == 1

    run(scenario())


def test_keepalives_of_a_queued_request_are_not_silence_and_not_forwarded(tokenizer):
    """A verifier that keeps a request queued for longer than stream_idle_timeout_s but sends keep-alives (empty
    messages) is not given up: no resume, and the client gets only messages with tokens."""

    async def scenario() -> None:
        fakes = [await start_fake(f"v{i}", keepalive_s=1.5) for i in range(2)]
        async with Harness(tokenizer, fakes, stream_idle_timeout_s=0.5) as h:
            prompt = [1, 2, 3]
            responses = await h.generate(prompt_token_ids=prompt, max_tokens=8)
            ids, _ = joined(responses)
            assert ids == counting(len(prompt), 8)
            assert all(r.token_ids for r in responses), "an empty keep-alive reached the client"
            assert sum(len(f.fake.requests) for f in fakes) == 1
            stats = await h.stub.GetStats(gateway_pb2.GetStatsRequest())
            assert stats.resumed_requests == 0 and all(b.healthy for b in stats.backends)

    run(scenario())


def test_a_silent_verifier_stream_is_resumed_elsewhere(tokenizer):
    """A verifier that stops sending (hung, yet healthy) must not hang the client: past stream_idle_timeout_s
    the request resumes on another verifier and the output is exactly the uninterrupted one."""

    async def scenario() -> None:
        once = {"n": 1}
        fakes = [await start_fake(f"v{i}", stall_after=4, failures_left=once) for i in range(2)]
        async with Harness(tokenizer, fakes, stream_idle_timeout_s=0.5) as h:
            responses = await h.generate(prompt_token_ids=[1, 2], max_tokens=12, timeout=10)
            assert joined(responses)[0] == counting(2, 12)
            assert responses[-1].finish_reason == LENGTH and responses[-1].usage.completion_tokens == 12
            assert (await h.stub.GetStats(gateway_pb2.GetStatsRequest())).resumed_requests == 1
            assert any(f.fake.cancelled.is_set() for f in fakes)  # the silent call was cancelled

    run(scenario())


def test_a_full_verifier_is_skipped_and_all_full_sheds_load_with_a_retry_hint(tokenizer):
    full = (grpc.StatusCode.RESOURCE_EXHAUSTED, "256 requests are already waiting; retry later")

    async def scenario() -> None:
        busy, free = await start_fake("busy", error=full), await start_fake("free")
        async with Harness(tokenizer, [busy, free]) as h:
            for session in ("a", "b", "c", "d"):  # whichever verifier a session prefers, it is served
                responses = await h.generate(prompt_token_ids=[1], max_tokens=4, session_id=session)
                assert joined(responses)[0] == counting(1, 4)
            assert len(free.fake.requests) == 4
        fakes = [await start_fake(f"full{i}", error=full) for i in range(2)]
        async with Harness(tokenizer, fakes) as h:
            call = h.stub.Generate(gateway_pb2.GenerateRequest(prompt_token_ids=[1], max_tokens=4))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in call:
                    pass
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "every verifier's queue is full" in (info.value.details() or "")
            assert ("retry-after", "1") in tuple(info.value.trailing_metadata() or ())
            assert [len(f.fake.requests) for f in fakes] == [1, 1]  # each tried once, nothing queued

    run(scenario())


def test_failure_with_no_other_verifier_is_unavailable(tokenizer):
    async def scenario() -> None:
        fs = await start_fake(fail_after=4)
        async with Harness(tokenizer, [fs]) as h:
            call = h.stub.Generate(gateway_pb2.GenerateRequest(prompt_token_ids=[1], max_tokens=10))
            received = []
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for r in call:
                    received.extend(r.token_ids)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert received == counting(1, 4)

    run(scenario())


def test_verifier_dying_after_the_last_token_needs_no_resume(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("All done.")

    async def scenario() -> None:
        # The EOS token arrived, the final message did not: the request is complete, no other verifier needed.
        fs = await start_fake(script=lambda req: [ids, [eos]], abort_at_end=True)
        async with Harness(tokenizer, [fs]) as h:
            responses = await h.generate(prompt_token_ids=[1], max_tokens=10)
            got_ids, text = joined(responses)
            assert got_ids == [*ids, eos] and text == "All done."
            assert responses[-1].finish_reason == STOP and responses[-1].stop_token_id == eos
            assert responses[-1].usage.completion_tokens == len(ids) + 1

    run(scenario())


def test_any_of_the_verifiers_eos_ids_ends_a_request_whose_verifier_died(tokenizer):
    """The model stops on more ids than the tokenizer's EOS (e.g. <|im_end|> and <|endoftext|>): a verifier that
    died right after sending one of them leaves a complete answer, not one to resume."""
    ids = tokenizer.encode("All done.")
    other_eos = 7  # not the tokenizer's EOS, but one of the model's

    async def scenario() -> None:
        # Alone: a resume would find no other verifier and end UNAVAILABLE.
        fs = await start_fake(script=lambda req: [ids, [other_eos]], abort_at_end=True, eos_token_ids=(2, other_eos))
        async with Harness(tokenizer, [fs]) as h:
            for _ in range(200):  # until the stats poll has brought the verifiers' EOS ids
                if other_eos in h.gateway.servicer.router.eos_token_ids():
                    break
                await asyncio.sleep(0.02)
            responses = await h.generate(prompt_token_ids=[1], max_tokens=10)
            got_ids, _ = joined(responses)
            assert got_ids == [*ids, other_eos]
            assert responses[-1].finish_reason == STOP and responses[-1].stop_token_id == other_eos
            assert len(fs.fake.requests) == 1  # no resume

    run(scenario())


def test_tokens_beyond_max_tokens_are_cut(tokenizer):
    async def scenario() -> None:
        fs = await start_fake(script=lambda req: [counting(1, 3), counting(4, 5)], hang=True)
        async with Harness(tokenizer, [fs]) as h:
            responses = await h.generate(prompt_token_ids=[1], max_tokens=6)
            assert joined(responses)[0] == counting(1, 6)
            assert responses[-1].finish_reason == LENGTH and responses[-1].usage.completion_tokens == 6
            await asyncio.wait_for(fs.fake.cancelled.wait(), 5)

    run(scenario())


# -- config ----------------------------------------------------------------------------------------------


def test_config_from_flags_and_environment(monkeypatch):
    monkeypatch.setenv("SPECDEC_MAX_RESUMES", "5")
    cfg = load_gateway_config(["--verifiers", "a:1, b:2", "--tokenizer", "/tok", "--port", "6000"])
    assert cfg.verifiers == ("a:1", "b:2") and cfg.tokenizer == "/tok" and cfg.port == 6000 and cfg.max_resumes == 5
    with pytest.raises(SystemExit):
        load_gateway_config(["--verifiers", "nohostport"])


def test_a_resumed_requests_cached_prompt_tokens_never_exceed_its_prompt():
    """The segment on the second verifier found its longer prompt (prompt + tokens already emitted) in the prefix
    cache; the usage counts the client's prompt only."""
    from gateway.core import GatewayCore, _Accounting, _Segment

    acct = _Accounting()
    acct.add_segment(_Segment(usage=None, steps=50, drafted=150, accepted=50))  # the dead verifier's counts
    resumed = common_pb2.Usage(prompt_tokens=110, cached_prompt_tokens=104, drafted_tokens=30, num_steps=10)
    acct.add_segment(_Segment(usage=resumed, steps=10))

    class Prepared:
        prompt_ids = tuple(range(10))

    usage = GatewayCore._usage(None, Prepared, list(range(120)), acct)  # type: ignore[arg-type]
    assert (usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens) == (10, 10, 120)
