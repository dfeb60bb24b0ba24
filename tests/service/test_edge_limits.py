"""No request can hurt another (issue 12, point 3), over real gRPC on loopback.

Gateway: bounded prompts, ids and messages with clear statuses; the client's request_id is only echoed (an
internal id keys the request, so two clients that both send "1" do not collide); tokenization runs off the
event loop; reflection and backend details are off unless asked for; a verifier call always has a deadline.
Verifier: a temperature of 1e-40 is greedy and does not break the batch it shares.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway.config import GatewayConfig
from proposer_service.config import ProposerConfig
from shared.proto_gen.specdec.v1 import gateway_pb2, verifier_pb2_grpc
from tests.service.test_gateway import Harness, expect_error, start_fake
from tests.service.test_verifier_service import PROMPTS, collect, reference, request, start_verifier
from verifier_service.config import VerifierConfig

INVALID = grpc.StatusCode.INVALID_ARGUMENT


class ThreadRecordingTokenizer:
    """Wraps the real tokenizer; records which thread each encode ran on."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.encode_threads: list[int] = []

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        self.encode_threads.append(threading.get_ident())
        return self._tokenizer.encode(text, *args, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def test_bounds_are_invalid_argument_before_any_verifier_call(tokenizer):
    async def scenario() -> None:
        fs = await start_fake()
        async with Harness(tokenizer, [fs], max_prompt_chars=1000, max_prompt_tokens=50) as h:
            cases = [
                (dict(prompt="a" * 1001), "the limit is 1000"),
                (dict(prompt_token_ids=list(range(1, 52))), "the limit is 50"),
                (dict(prompt="word " * 200), "the limit is 50"),  # 1000 characters, but > 50 tokens
                (dict(prompt="Hi", request_id="x" * 129), "limit is 128"),
                (dict(prompt="Hi", request_id="1\nts=0 level=ERROR msg=forged"), "only letters"),
                (dict(prompt="Hi", session_id="s 1"), "session_id may contain only"),
                (dict(prompt="Hi", stop=["x"] * 17), "stop strings"),
                (dict(prompt="Hi", stop_token_ids=list(range(65))), "stop token ids"),
                (dict(prompt="Hi", max_tokens=10**9), "max_tokens"),
            ]
            for fields, words in cases:
                await expect_error(h.generate(**fields), INVALID, words)
            assert fs.fake.requests == []

    asyncio.run(scenario())


def test_a_message_over_the_size_limit_is_refused_and_the_gateway_serves_on(tokenizer):
    async def scenario() -> None:
        fs = await start_fake()
        async with Harness(tokenizer, [fs], max_request_bytes=64 * 1024) as h:
            await expect_error(h.generate(prompt="a" * 100_000), grpc.StatusCode.RESOURCE_EXHAUSTED, "")
            assert fs.fake.requests == []
            assert [r.token_ids for r in await h.generate(prompt="Hi", max_tokens=2)]

    asyncio.run(scenario())


def test_the_clients_request_id_is_echoed_but_never_the_key(tokenizer):
    async def scenario() -> None:
        fs = await start_fake()
        async with Harness(tokenizer, [fs]) as h:
            first, second, unnamed = await asyncio.gather(
                h.generate(prompt="Hi", max_tokens=4, request_id="1"),
                h.generate(prompt="Hello", max_tokens=4, request_id="1"),
                h.generate(prompt="Hey", max_tokens=4),
            )
            assert {r.request_id for r in first + second} == {"1"}
            assert len({r.request_id for r in unnamed}) == 1 and unnamed[0].request_id != "1"
            sent = [r.request_id for r in fs.fake.requests]
            assert len(set(sent)) == 3 and "1" not in sent  # each request has its own internal id
            assert unnamed[0].request_id in sent  # a client without an id gets the internal one

    asyncio.run(scenario())


def test_tokenization_runs_off_the_event_loop(tokenizer):
    async def scenario() -> None:
        fs = await start_fake()
        recording = ThreadRecordingTokenizer(tokenizer)
        async with Harness(recording, [fs]) as h:
            loop_thread = threading.get_ident()  # the gateway runs on this test's event loop
            await h.generate(prompt="Tell me about tokenizers. " * 3, max_tokens=2)
            assert recording.encode_threads and loop_thread not in recording.encode_threads

    asyncio.run(scenario())


def test_reflection_and_backend_details_are_off_by_default(tokenizer):
    async def scenario() -> None:
        fs = await start_fake()
        async with Harness(tokenizer, [fs], enable_reflection=False, expose_backends=False) as h:
            stats = await h.stub.GetStats(gateway_pb2.GetStatsRequest())
            assert len(stats.backends) == 0
            stub = reflection_pb2_grpc.ServerReflectionStub(h.channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                ):
                    pass
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        async with Harness(tokenizer, [fs], enable_reflection=True, expose_backends=True) as h:
            stats = await h.stub.GetStats(gateway_pb2.GetStatsRequest())
            assert [b.address for b in stats.backends] == [fs.address]

    asyncio.run(scenario())


def test_a_verifier_call_without_a_client_deadline_still_gets_one(tokenizer):
    async def scenario() -> None:
        fs = await start_fake()
        async with Harness(tokenizer, [fs], verifier_call_timeout_s=321.0) as h:
            await h.generate(prompt="Hi", max_tokens=2, timeout=None)
            (remaining,) = fs.fake.time_remaining
            assert remaining is not None and 300 < remaining <= 322  # gRPC rounds deadlines up

    asyncio.run(scenario())


def test_internal_services_listen_on_loopback_by_default():
    assert VerifierConfig().host == "127.0.0.1" and ProposerConfig().host == "127.0.0.1"
    assert GatewayConfig().enable_reflection is False and GatewayConfig().expose_backends is False


def test_a_tiny_temperature_is_greedy_and_does_not_break_the_batch():
    """On main before the fix, temperature=1e-40 made every probability NaN and the verifier failed the whole
    batch with INTERNAL."""

    async def body() -> None:
        verifier = await start_verifier()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                tiny = request(PROMPTS[0], 20, params={"temperature": 1e-40})
                (tiny_tokens, _), (plain_tokens, _) = await asyncio.gather(
                    collect(stub, tiny), collect(stub, request(PROMPTS[2], 20))
                )
                assert tiny_tokens == reference(tuple(PROMPTS[0]), 20)
                assert plain_tokens == reference(tuple(PROMPTS[2]), 20)
        finally:
            await verifier.shutdown(0.5)

    asyncio.run(asyncio.wait_for(body(), 60))
