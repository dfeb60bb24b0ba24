"""The OpenAI-compatible HTTP API with the official `openai` client and raw httpx, against a real gateway.

In-process on loopback: gateway (gRPC and HTTP), verifier with the real default target, n-gram proposer
(speculation on). Checked: chat and completions, streaming and not, stop, seed, usage, logprobs; greedy
output equal to the gRPC API and to transformers' greedy generation with the same chat template; logprobs
equal to transformers' log-softmax; SSE framing; a disconnect frees every KV block; responses validate
against the `openai` package's own pydantic types; chat and logprobs over gRPC too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import httpx
import openai
import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from gateway.config import GatewayConfig
from gateway.server import RunningGateway, start_gateway
from proposer_service.builder import ProposerInfo
from proposer_service.config import ProposerConfig
from proposer_service.ngram import NgramDrafter
from proposer_service.server import ProposerServer
from shared.proto_gen.specdec.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specdec_local.processes import free_port
from tests.integration.test_logprobs import hf_logprobs
from verifier_service.config import VerifierConfig
from verifier_service.server import VerifierServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "specdec-test-model"
CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "The quick brown fox jumps over the lazy dog. Repeat that sentence twice."},
]
ATOL = 1e-4


@dataclass
class Stack:
    proposer: ProposerServer
    verifier: VerifierServer
    gateway: RunningGateway

    @property
    def base_url(self) -> str:
        return self.gateway.http_url + "/v1"

    async def engine_stats(self):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.verifier.port}") as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            return (await stub.GetStats(verifier_pb2.VerifierGetStatsRequest())).stats


@contextlib.asynccontextmanager
async def real_stack(target, tokenizer, **gateway_kw) -> AsyncIterator[Stack]:
    proposer = await ProposerServer.start(
        ProposerConfig(host="127.0.0.1", port=0), NgramDrafter(), ProposerInfo("ngram")
    )
    verifier = await VerifierServer.start(
        VerifierConfig(
            host="127.0.0.1",
            port=0,
            proposer=(f"127.0.0.1:{proposer.port}",),
            max_model_len=512,
            num_speculative_tokens=4,
            adaptive_k=False,
            warm_up=False,
        ),
        target=target,
        model_name="smollm2",
    )
    assert verifier.proposer is not None and await verifier.proposer.wait_connected(10)
    config = GatewayConfig(
        verifiers=(f"127.0.0.1:{verifier.port}",),
        host="127.0.0.1",
        port=0,
        http_port=free_port(),
        served_model_name=MODEL,
        health_check_interval_s=0.2,
        drain_timeout_s=0.5,
        **gateway_kw,
    )
    gateway = await start_gateway(config, tokenizer=tokenizer)
    try:
        for _ in range(100):  # the first stats poll: the gateway knows the context length
            if gateway.servicer.router.context_limit():
                break
            await asyncio.sleep(0.05)
        yield Stack(proposer, verifier, gateway)
    finally:
        await gateway.stop(0)
        await verifier.shutdown(0)
        await proposer.shutdown(0)


def run(coro) -> None:
    asyncio.run(coro)


def chat_prompt_ids(tokenizer) -> list[int]:
    return list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)["input_ids"])


def test_openai_client_chat_and_completions_match_grpc_transformers_and_the_openai_types(target, tokenizer, hf_target):
    async def scenario() -> None:
        async with real_stack(target, tokenizer) as stack:
            client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
            # greedy chat, non-streaming, with logprobs: equal to gRPC and to transformers
            chat = await client.chat.completions.create(
                model=MODEL,
                messages=CHAT,
                max_tokens=24,
                temperature=0,
                logprobs=True,
                top_logprobs=3,
                extra_body={"return_token_ids": True},
            )
            async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                grpc_reply = await stub.Complete(
                    gateway_pb2.CompleteRequest(
                        messages=[gateway_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in CHAT],
                        max_tokens=24,
                        temperature=0,
                        logprobs=True,
                        top_logprobs=3,
                    )
                )
            prompt = chat_prompt_ids(tokenizer)
            with torch.no_grad():
                hf_out = hf_target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
            hf_ids = hf_out[0, len(prompt) :].tolist()
            assert list(grpc_reply.token_ids) == hf_ids
            assert grpc_reply.usage.prompt_tokens == len(prompt)
            assert chat.choices[0].message.content == grpc_reply.text
            assert chat.choices[0].model_extra["token_ids"] == hf_ids  # token for token
            assert chat.usage is not None and chat.usage.completion_tokens == len(hf_ids)
            assert chat.usage.prompt_tokens == len(prompt)
            assert chat.usage.total_tokens == len(prompt) + len(hf_ids)
            extra = chat.usage.model_extra or {}
            assert extra["drafted_tokens"] >= extra["accepted_tokens"] >= 0
            content = chat.choices[0].logprobs.content
            assert [c.token for c in content] == [tokenizer.decode([t]) for t in hf_ids]
            joined = bytes(b for c in content for b in c.bytes).decode()  # the tokens' own bytes: the exact text
            assert joined == tokenizer.decode(hf_ids)
            expected = hf_logprobs(hf_target, prompt, hf_ids)  # [n, vocab]
            for pos, (entry, token) in enumerate(zip(content, hf_ids, strict=True)):
                assert abs(entry.logprob - expected[pos, token].item()) <= ATOL, pos
                top_values = expected[pos].topk(3).values.tolist()
                assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top_values, abs=ATOL)
            assert list(grpc_reply.logprobs.token_logprobs) == pytest.approx([c.logprob for c in content], abs=1e-6)
            assert grpc_reply.logprobs.num_top == 3 and len(grpc_reply.logprobs.top_token_ids) == 3 * len(hf_ids)

            # the same chat streamed: the same text, the usage chunk last
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=CHAT,
                max_tokens=24,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
            assert chunks[0].choices[0].delta.role == "assistant"
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == grpc_reply.text
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(hf_ids)
            assert chunks[-2].choices[0].finish_reason == chat.choices[0].finish_reason

            # completions: a stop string, seeded sampling reproducible, usage
            text_prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"
            full = await client.completions.create(model=MODEL, prompt=text_prompt, max_tokens=20, temperature=0)
            assert full.usage.prompt_tokens == len(tokenizer.encode(text_prompt))
            assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 20
            full_text = full.choices[0].text
            stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]  # greedy: it comes again
            done = await client.completions.create(
                model=MODEL, prompt=text_prompt, max_tokens=20, temperature=0, stop=["\x00never", stop]
            )
            assert done.choices[0].finish_reason == "stop"
            assert done.choices[0].text == full_text[: full_text.index(stop)]
            assert done.choices[0].model_extra["stop_reason"] == stop
            seeded = [
                await client.completions.create(
                    model=MODEL, prompt=text_prompt, max_tokens=16, temperature=0.8, seed=11, logprobs=2
                )
                for _ in range(2)
            ]
            assert seeded[0].choices[0].text == seeded[1].choices[0].text
            lp = seeded[0].choices[0].logprobs
            assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == seeded[0].usage.completion_tokens
            assert all(len(top) <= 2 for top in lp.top_logprobs)
            streamed = await client.completions.create(
                model=MODEL, prompt=text_prompt, max_tokens=16, temperature=0.8, seed=11, stream=True
            )
            assert "".join([c.choices[0].text async for c in streamed]) == seeded[0].choices[0].text

            # the raw JSON validates against the openai package's own types
            async with httpx.AsyncClient(base_url=stack.gateway.http_url, timeout=60) as http:
                body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
                ChatCompletion.model_validate((await http.post("/v1/chat/completions", json=body)).json())
                body = {"model": MODEL, "prompt": text_prompt, "max_tokens": 4, "logprobs": 1}
                Completion.model_validate((await http.post("/v1/completions", json=body)).json())
                models = (await http.get("/v1/models")).json()
                assert [m["id"] for m in models["data"]] == [MODEL]
                openai.types.Model.model_validate(models["data"][0])
                health = await http.get("/health")
                assert health.status_code == 200

            stats = await stack.engine_stats()
            assert stats.drafted_tokens > 0  # speculation was on
            assert stats.kv_blocks_used == 0

    run(scenario())


def sse_events(raw: str) -> list[str]:
    """The data of each SSE event; every event must be exactly one `data: ...` line and a blank line."""
    assert raw.endswith("\n\n"), raw[-40:]
    events = raw[:-2].split("\n\n")
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
    return [e[len("data: ") :] for e in events]


def test_sse_framing_usage_chunk_and_disconnect_frees_kv_blocks(target, tokenizer):
    async def scenario() -> None:
        async with (
            real_stack(target, tokenizer) as stack,
            httpx.AsyncClient(base_url=stack.gateway.http_url, timeout=60) as http,
        ):
            body = {
                "model": MODEL,
                "messages": CHAT,
                "max_tokens": 12,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            reply = await http.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
            events = sse_events(reply.text)
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            for c in chunks:
                ChatCompletionChunk.model_validate(c)
                assert c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"]
            usage = chunks[-1]
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
            assert all(c["usage"] is None for c in chunks[:-1])
            assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
            # completions without include_usage: no usage chunk, [DONE] last
            body = {"model": MODEL, "prompt": "def fibonacci(n):\n", "max_tokens": 6, "stream": True}
            events = sse_events((await http.post("/v1/completions", json=body)).text)
            assert events[-1] == "[DONE]"
            assert all(json.loads(e)["choices"] for e in events[:-1])

            # a client that goes away mid-stream: the request ends and its KV blocks are freed
            long = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/completions", json=long) as streaming:
                seen = 0
                async for line in streaming.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 3:
                        break
            for _ in range(200):
                stats = await stack.engine_stats()
                if stats.running_requests == 0 and stats.kv_blocks_used == 0:
                    break
                await asyncio.sleep(0.05)
            assert stats.running_requests == 0 and stats.waiting_requests == 0
            assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == stats.kv_blocks_total
            assert stats.aborted_requests >= 1
            assert stack.gateway.servicer.counters.active_requests == 0

            # a non-streaming request whose client times out: cancelled the same way
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/completions", json={**long, "stream": False}, timeout=1.0)
            for _ in range(200):
                stats = await stack.engine_stats()
                if stats.running_requests == 0 and stats.kv_blocks_used == 0:
                    break
                await asyncio.sleep(0.05)
            assert stats.running_requests == 0 and stats.kv_blocks_used == 0
            assert stats.aborted_requests >= 2

    run(scenario())


def test_logprobs_of_a_request_resumed_on_another_verifier_are_the_targets(target, tokenizer, hf_target):
    """Seeded sampling, its verifier shut down mid-stream: the gateway resumes it on the other one, and every
    token's logprobs (before and after the resume) equal transformers' log-softmax of the emitted sequence."""

    async def scenario() -> None:
        proposer = await ProposerServer.start(
            ProposerConfig(host="127.0.0.1", port=0), NgramDrafter(), ProposerInfo("ngram")
        )
        verifiers = [
            await VerifierServer.start(
                VerifierConfig(
                    host="127.0.0.1",
                    port=0,
                    proposer=(f"127.0.0.1:{proposer.port}",),
                    max_model_len=512,
                    warm_up=False,
                ),
                target=target,
                model_name="smollm2",
            )
            for _ in range(2)
        ]
        config = GatewayConfig(
            verifiers=tuple(f"127.0.0.1:{v.port}" for v in verifiers),
            host="127.0.0.1",
            port=0,
            http_port=0,
            health_check_interval_s=0.2,
        )
        gateway = await start_gateway(config, tokenizer=tokenizer)
        prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. The quick brown fox")
        try:
            async with grpc.aio.insecure_channel(gateway.address) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                request = gateway_pb2.GenerateRequest(
                    prompt_token_ids=prompt,
                    max_tokens=40,
                    temperature=0.8,
                    seed=5,
                    ignore_eos=True,
                    logprobs=True,
                    top_logprobs=2,
                )
                call = stub.Generate(request, timeout=120)
                ids: list[int] = []
                values: list[float] = []
                stopped = False
                while (msg := await call.read()) is not grpc.aio.EOF:
                    ids += msg.token_ids
                    values += msg.logprobs.token_logprobs
                    assert len(msg.logprobs.top_token_ids) == 2 * len(msg.token_ids)
                    if not stopped and len(ids) >= 4:  # mid-stream: its verifier goes away
                        serving = next(v for v in verifiers if v.loop.num_requests)
                        await serving.shutdown(0)
                        stopped = True
                uninterrupted = [r async for r in stub.Generate(request, timeout=120)]  # on the survivor
            assert gateway.servicer.counters.resumed_requests == 1
            assert len(ids) == 40
            assert ids == [t for r in uninterrupted for t in r.token_ids]  # seeded: the resume is exact
            expected = hf_logprobs(hf_target, prompt, ids)
            for pos, (token, value) in enumerate(zip(ids, values, strict=True)):
                assert abs(value - expected[pos, token].item()) <= ATOL, pos
        finally:
            await gateway.stop(0)
            for v in verifiers:
                await v.shutdown(0)
            await proposer.shutdown(0)

    run(scenario())
