"""End to end with the repository's EAGLE head: client -> gateway -> verifier <-> eagle proposer, each a
separate process: adaptive k (the default) one request at a time, and k fixed for a batch of 8 in a KV cache
small enough that it is preempted.

Greedy outputs are compared with transformers' greedy `generate` of the target."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shared.model.loader import load_hf_model
from shared.settings import default_target_model
from specdec_local.processes import Stack
from tests.e2e.test_e2e import GREEDY_INDICES, check_greedy, engine_stats, gateway, generate, verifier
from tests.real_models import MAX_NEW_TOKENS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


# The adaptive stack's only test: after a batch of 8 whose preempted requests accept about 0.3, the policy may
# rightly decode a new request plainly for 48 tokens, where this test checks that it drafted (a whole-suite run
# failed so, 2026-12-06 and in the nineteenth session), so the batch of 8 runs on a stack of its own.
def test_batch_1_and_session_turns_match_transformers(eagle_stack: Stack, prompts, greedy_references, tokenizer):
    """One request at a time; then a second turn of the same session, served from the verifier's prefix
    cache (no features for those positions: the head fills them), equal to transformers' greedy output."""
    eos = tokenizer.eos_token_id
    first = prompts[GREEDY_INDICES[0]]

    async def run():
        channel, stub = gateway(eagle_stack.gateway.address)
        async with channel:
            turn1 = await generate(stub, prompt_token_ids=first, max_tokens=48, session_id="s-eagle")
            follow = tokenizer("\nThank you. Now say it more briefly.", add_special_tokens=False)["input_ids"]
            second = first + turn1.ids + follow
            turn2 = await generate(stub, prompt_token_ids=second, max_tokens=48, session_id="s-eagle")
            return turn1, second, turn2

    turn1, second, turn2 = asyncio.run(run())
    assert not check_greedy("turn 1", turn1, greedy_references[GREEDY_INDICES[0]], 48, eos, tokenizer)
    hf = load_hf_model(default_target_model())
    ref = hf.generate(torch.tensor([second]), max_new_tokens=48, do_sample=False)[0, len(second) :].tolist()
    assert not check_greedy("turn 2", turn2, ref, 48, eos, tokenizer)
    assert turn2.final is not None and turn2.final.usage.cached_prompt_tokens >= len(first) // 16 * 16


def test_batch_of_8_through_preemption_matches_transformers(
    eagle_fixed_stack: Stack, prompts, greedy_references, tokenizer
):
    """8 requests at once in a KV cache with room for about one: preempted and recomputed while the verifier,
    with k fixed, drafts every step from the head in its own process. Every request past one token must draft."""
    indices = GREEDY_INDICES[:8]

    async def run():
        channel, stub = gateway(eagle_fixed_stack.gateway.address)
        async with channel:
            results = await asyncio.gather(
                *(generate(stub, prompt_token_ids=prompts[i], max_tokens=MAX_NEW_TOKENS) for i in indices)
            )
        vchannel, vstub = verifier(eagle_fixed_stack.verifier.address)
        async with vchannel:
            return results, (await engine_stats(vstub)).stats

    results, stats = asyncio.run(run())
    problems = []
    for i, r in zip(indices, results, strict=True):
        eos = tokenizer.eos_token_id
        problems += check_greedy(f"prompt {i}", r, greedy_references[i], MAX_NEW_TOKENS, eos, tokenizer)
    assert not problems, "\n".join(problems)
    assert stats.preemptions > 0, "the KV cache was meant to force preemption"
    assert sum(r.final.usage.accepted_tokens for r in results if r.final) > 0, "the head's drafts were never accepted"
