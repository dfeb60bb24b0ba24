"""Sessions and prefix caching through the real gateway and two real verifiers (tiny random weights).

A multi-turn conversation sends the whole conversation as token ids with a `session_id` each turn:
rendezvous routing takes every turn to the verifier holding the session, whose prefix cache then
serves the earlier turns (usage.cached_prompt_tokens). When that verifier goes away the next turn
is served by the other one from scratch, with the same (greedy) output.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.config import GatewayConfig
from gateway.router import rendezvous_order
from gateway.server import start_gateway
from shared.model.loader import load_tokenizer
from shared.proto_gen.specdec.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from shared.settings import default_target_model
from tests.service.test_verifier_service import reference, start_verifier

pytestmark = pytest.mark.timeout(120)

MAX_TOKENS = 10
BLOCK_SIZE = 8  # start_verifier's default


async def verifier_stats(server) -> verifier_pb2.VerifierGetStatsResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        return await verifier_pb2_grpc.VerifierStub(channel).GetStats(verifier_pb2.VerifierGetStatsRequest())


def test_session_turns_hit_the_prefix_cache_and_fall_back_from_scratch():
    tokenizer = load_tokenizer(default_target_model())

    async def scenario() -> None:
        verifiers = [await start_verifier() for _ in range(2)]
        addresses = tuple(f"127.0.0.1:{v.port}" for v in verifiers)
        config = GatewayConfig(
            verifiers=addresses, host="127.0.0.1", port=0, http_port=0, health_check_interval_s=0.1, drain_timeout_s=0.5
        )
        gateway = await start_gateway(config, tokenizer=tokenizer)
        session = "chat-42"
        home, other = (addresses.index(a) for a in rendezvous_order(session, addresses))
        try:
            async with grpc.aio.insecure_channel(gateway.address) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                conversation = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]  # "system prompt"
                for turn in range(4):
                    if turn == 3:  # the session's verifier goes away: the turn is served elsewhere
                        await verifiers[home].shutdown(0)
                    reply = await stub.Complete(
                        gateway_pb2.CompleteRequest(
                            session_id=session, prompt_token_ids=conversation, max_tokens=MAX_TOKENS, temperature=0
                        ),
                        timeout=30,
                    )
                    assert list(reply.token_ids) == reference(tuple(conversation), MAX_TOKENS), f"turn {turn}"
                    cached = reply.usage.cached_prompt_tokens
                    if turn == 0 or turn == 3:
                        assert cached == 0, f"turn {turn} computed from scratch"
                    else:  # the previous turn's prompt and output, in full blocks, minus the uncomputed last token
                        previous = len(conversation) - 3  # without the new user turn
                        assert cached >= (previous - 1) // BLOCK_SIZE * BLOCK_SIZE > 0, f"turn {turn}"
                    new_user_turn = [10 + turn, 20 + turn, 30 + turn]
                    conversation = conversation + list(reply.token_ids) + new_user_turn
                fallback_stats = (await verifier_stats(verifiers[other])).stats
                assert fallback_stats.prefix_cache_hit_tokens == 0  # the fallback verifier had no cache to use
                assert fallback_stats.prefix_cache_query_tokens > 0
        finally:
            await gateway.stop(0)
            for v in verifiers:
                await v.shutdown(0)

    asyncio.run(asyncio.wait_for(scenario(), 100))


def test_verifier_stats_report_prefix_cache_counters():
    async def scenario() -> None:
        server = await start_verifier()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                prompt = list(range(1, 30))
                for request_id in ("a", "b"):
                    request = verifier_pb2.VerifierGenerateRequest(
                        request_id=request_id, prompt_token_ids=prompt, max_tokens=4
                    )
                    last = [m async for m in stub.Generate(request)][-1]
                stats = (await stub.GetStats(verifier_pb2.VerifierGetStatsRequest())).stats
            assert last.usage.cached_prompt_tokens == 24  # 29 tokens: three full blocks of 8, the rest computed
            assert stats.prefix_cache_query_tokens == 58 and stats.prefix_cache_hit_tokens == 24
            assert stats.prefix_cache_hit_rate == pytest.approx(24 / 58)
            assert stats.kv_blocks_cached > 0 and stats.kv_blocks_free == stats.kv_blocks_total
        finally:
            await server.shutdown(0)

    asyncio.run(asyncio.wait_for(scenario(), 60))
