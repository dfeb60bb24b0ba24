"""API keys at the real gateway (grpc.aio on loopback): UNAUTHENTICATED before any work, per-key limits, reloads.

Most tests put the gateway in front of the FAKE counting verifier of test_gateway.py (token at position p is
1000 + p), whose recorded requests prove that a refused request never reached it; one runs a real verifier
(tiny random weights) and checks greedy output against the reference the verifier tests use.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from typing import Any

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway import client, health_probe
from gateway.config import GatewayConfig, load_gateway_config
from gateway.server import start_gateway
from shared.grpc_server import add_health_and_reflection, new_server
from shared.proto_gen.specdec.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2_grpc
from shared.telemetry import setup_telemetry
from tests.service.test_gateway import (
    ONE_CHUNK,
    FakeServer,
    FakeVerifier,
    Harness,
    counting,
    expect_error,
    joined,
)
from tests.service.test_telemetry import no_otel_environment, points  # noqa: F401 (autouse fixture)
from tests.service.test_verifier_service import reference, start_verifier

pytestmark = pytest.mark.timeout(90)

ALICE = "sk-alice-3f9c2e7a1b5d4c8e"
BOB = "sk-bob-9a8b7c6d5e4f3a2b"  # stored as its sha256 only
CAROL = "sk-carol-1234567890abcdef"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def write_keys(path, text: str) -> None:
    """Rewrite the key file; the mtime is pushed on so the change shows even within the clock's resolution."""
    path.write_text(text)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def key_file(tmp_path, extra: str = "") -> Any:
    path = tmp_path / "api-keys"
    write_keys(
        path,
        "# test keys: KEY_OR_SHA256 [NAME] [OPTION=N ...]\n"
        f"{ALICE} alice\n"
        f"sha256:{hashlib.sha256(BOB.encode()).hexdigest()} bob\n" + extra,
    )
    return path


class RecordingVerifier(FakeVerifier):
    """The fake counting verifier, also keeping each call's metadata (the key must not travel on)."""

    metadata: list[dict[str, str]]

    async def Generate(self, request, context):
        self.metadata.append({k: str(v) for k, v in context.invocation_metadata() or ()})
        return await super().Generate(request, context)


async def start_recording_fake(**kwargs: Any) -> FakeServer:
    fake = RecordingVerifier("v", **kwargs)
    fake.metadata = []
    server = new_server()
    verifier_pb2_grpc.add_VerifierServicer_to_server(fake, server)
    health = add_health_and_reflection(server, ["specdec.v1.Verifier"])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    fs = FakeServer(fake, server, health, f"127.0.0.1:{port}")
    await fs.set_serving(True)
    return fs


class AuthHarness(Harness):
    """Harness with the gateway's own in-memory span exporter and metric reader."""

    def __init__(self, tokenizer: Any, fakes: list[FakeServer], **config: Any) -> None:
        super().__init__(tokenizer, fakes, **config)
        self.spans = InMemorySpanExporter()
        self.metrics = InMemoryMetricReader()

    async def __aenter__(self) -> AuthHarness:
        telemetry = setup_telemetry(
            "specdec-gateway", span_processors=[SimpleSpanProcessor(self.spans)], metric_readers=[self.metrics]
        )
        self.gateway = await start_gateway(self.config, tokenizer=self.tokenizer, telemetry=telemetry)
        self.channel = grpc.aio.insecure_channel(self.gateway.address)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        return self

    async def generate_as(self, key: str | None, **fields: Any) -> list[gateway_pb2.GenerateResponse]:
        call = self.stub.Generate(
            gateway_pb2.GenerateRequest(**fields), timeout=10, metadata=auth(key) if key else None
        )
        return [r async for r in call]

    def metric(self, name: str) -> dict[tuple, float]:
        return points(self.metrics).get(name, {})


