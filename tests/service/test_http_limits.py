"""The HTTP port gets the gRPC port's limits, and health survives a flood (issue 26, points 1, 5, 7, 8): a real
gateway (gRPC and uvicorn on loopback) in front of a fake verifier, driven over raw sockets where the point is
what a client that misbehaves at the HTTP level does.

- a body over --max-request-bytes: 413 at once when declared, as soon as it passes the limit when streamed;
- connections that send nothing (or headers, or a body, a byte at a time) are closed after
  --http-read-timeout-s while a real request completes beside them; at most --http-max-connections;
- requests in flight past --max-concurrent-rpcs: 503 (port) or 429 (generation slots) with Retry-After, while
  /health and the gRPC health service keep answering; a per-key default stream limit when keys are on;
- numbers outside their proto types, deep schemas, huge roles and chats: 400 with a message, never 500;
  an internal error says nothing internal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import GatewayConfig
from shared.proto_gen.specdec.v1 import gateway_pb2
from tests.service.test_gateway import Harness, free_port, start_fake

pytestmark = pytest.mark.timeout(90)

MODEL = "edge-model"
LIMIT = 64 * 1024  # --max-request-bytes here


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 80))


def http_harness(tokenizer: Any, fakes: list[Any], **config: Any) -> Harness:
    config.setdefault("max_request_bytes", LIMIT)
    config.setdefault("http_port", free_port())
    return Harness(tokenizer, fakes, served_model_name=MODEL, **config)


async def raw_exchange(port: int, data: bytes, read_timeout: float = 10.0) -> tuple[bytes, float]:
    """Sends `data` on a new connection; (everything the server sent until it closed, seconds until then)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    try:
        writer.write(data)
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(), read_timeout)
        return reply, time.monotonic() - started
    finally:
        writer.close()


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0


def body_of(reply: bytes) -> dict[str, Any]:
    return json.loads(reply.split(b"\r\n\r\n", 1)[1])


def post_head(path: str, length: int | None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{framing}\r\n\r\n".encode()


# ---- point 1: body size ---------------------------------------------------------------------------


def test_a_declared_body_over_the_limit_is_413_before_it_is_read(tokenizer):
    async def scenario() -> None:
        fs = await start_fake()
        async with http_harness(tokenizer, [fs]) as h:
            port = h.gateway.http.port
            # 64 MiB declared, 1 KiB sent: answered at once, the connection closed (the rest is never read).
            reply, seconds = await raw_exchange(port, post_head("/v1/completions", 64 << 20) + b"{" * 1024)
            assert status_of(reply) == 413 and seconds < 2
            assert f"the limit is {LIMIT}" in body_of(reply)["error"]["message"]
            assert h.gateway.http.app.refused == {413: 1} and fs.fake.requests == []
            async with httpx.AsyncClient(base_url=h.gateway.http_url) as http:
                ok = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                assert ok.status_code == 200

    run(scenario())


def test_a_streamed_body_is_refused_as_soon_as_it_passes_the_limit(tokenizer):
    async def scenario() -> None:
        fs = await start_fake()
        async with http_harness(tokenizer, [fs]) as h:
            reader, writer = await asyncio.open_connection("127.0.0.1", h.gateway.http.port)
            writer.write(post_head("/v1/completions", None))
            chunk = b"0, " * 10_000  # 30 kB a chunk: refused within the third
            sent = 0
            reply = b""
            try:
                for _ in range(2000):  # up to 60 MB if nobody stops it
                    writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                    await writer.drain()
                    sent += len(chunk)
                    try:
                        reply = await asyncio.wait_for(reader.read(65536), 0.02)
                    except TimeoutError:
                        continue
                    break
            except ConnectionError:
                reply = reply or await reader.read()
            finally:
                writer.close()
            assert status_of(reply) == 413 and "over the limit" in reply.decode(errors="replace")
            assert sent < 20 * LIMIT  # stopped near the limit, not after the whole body
            assert fs.fake.requests == []

    run(scenario())


# ---- point 1: connections and time --------------------------------------------------------------


def test_silent_and_slow_connections_are_closed_while_a_real_request_completes(tokenizer):
    async def scenario() -> None:
        fs = await start_fake(delay=0.05)
        async with http_harness(tokenizer, [fs], http_read_timeout_s=0.5, http_keep_alive_s=0.5) as h:
            port = h.gateway.http.port
            silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(40)]
            slow_headers = await asyncio.open_connection("127.0.0.1", port)
            slow_headers[1].write(b"POST /v1/completions HTTP/1.1\r\nHost")  # and nothing more
            slow_body = await asyncio.open_connection("127.0.0.1", port)
            slow_body[1].write(post_head("/v1/completions", 100) + b'{"prompt"')  # 9 of 100 bytes
            started = time.monotonic()
            async with httpx.AsyncClient(base_url=h.gateway.http_url) as http:
                real = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 16})
            assert real.status_code == 200 and real.json()["usage"]["completion_tokens"] == 16
            ends = await asyncio.gather(*(asyncio.wait_for(r.read(), 5) for r, _ in silent))
            closed_after = time.monotonic() - started
            assert ends == [b""] * 40 and closed_after < 3  # closed by the server, none answered
            assert await asyncio.wait_for(slow_headers[0].read(), 5) == b""
            body_reply = await asyncio.wait_for(slow_body[0].read(), 5)
            assert status_of(body_reply) == 408 and "did not arrive within 0.5 s" in body_reply.decode()
            assert h.gateway.http.connection_stats.closed_silent >= 41
            for _, writer in [*silent, slow_headers, slow_body]:
                writer.close()

    run(scenario())


