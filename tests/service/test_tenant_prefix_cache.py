"""No tenant can probe another's prompts through the prefix cache (issue 26, point 4).

The prefix cache is salted with the API key's name (the tenant on the wire): a real gateway with two keys in
front of a real verifier (tiny target) on loopback. Key A's prompt is cached for A (its repeat reports cached
tokens) and never for B (B's identical prompt reports 0 cached tokens and is computed afresh), and the outputs
stay exactly the plain greedy ones. Unit level: the block manager's salted chains, and the proposer's draft
cache (same BlockManager, salted with DraftRequest.tenant).
"""

from __future__ import annotations

import asyncio

import pytest

from shared.kv.block_manager import BlockManager
from shared.proto_gen.specdec.v1 import gateway_pb2
from tests.service.test_gateway import Harness
from tests.service.test_gateway_auth import ALICE, BOB, auth, key_file
from tests.service.test_verifier_service import reference, start_verifier

pytestmark = pytest.mark.timeout(90)

PROMPT = [(7 * i + 3) % 120 for i in range(66)]  # 8 full blocks of 8, then the tokens computed each time


def test_one_keys_prompt_is_never_a_cache_hit_for_another_key_but_is_for_itself(tokenizer, tmp_path):
    async def scenario() -> None:
        verifier = await start_verifier()
        harness = Harness(tokenizer, [], extra=[f"127.0.0.1:{verifier.port}"], api_keys_file=str(key_file(tmp_path)))
        try:
            async with harness as h:
                while h.gateway.servicer.router.vocab_limit() != 128:  # the verifier's stats reached the gateway
                    await asyncio.sleep(0.02)

                async def complete(key: str) -> tuple[list[int], int]:
                    request = gateway_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=8)
                    call = h.stub.Generate(request, timeout=30, metadata=auth(key))
                    msgs = [m async for m in call]
                    return [t for m in msgs for t in m.token_ids], msgs[-1].usage.cached_prompt_tokens

                expected = reference(tuple(PROMPT), 8)
                assert await complete(ALICE) == (expected, 0)  # first sight: nothing cached
                stats = verifier.loop.stats()
                assert stats.kv_blocks_cached >= 8  # A's blocks are in the cache now
                assert await complete(BOB) == (expected, 0)  # B's identical prompt: no hit, computed afresh
                tokens, cached = await complete(ALICE)
                assert tokens == expected and cached == 64  # A's own repeat hits its 8 blocks
                tokens, cached = await complete(BOB)
                assert tokens == expected and cached == 64  # ... and so does B's, on B's own blocks
        finally:
            await verifier.shutdown(0.5)

    asyncio.run(scenario())


def test_block_manager_chains_are_salted_per_tenant():
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(13))
    bm.reserve("a", 13)
    bm.cache_full_blocks("a", tokens, 12, salt="alice")
    assert len(bm.match_prefix(tokens, salt="alice").blocks) == 3
    assert bm.match_prefix(tokens, salt="bob").blocks == ()
    assert bm.match_prefix(tokens).blocks == ()  # the anonymous tenant is a tenant too
    bm.reserve("anon", 13)
    bm.cache_full_blocks("anon", tokens, 12)
    assert bm.match_prefix(tokens).blocks != bm.match_prefix(tokens, salt="alice").blocks
    bm.check_invariants()


def test_the_proposers_draft_cache_is_salted_with_the_requests_tenant():
    """The draft-model drafter passes DraftRequest.tenant to its prefix cache (EAGLE's drafter makes the same
    calls): tenant A's released sequence leaves its blocks cached for A only, and tenant B's identical
    sequence starts with nothing cached while drafting exactly the same tokens."""
    from shared.drafting import DraftRequest
    from tests.tiny import tiny_hf_model
    from tests.unit.test_draft_model_drafter import new_drafter

    drafter = new_drafter(tiny_hf_model(seed=4, logit_scale=8.0))
    tokens = [(5 * i + 1) % 50 for i in range(30)]
    first = drafter.propose([DraftRequest("a", len(tokens), tokens, 3, tenant="alice")])[0]
    drafter.release(["a"])
    alices = drafter.blocks.match_prefix(tokens[:-1], "alice").blocks
    assert len(alices) == 7  # 29 tokens: 7 full blocks of 4
    assert drafter.blocks.match_prefix(tokens[:-1], "bob").blocks == ()
    second = drafter.propose([DraftRequest("b", len(tokens), tokens, 3, tenant="bob")])[0]
    assert not set(drafter.blocks.block_table("b")) & set(alices)  # b computed its own blocks
    assert second.token_ids == first.token_ids
    third = drafter.propose([DraftRequest("c", len(tokens), tokens, 3, tenant="alice")])[0]
    assert drafter.blocks.block_table("c")[:7] == list(alices)  # alice's next sequence starts from hers
    assert third.token_ids == first.token_ids