async def refused(awaitable: Any, code: grpc.StatusCode, match: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await awaitable
    assert info.value.code() == code, info.value.details()
    assert match in (info.value.details() or ""), info.value.details()
    return info.value


def retry_after(err: grpc.aio.AioRpcError) -> int:
    (value,) = [v for k, v in err.trailing_metadata() or () if k == "retry-after"]
    return int(value)


def test_missing_wrong_and_revoked_keys_are_refused_before_any_work(tokenizer, tmp_path, caplog):
    path = key_file(tmp_path)

    async def scenario() -> None:
        fs = await start_recording_fake()
        async with AuthHarness(tokenizer, [fs], api_keys_file=str(path)) as h:
            tokenized: list[str] = []
            tokenize = h.gateway.servicer.preparer.tokenize
            h.gateway.servicer.preparer.tokenize = lambda text: (tokenized.append(text), tokenize(text))[1]
            generate = dict(prompt="Hello there", max_tokens=6)
            complete = gateway_pb2.CompleteRequest(prompt="Hello there", max_tokens=6)

            # No key, a wrong key, a malformed header: UNAUTHENTICATED on every Gateway method.
            await refused(h.generate_as(None, **generate), UNAUTHENTICATED, "an API key is required")
            await refused(h.stub.Complete(complete), UNAUTHENTICATED, "Bearer <key>")
            await refused(h.stub.GetStats(gateway_pb2.GetStatsRequest()), UNAUTHENTICATED, "API key is required")
            await refused(h.generate_as("sk-wrong", **generate), UNAUTHENTICATED, "the API key is not valid")
            await refused(h.stub.Complete(complete, metadata=auth(CAROL)), UNAUTHENTICATED, "not valid")
            await refused(
                h.stub.Complete(complete, metadata=(("authorization", ALICE),)), UNAUTHENTICATED, "one 'Bearer <key>'"
            )
            assert fs.fake.requests == [] and tokenized == []  # nothing was tokenized or sent to the verifier

            # Right keys, plain and sha256 form: the exact output.
            prompt_len = len(tokenizer.encode("Hello there"))
            ids, text = joined(await h.generate_as(ALICE, **generate))
            assert ids == counting(prompt_len, 6) and text == tokenizer.decode(ids, clean_up_tokenization_spaces=False)
            reply = await h.stub.Complete(complete, metadata=auth(BOB))
            assert list(reply.token_ids) == ids and reply.text == text
            stats = await h.stub.GetStats(gateway_pb2.GetStatsRequest(), metadata=auth(ALICE))
            assert stats.total_requests == 2 and len(fs.fake.requests) == 2
            assert all("authorization" not in md for md in fs.fake.metadata)  # the key stays at the gateway
            assert [r.tenant for r in fs.fake.requests] == ["alice", "bob"]  # its name travels as the tenant

            # Editing the file during the run: alice revoked, carol added; no restart.
            write_keys(path, f"sha256:{hashlib.sha256(BOB.encode()).hexdigest()} bob\n{CAROL} carol\n")
            await refused(h.generate_as(ALICE, **generate), UNAUTHENTICATED, "not valid")
            assert joined(await h.generate_as(CAROL, **generate))[0] == ids
            assert joined(await h.generate_as(BOB, prompt_token_ids=[1, 2], max_tokens=3))[0] == counting(2, 3)
            assert len(fs.fake.requests) == 4 and len(tokenized) == 3
            assert [r.tenant for r in fs.fake.requests[2:]] == ["carol", "bob"]

            assert h.metric("specdec_gateway_auth_rejections") == {
                (("reason", "missing"),): 3,
                (("reason", "unknown"),): 2,
                (("reason", "malformed"),): 1,
                (("reason", "revoked"),): 1,
            }
            assert h.metric("specdec_gateway_requests") == {(("code", "OK"),): 4}  # refusals are not requests

    with caplog.at_level(logging.DEBUG):
        asyncio.run(scenario())
    assert "event=unauthenticated reason=revoked" in caplog.text
    assert "event=api_keys_reloaded" in caplog.text


def test_health_and_reflection_need_no_key(tokenizer, tmp_path):
    path = key_file(tmp_path)

    async def scenario() -> None:
        fs = await start_recording_fake()
        async with AuthHarness(tokenizer, [fs], api_keys_file=str(path)) as h:
            address = h.gateway.address
            assert await asyncio.to_thread(health_probe.main, [address]) == 0
            assert await asyncio.to_thread(health_probe.main, [address, "--service", "specdec.v1.Gateway"]) == 0
            # Reflection's default belongs to its own flag: here only that a key is never what it asks for.
            stub = reflection_pb2_grpc.ServerReflectionStub(h.channel)
            call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            try:
                replies = [r async for r in call]
                names = {s.name for s in replies[0].list_services_response.service}
                assert "specdec.v1.Gateway" in names
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.UNIMPLEMENTED  # reflection turned off, not refused
            assert h.metric("specdec_gateway_auth_rejections") == {}

    asyncio.run(scenario())


def test_per_key_concurrent_streams_limit_answers_resource_exhausted_with_retry_after(tokenizer, tmp_path):
    path = key_file(tmp_path, f"{CAROL} carol max_streams=0\n")

    async def scenario() -> None:
        fs = await start_recording_fake(script=ONE_CHUNK, hang=True)
        async with AuthHarness(tokenizer, [fs], api_keys_file=str(path), api_key_max_concurrent_streams=1) as h:

            async def open_stream(key: str) -> Any:
                call = h.stub.Generate(
                    gateway_pb2.GenerateRequest(prompt_token_ids=[1], max_tokens=8), timeout=10, metadata=auth(key)
                )
                assert list((await call.read()).token_ids) == counting(1, 2)
                return call

            running = await open_stream(ALICE)
            err = await refused(open_stream(ALICE), RESOURCE_EXHAUSTED, "API key 'alice' has 1 requests running")
            assert "its limit is 1; retry after 1 s" in err.details() and retry_after(err) == 1
            err = await refused(
                h.stub.Complete(gateway_pb2.CompleteRequest(prompt="x"), metadata=auth(ALICE)),
                RESOURCE_EXHAUSTED,
                "retry after",
            )
            assert retry_after(err) == 1
            others = [await open_stream(BOB), await open_stream(CAROL), await open_stream(CAROL)]  # own budgets
            await refused(open_stream(BOB), RESOURCE_EXHAUSTED, "'bob'")
            assert len(fs.fake.requests) == 4  # the refused requests never reached the verifier
            # GetStats is not a stream: it needs the key, not a slot.
            assert (await h.stub.GetStats(gateway_pb2.GetStatsRequest(), metadata=auth(ALICE))).active_requests == 4

            running.cancel()  # the slot frees when the request has ended
            for _ in range(100):
                try:
                    others.append(await open_stream(ALICE))
                    break
                except grpc.aio.AioRpcError as e:
                    assert e.code() == RESOURCE_EXHAUSTED
                    await asyncio.sleep(0.05)
            else:
                raise AssertionError("alice's slot was never released")
            limited = {dict(labels)["api_key"]: n for labels, n in h.metric("specdec_gateway_rate_limited").items()}
            assert all(dict(labels)["limit"] == "streams" for labels in h.metric("specdec_gateway_rate_limited"))
            assert limited["bob"] == 1 and limited["alice"] >= 2  # alice: plus each retry while the slot was held
            assert set(limited) == {"alice", "bob"}
            for call in others:
                call.cancel()

    asyncio.run(scenario())


def test_tokens_per_minute_limit_answers_resource_exhausted(tokenizer, tmp_path):
    path = key_file(tmp_path, f"{CAROL} carol tpm=0\n")

    async def scenario() -> None:
        fs = await start_recording_fake()
        async with AuthHarness(tokenizer, [fs], api_keys_file=str(path), api_key_max_tokens_per_minute=10) as h:
            # 3 prompt + 8 generated = 11 tokens: admitted (the budget was not used up), then the key waits.
            assert joined(await h.generate_as(ALICE, prompt_token_ids=[1, 2, 3], max_tokens=8))[0] == counting(3, 8)
            err = await refused(
                h.generate_as(ALICE, prompt_token_ids=[1], max_tokens=1), RESOURCE_EXHAUSTED, "used 11 tokens"
            )
            assert "its limit is 10 per minute; retry after" in err.details()
            assert 1 <= retry_after(err) <= 60
            assert f"retry after {retry_after(err)} s" in err.details()
            # Other names have their own windows; carol's override is unlimited.
            assert joined(await h.generate_as(BOB, prompt_token_ids=[1], max_tokens=4))[0] == counting(1, 4)
            for _ in range(3):
                assert joined(await h.generate_as(CAROL, prompt_token_ids=[1, 2, 3], max_tokens=8))[0] == counting(3, 8)
            assert len(fs.fake.requests) == 5
            assert h.metric("specdec_gateway_rate_limited") == {
                (("api_key", "alice"), ("limit", "tokens_per_minute")): 1
            }

    asyncio.run(scenario())


def test_the_key_never_appears_in_logs_or_spans_but_its_name_does(tokenizer, tmp_path, caplog):
    path = key_file(tmp_path, f"{CAROL} carol max_streams=1\n")

    async def scenario() -> AuthHarness:
        fs = await start_recording_fake()
        async with AuthHarness(tokenizer, [fs], api_keys_file=str(path)) as h:
            await h.generate_as(ALICE, prompt="Hi", max_tokens=3, request_id="with-key")
            await h.stub.Complete(gateway_pb2.CompleteRequest(prompt="Hi", max_tokens=2), metadata=auth(BOB))
            await refused(h.generate_as(ALICE + "x", prompt="Hi"), UNAUTHENTICATED, "")
            await refused(h.generate_as(CAROL, prompt="Hi", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "")
            write_keys(path, f"{BOB} bob\n")
            await refused(h.generate_as(ALICE, prompt="Hi"), UNAUTHENTICATED, "")
            write_keys(path, f"{BOB} bob tpm=nope\n")  # a bad edit: logged, without the key
            await h.generate_as(BOB, prompt="Hi", max_tokens=1)
        return h

    with caplog.at_level(logging.DEBUG):
        h = asyncio.run(scenario())
    spans = h.spans.get_finished_spans()
    request_spans = [s for s in spans if s.name == "gateway.request"]
    assert len(request_spans) == 4
    names = {s.attributes.get("specdec.api_key_name") for s in request_spans}
    (keyed,) = [s for s in request_spans if s.attributes.get("specdec.client_request_id") == "with-key"]
    assert keyed.attributes.get("specdec.api_key_name") == "alice" and names == {"alice", "bob", "carol"}
    assert "api_key=alice" in caplog.text and "event=api_keys_reload_failed" in caplog.text
    dumped = caplog.text + "".join(s.to_json() for s in spans)
    for key in (ALICE, BOB, CAROL):
        assert key not in dumped


def test_right_key_gives_the_greedy_reference_of_a_real_verifier(tokenizer, tmp_path):
    path = key_file(tmp_path)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]

    async def scenario() -> None:
        verifier = await start_verifier()
        configs = [
            GatewayConfig(verifiers=(f"127.0.0.1:{verifier.port}",), host="127.0.0.1", port=0, http_port=0, **extra)
            for extra in ({"api_keys_file": str(path)}, {})
        ]
        gateways = [await start_gateway(c, tokenizer=tokenizer) for c in configs]
        try:
            outputs = []
            for gateway, metadata in zip(gateways, (auth(ALICE), None), strict=True):
                async with grpc.aio.insecure_channel(gateway.address) as channel:
                    stub = gateway_pb2_grpc.GatewayStub(channel)
                    request = gateway_pb2.CompleteRequest(prompt_token_ids=prompt, max_tokens=12, temperature=0)
                    outputs.append(list((await stub.Complete(request, timeout=30, metadata=metadata)).token_ids))
                    if metadata:
                        await expect_error(stub.Complete(request, timeout=30), UNAUTHENTICATED, "API key is required")
            assert outputs[0] == outputs[1] == reference(tuple(prompt), 12)
        finally:
            for gateway in gateways:
                await gateway.stop(0)
            await verifier.shutdown(0)

    asyncio.run(asyncio.wait_for(scenario(), 80))


def test_api_key_flags_and_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_API_KEYS_FILE", "/etc/specdec/keys")
    monkeypatch.setenv("SPECDEC_API_KEY_MAX_TOKENS_PER_MINUTE", "20000")
    cfg = load_gateway_config(["--api-key-max-concurrent-streams", "4"])
    assert cfg.api_keys_file == "/etc/specdec/keys"
    assert (cfg.api_key_max_concurrent_streams, cfg.api_key_max_tokens_per_minute) == (4, 20000)
    assert load_gateway_config(["--api-keys-file", ""]).api_keys_file == ""  # the flag beats the environment
    monkeypatch.delenv("SPECDEC_API_KEYS_FILE")
    assert load_gateway_config([]).api_keys_file == ""  # the default: no keys, as before
    with pytest.raises(SystemExit):
        load_gateway_config(["--api-key-max-concurrent-streams", "-1"])

    bad = tmp_path / "keys"
    bad.write_text(f"{ALICE} alice\n{ALICE} again\n")

    async def start_bad() -> None:
        config = GatewayConfig(host="127.0.0.1", port=0, http_port=0, api_keys_file=str(bad))
        await start_gateway(config, tokenizer=object())

    with pytest.raises(ValueError, match="line 2: the same key"):
        asyncio.run(start_bad())


def test_the_specdec_client_sends_its_key(tokenizer, tmp_path, monkeypatch, capsys):
    path = key_file(tmp_path)

    async def scenario() -> list[int]:
        fs = await start_recording_fake()
        async with AuthHarness(tokenizer, [fs], api_keys_file=str(path)) as h:
            argv = ["--address", h.gateway.address, "--prompt-token-ids", "1,2", "--max-tokens", "4", "--json"]
            codes = [await asyncio.to_thread(client.run, client.build_parser().parse_args(argv))]
            monkeypatch.setenv("SPECDEC_API_KEY", ALICE)
            codes.append(await asyncio.to_thread(client.run, client.build_parser().parse_args(argv)))
            codes.append(await asyncio.to_thread(client.run, client.build_parser().parse_args([*argv, "--unary"])))
            return codes

    assert asyncio.run(scenario()) == [1, 0, 0]
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0] == {"type": "error", "code": "UNAUTHENTICATED", "message": lines[0]["message"]}
    finals = [line for line in lines if line["type"] == "final"]
    assert [f["token_ids"] for f in finals] == [counting(2, 4)] * 2
