"""Every error path of the OpenAI-compatible HTTP API: OpenAI's error JSON shape and the right status.

The gateway runs in front of FAKE verifiers (tests/service/test_gateway.py): errors are the gateway's own
(validation, auth, routing, load shedding) or a verifier's status passed through, mapped in one place.
"""

from __future__ import annotations

import asyncio
import copy
import ssl
from typing import Any

import grpc
import httpx
import openai
import pytest

from shared.proto_gen.specdec.v1 import gateway_pb2
from tests.service.test_gateway import ONE_CHUNK, Harness, free_port, start_fake
from tests.service.test_gateway_auth import ALICE, key_file

pytestmark = pytest.mark.timeout(90)

MODEL = "specdec-test-model"
CHAT = [{"role": "user", "content": "hi"}]


def run(coro) -> None:
    asyncio.run(coro)


def harness(tokenizer: Any, fakes: list, **config: Any) -> Harness:
    return Harness(tokenizer, fakes, http_port=free_port(), served_model_name=MODEL, **config)


def assert_error(reply: httpx.Response, status: int, kind: str, words: str = "") -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] == kind, error
    assert words in error["message"], error
    return error


BAD_BODIES = [
    ("/v1/chat/completions", {"model": MODEL}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages is empty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "n": 2}, "n must be 1"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "top_logprobs": 2}, "needs logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "stream_options": {"include_usage": True}}, "stream"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "no role"}]}, "role"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, "one prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 1}, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True}, "echo"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, "outside the vocabulary"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
]


def test_bad_requests_unknown_models_and_paths(tokenizer):
    async def scenario() -> None:
        fs = await start_fake()
        async with harness(tokenizer, [fs]) as h, httpx.AsyncClient(base_url=h.gateway.http_url) as http:
            for path, body, words in BAD_BODIES:
                assert_error(await http.post(path, json=body), 400, "invalid_request_error", words)
            json_type = {"content-type": "application/json"}
            reply = await http.post("/v1/completions", content=b"{not json", headers=json_type)
            assert_error(reply, 400, "invalid_request_error")
            error = assert_error(
                await http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404, "not_found_error"
            )
            assert error["code"] == "model_not_found" and "gpt-4" in error["message"]
            assert_error(await http.get("/v1/nothing"), 404, "not_found_error")
            assert_error(await http.get("/v1/completions"), 405, "invalid_request_error")
            assert not fs.fake.requests  # nothing bad reached a verifier
            # the openai client raises its own typed errors for them
            client = openai.AsyncOpenAI(base_url=h.gateway.http_url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(model=MODEL, messages=CHAT, n=2)  # type: ignore[arg-type]
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="gpt-4", prompt="x")

    run(scenario())