def test_connections_past_the_limit_are_closed_at_once(tokenizer):
    async def scenario() -> None:
        fs = await start_fake()
        async with http_harness(tokenizer, [fs], http_max_connections=4) as h:
            port = h.gateway.http.port
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
            reply, seconds = await raw_exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert reply == b"" and seconds < 2  # the fifth: closed unanswered
            assert h.gateway.http.connection_stats.refused_over_limit == 1
            for _, writer in held:
                writer.close()
            await asyncio.sleep(0.2)
            reply, _ = await raw_exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert status_of(reply) == 200

    run(scenario())


async def open_unread_stream(h: Harness, max_tokens: int) -> socket.socket:
    """A streaming request on a socket whose buffers (ours and the server's) are a few KiB, so that a client
    that stops reading fills them within a few hundred tokens instead of megabytes of loopback buffers."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", h.gateway.http.port))
    body = json.dumps({"prompt": "Hi", "max_tokens": max_tokens, "stream": True, "return_token_ids": True}).encode()
    sock.send(post_head("/v1/completions", len(body)) + body)
    while not h.gateway.http.server.server_state.connections:
        await asyncio.sleep(0.01)
    for conn in h.gateway.http.server.server_state.connections:
        conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    return sock


def test_a_client_that_stops_reading_is_cut_off_and_its_request_cancelled(tokenizer):
    async def scenario() -> None:
        # The verifier would stream 200k tokens and then hold the call open: only the gateway can end it.
        fs = await start_fake(chunk_size=256, hang=True, max_model_len=1 << 20)
        async with http_harness(tokenizer, [fs], http_write_timeout_s=0.5, max_tokens_limit=1 << 20) as h:
            started = time.monotonic()
            sock = await open_unread_stream(h, 200_000)
            await asyncio.wait_for(fs.fake.cancelled.wait(), 10)
            assert time.monotonic() - started >= 0.5  # not before the timeout
            assert h.gateway.http.connection_stats.closed_unread == 1
            await asyncio.sleep(0.2)  # the grant is released as the response unwinds
            assert fs.fake.active == 0 and h.gateway.servicer.core.active_generations == 0
            sock.close()
            async with httpx.AsyncClient(base_url=h.gateway.http_url) as http:  # the port serves on
                ok = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                assert ok.status_code == 200

    run(scenario())


def test_a_client_that_reads_slowly_but_steadily_is_not_cut_off(tokenizer):
    async def scenario() -> None:
        fs = await start_fake(chunk_size=256, hang=True, max_model_len=1 << 20)
        async with http_harness(tokenizer, [fs], http_write_timeout_s=1.0, max_tokens_limit=1 << 20) as h:
            sock = await open_unread_stream(h, 200_000)
            received = 0
            # 4 s, four timeouts: 4 KiB every 0.1 s, too little for the transport to resume writing within one
            # (it waits for 48 KiB), but it never stops reading: nginx's send_timeout would not cut it either
            for _ in range(40):
                await asyncio.sleep(0.1)
                with contextlib.suppress(BlockingIOError):
                    received += len(sock.recv(4096))
            assert received > 64 * 1024 and h.gateway.http.connection_stats.closed_unread == 0
            assert not fs.fake.cancelled.is_set() and fs.fake.active == 1
            sock.close()

    run(scenario())


async def sse_lines(http: httpx.AsyncClient, body: dict[str, Any]) -> list[str]:
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        return [line async for line in response.aiter_lines() if line]


def test_a_queued_stream_gets_keepalive_comments_until_its_first_token(tokenizer):
    async def scenario() -> None:
        queued = await start_fake("queued", keepalive_s=1.0)  # the verifier holds it a second before a token
        async with (
            http_harness(tokenizer, [queued], http_sse_keepalive_s=0.25) as h,
            httpx.AsyncClient(base_url=h.gateway.http_url, timeout=10) as http,
        ):
            lines = await sse_lines(http, {"prompt": "Hi", "max_tokens": 6, "return_token_ids": True})
        comments = [line for line in lines if line.startswith(":")]
        assert 2 <= len(comments) <= 6 and set(comments) == {": keep-alive"}
        assert lines[: len(comments)] == comments  # all before the first event
        events = [json.loads(line.removeprefix("data: ")) for line in lines[len(comments) : -1]]
        assert [t for e in events for t in e["choices"][0]["token_ids"]] == list(range(1001, 1007))
        assert lines[-1] == "data: [DONE]"

    run(scenario())


def test_a_stream_that_is_not_kept_waiting_gets_no_comment_and_a_refusal_after_one_is_an_error_event(tokenizer):
    async def scenario() -> None:
        fast = await start_fake("fast")
        async with (
            http_harness(tokenizer, [fast], http_sse_keepalive_s=0.25) as h,
            httpx.AsyncClient(base_url=h.gateway.http_url, timeout=10) as http,
        ):
            lines = await sse_lines(http, {"prompt": "Hi", "max_tokens": 6})
            assert not any(line.startswith(":") for line in lines) and lines[-1] == "data: [DONE]"
            fast.fake.fail_after, fast.fake.keepalive_s = 0, 0.6  # waits, then the verifier fails
            lines = await sse_lines(http, {"prompt": "Hi", "max_tokens": 6})
        assert lines[0] == ": keep-alive" and lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and error["message"]

    run(scenario())


def test_a_client_gone_while_its_stream_waits_cancels_the_verifier_call(tokenizer):
    async def scenario() -> None:
        queued = await start_fake("queued", keepalive_s=30.0)
        async with http_harness(tokenizer, [queued], http_sse_keepalive_s=0.2) as h:
            async with httpx.AsyncClient(base_url=h.gateway.http_url, timeout=10) as http:
                body = {"prompt": "Hi", "max_tokens": 6, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    lines = response.aiter_lines()
                    assert await anext(lines) == ": keep-alive"
            await asyncio.wait_for(queued.fake.cancelled.wait(), 5)
            await asyncio.sleep(0.2)  # the grant is released as the response unwinds
            assert h.gateway.servicer.core.active_generations == 0

    run(scenario())


# ---- point 5: the request caps leave health alone ------------------------------------------------


async def grpc_health(address: str) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return [
            (await stub.Check(health_pb2.HealthCheckRequest(service=s), timeout=3)).status
            for s in ("", "specdec.v1.Gateway")
        ]


def test_liveness_answers_while_every_generation_slot_is_held(tokenizer):
    """--max-concurrent-rpcs Generate streams held: gRPC health and /health still answer, and one more
    generation request is refused on either port (RESOURCE_EXHAUSTED, HTTP 429 with Retry-After)."""

    async def scenario() -> None:
        fs = await start_fake(hang=True, script=lambda r: [[1001, 1002]])
        async with http_harness(tokenizer, [fs], max_concurrent_rpcs=6) as h:
            calls = [h.stub.Generate(gateway_pb2.GenerateRequest(prompt="Hi", max_tokens=50)) for _ in range(6)]
            for call in calls:
                await call.read()
            serving = health_pb2.HealthCheckResponse.SERVING
            assert await grpc_health(h.gateway.address) == [serving, serving]
            async with httpx.AsyncClient(base_url=h.gateway.http_url, timeout=10) as http:
                assert (await http.get("/health")).status_code == 200
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await h.generate(prompt="Hi", max_tokens=2)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "its limit" in err.value.details()
                refused = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            for call in calls:
                call.cancel()
            for _ in range(100):
                if h.gateway.servicer.core.active_generations == 0:
                    break
                await asyncio.sleep(0.02)
            assert h.gateway.servicer.core.active_generations == 0  # every slot given back
            assert [r.token_ids for r in await h.generate(prompt="Hi", max_tokens=2)]

    run(scenario())


def test_http_requests_in_flight_past_the_limit_get_503_with_retry_after(tokenizer):
    async def scenario() -> None:
        fs = await start_fake()
        async with http_harness(tokenizer, [fs], max_concurrent_rpcs=2) as h:
            port = h.gateway.http.port
            # Two requests whose bodies are still coming hold the port's two places.
            uploading = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            for _, writer in uploading:
                writer.write(post_head("/v1/completions", 50) + b"{")
            await asyncio.sleep(0.3)
            assert h.gateway.http.app.active == 2
            reply, _ = await raw_exchange(port, post_head("/v1/completions", 2) + b"{}")
            assert status_of(reply) == 503 and b"retry-after: 1" in reply.lower()
            health, _ = await raw_exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert status_of(health) == 200
            for _, writer in uploading:
                writer.close()

    run(scenario())


def test_keys_on_means_a_default_per_key_stream_limit():
    assert GatewayConfig().api_key_max_concurrent_streams == 64


# ---- points 7 and 8: 400, never 500, and nothing internal -----------------------------------------

DEEP_TEXT_SCHEMA = "[" * 100_000 + "]" * 100_000
BAD_BODIES: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"prompt": "Hi", "top_k": 2**32}, "top_k must lie in"),
    ("/v1/completions", {"prompt": "Hi", "top_k": 2**31}, "top_k must lie in"),
    ("/v1/completions", {"prompt": "Hi", "max_draft_tokens": 2**32}, "max_draft_tokens must lie in"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2**40}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "temperature": 1e39}, "temperature must be at most"),
    ("/v1/completions", {"prompt": "Hi", "guided_json": DEEP_TEXT_SCHEMA}, "nested deeper than"),
    ("/v1/chat/completions", {"messages": [{"role": "u" * 4_000_000, "content": "hi"}]}, "(roles and contents)"),
    ("/v1/chat/completions", {"messages": [{"role": "u" * 1000, "content": "hi"}]}, "role has"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 1025}, "the limit is 1024"),
]


@pytest.mark.parametrize("path, body, words", BAD_BODIES, ids=[w for _, _, w in BAD_BODIES])
def test_out_of_range_numbers_deep_schemas_and_huge_chats_are_400(tokenizer, path, body, words):
    async def scenario() -> None:
        fs = await start_fake()
        harness = http_harness(tokenizer, [fs], max_request_bytes=8 << 20)
        async with harness as h, httpx.AsyncClient(base_url=h.gateway.http_url, timeout=20) as http:
            reply = await http.post(path, json=body)
            assert reply.status_code == 400, reply.text[:300]
            assert words in reply.json()["error"]["message"]
            assert fs.fake.requests == []
            ok = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert ok.status_code == 200

    run(scenario())


def test_the_grpc_port_range_checks_the_same_fields(tokenizer):
    async def scenario() -> None:
        fs = await start_fake()
        async with Harness(tokenizer, [fs]) as h:
            role = gateway_pb2.ChatMessage(role="u" * 100, content="hi")
            for fields, words in [
                ({"messages": [role]}, "role has"),
                ({"prompt": "Hi", "temperature": 3.4e38 * 10}, "temperature must be a finite number"),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await h.generate(**fields)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()

    run(scenario())


def test_an_internal_error_tells_the_client_only_a_request_id(tokenizer, caplog):
    async def scenario() -> None:
        fs = await start_fake()
        async with http_harness(tokenizer, [fs]) as h:
            frontend = h.gateway.servicer.preparer

            def broken(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("secret detail /srv/internal 10.0.0.7:50052")

            frontend.prepare = broken  # type: ignore[method-assign]
            async with httpx.AsyncClient(base_url=h.gateway.http_url) as http:
                reply = await http.post("/v1/completions", json={"prompt": "Hi"}, headers={"x-request-id": "r1"})
            message = reply.json()["error"]["message"]
            assert reply.status_code == 500 and "request id" in message
            assert "secret" not in message and "RuntimeError" not in message
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.generate(prompt="Hi", request_id="client-7")
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "client-7" in err.value.details() and "secret" not in err.value.details()
        assert "secret detail" in caplog.text  # the log has it

    run(scenario())