def test_a_model_without_a_chat_template_refuses_messages_on_both_apis(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None

    async def scenario() -> None:
        fs = await start_fake()
        async with harness(plain, [fs]) as h, httpx.AsyncClient(base_url=h.gateway.http_url) as http:
            body = {"model": MODEL, "messages": CHAT}
            assert_error(await http.post("/v1/chat/completions", json=body), 400, "invalid_request_error", "template")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.generate(messages=[gateway_pb2.ChatMessage(role="user", content="hi")])
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "chat template" in (info.value.details() or "")
            # a prompt still works
            reply = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3

    run(scenario())


def test_api_keys_rate_limits_and_unavailable_verifiers(tokenizer, tmp_path):
    async def scenario() -> None:
        fs = await start_fake(hang=True)  # every stream stays open: the key's one stream slot stays taken
        path = key_file(tmp_path)
        config = {"api_keys_file": str(path), "api_key_max_concurrent_streams": 1}
        async with harness(tokenizer, [fs], **config) as h, httpx.AsyncClient(base_url=h.gateway.http_url) as http:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 50, "stream": True}
            error = assert_error(await http.post("/v1/completions", json=body), 401, "authentication_error")
            assert error["code"] == "invalid_api_key"
            wrong = {"authorization": "Bearer sk-wrong"}
            assert_error(await http.post("/v1/completions", json=body, headers=wrong), 401, "authentication_error")
            assert_error(await http.get("/v1/models"), 401, "authentication_error")
            assert (await http.get("/health")).status_code == 200  # probes carry no key
            alice = {"authorization": f"Bearer {ALICE}"}
            assert (await http.get("/v1/models", headers=alice)).status_code == 200
            async with http.stream("POST", "/v1/completions", json=body, headers=alice) as first:
                assert first.status_code == 200
                second = await http.post("/v1/completions", json=body, headers=alice)
                error = assert_error(second, 429, "rate_limit_error", "limit")
                assert error["code"] == "rate_limit_exceeded" and second.headers["retry-after"] == "1"
            client = openai.AsyncOpenAI(base_url=h.gateway.http_url + "/v1", api_key="sk-wrong", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await client.completions.create(model=MODEL, prompt="x")

        full = await start_fake(error=(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"))
        async with harness(tokenizer, [full]) as h, httpx.AsyncClient(base_url=h.gateway.http_url) as http:
            reply = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
            assert_error(reply, 429, "rate_limit_error", "queue")
            assert reply.headers["retry-after"] == "1"

        broken = await start_fake(error=(grpc.StatusCode.INTERNAL, "the verifier broke"))
        async with harness(tokenizer, [broken]) as h, httpx.AsyncClient(base_url=h.gateway.http_url) as http:
            reply = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "stream": True})
            assert_error(reply, 500, "server_error", "the verifier broke")

        nobody = [f"127.0.0.1:{free_port()}"]  # nothing listens there
        async with harness(tokenizer, [], extra=nobody) as h, httpx.AsyncClient(base_url=h.gateway.http_url) as http:
            reply = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
            assert_error(reply, 503, "service_unavailable_error")
            assert_error(await http.get("/health"), 503, "service_unavailable_error")

    run(scenario())


def test_the_http_api_serves_tls_and_mutual_tls_like_the_grpc_port(tokenizer, tmp_path):
    from tests.e2e.pki import PKI

    pki = PKI(tmp_path / "pki")
    cert, key = (str(p) for p in pki.leaves["gateway"])
    trusting = ssl.create_default_context(cafile=str(pki.ca))
    presenting = ssl.create_default_context(cafile=str(pki.ca))
    presenting.load_cert_chain(*(str(p) for p in pki.leaves["client"]))

    async def scenario() -> None:
        fs = await start_fake()
        async with harness(tokenizer, [fs], tls_cert_file=cert, tls_key_file=key) as h:
            url = h.gateway.http_url.replace("http://", "https://")
            async with httpx.AsyncClient(base_url=url, verify=trusting) as https:
                for _ in range(100):  # until the first health check of the verifier
                    if (await https.get("/health")).status_code == 200:
                        break
                    await asyncio.sleep(0.05)
                assert (await https.get("/health")).status_code == 200
            async with httpx.AsyncClient(base_url=h.gateway.http_url) as plain:
                with pytest.raises(httpx.HTTPError):
                    await plain.get("/health")
        mutual = {"tls_cert_file": cert, "tls_key_file": key, "tls_ca_file": str(pki.ca)}
        async with harness(tokenizer, [await start_fake()], tls_require_client_cert=True, **mutual) as h:
            url = h.gateway.http_url.replace("http://", "https://")
            async with httpx.AsyncClient(base_url=url, verify=trusting) as anonymous:
                with pytest.raises(httpx.HTTPError):
                    await anonymous.get("/health")
            async with httpx.AsyncClient(base_url=url, verify=presenting) as known:
                assert (await known.get("/health")).status_code in (200, 503)  # through TLS: an answer

    run(scenario())


def test_a_client_that_goes_away_cancels_the_verifier_call(tokenizer):
    """Before the first event, mid-stream, and while waiting for a whole (non-streamed) reply."""

    async def scenario() -> None:
        for body, wait_for_events, script in (
            ({"stream": True}, 0, lambda request: []),  # gone before the first event (no token comes)
            ({"stream": True}, 1, ONE_CHUNK),  # gone mid-stream
            ({}, 0, ONE_CHUNK),  # gone while a whole reply was awaited
        ):
            fs = await start_fake(hang=True, script=script)  # streams its tokens, then stays open until cancelled
            async with harness(tokenizer, [fs]) as h, httpx.AsyncClient(base_url=h.gateway.http_url) as http:
                request = {"model": MODEL, "prompt": "hi", "max_tokens": 50, **body}
                if wait_for_events:
                    async with http.stream("POST", "/v1/completions", json=request) as reply:
                        seen = 0
                        async for line in reply.aiter_lines():
                            seen += line.startswith("data: ")
                            if seen >= wait_for_events:
                                break
                else:
                    with pytest.raises(httpx.ReadTimeout):
                        await http.post("/v1/completions", json=request, timeout=0.5)
                await asyncio.wait_for(fs.fake.cancelled.wait(), 10)
                for _ in range(100):
                    if h.gateway.servicer.counters.active_requests == 0:
                        break
                    await asyncio.sleep(0.02)
                assert h.gateway.servicer.counters.active_requests == 0, body

    run(scenario())


NULL_BODIES = [  # explicit nulls: the field's default, as OpenAI's API takes them
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "n": None, "stream": None, "echo": None}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "presence_penalty": None, "top_k": -1}),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "max_tokens": 2, "logprobs": None, "frequency_penalty": None},
    ),
]


def test_explicit_nulls_and_vllms_top_k_minus_one_are_the_defaults(tokenizer):
    async def scenario() -> None:
        fs = await start_fake()
        async with harness(tokenizer, [fs]) as h, httpx.AsyncClient(base_url=h.gateway.http_url) as http:
            for path, body in NULL_BODIES:
                reply = await http.post(path, json=body)
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["finish_reason"] == "length"
            assert [r.sampling_params.top_k for r in fs.fake.requests] == [0, 0, 0]
            reply = await http.post("/v1/completions", json={"prompt": "x", "top_k": -2})
            assert_error(reply, 400, "invalid_request_error", "top_k")

    run(scenario())
