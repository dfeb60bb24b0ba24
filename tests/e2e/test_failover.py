"""Exact failover with real processes: the `failover` stack (conftest.py) has a proposer, TWO verifiers and a
gateway over both.

- A verifier is SIGKILLed while greedy and seeded-sampled streams run on it: every stream resumes on the other
  verifier and equals its undisturbed run token for token (greedy: transformers' reference; seeded: the same
  request run on this stack before the kill), and its usage counts both segments.
- The proposer is SIGKILLed while seeded streams run: the verifier decodes on with k = 0 and the output is the
  same; restarted on its port, the proposer is reconnected to and drafts again. (Greedy streams through a dead
  proposer: test_e2e.py::test_proposer_killed_mid_generation.)

Each test restarts what it killed, so the soak (test_soak.py) finds the stack whole.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shared.proto_gen.specdec.v1 import gateway_pb2
from specdec_local.processes import Service, Stack
from tests.e2e.test_e2e import (
    RPC_TIMEOUT_S,
    Result,
    Stream,
    check_greedy,
    engine_stats,
    gateway,
    generate,
    until,
    usage_problems,
    verifier,
    wait_engine_idle,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# One session id for every stream of a test: rendezvous hashing puts them all on one verifier, the one killed.
SESSION = "failover-e2e"
MAX_TOKENS = 32
GREEDY_CANDIDATES = (15, 16, 17, 18, 19, 10, 11, 12)  # plain prompts: long greedy answers
SEEDED = [  # (prompt, sampling fields): chat prompts whose answers are long
    (0, dict(temperature=0.8, top_p=0.9, seed=1301)),
    (1, dict(temperature=0.8, top_k=40, seed=1302)),
    (6, dict(temperature=0.8, top_p=0.95, min_p=0.02, seed=1303)),
]


def _seeded_request(prompts, i: int, fields: dict[str, Any]) -> dict[str, Any]:
    return dict(prompt_token_ids=prompts[i], max_tokens=MAX_TOKENS, session_id=SESSION, **fields)


def _same_as(label: str, r: Result, ref: Result) -> list[str]:
    """Problems with a seeded result against its undisturbed run (empty list: identical)."""
    if r.error is not None or r.final is None:
        return [f"{label}: {r.describe()}"]
    problems = [f"{label}: {p}" for p in r.protocol_errors + usage_problems(r, drafting=False)]
    if r.ids != ref.ids:
        i = next(
            (n for n, (a, b) in enumerate(zip(r.ids, ref.ids, strict=False)) if a != b), min(len(r.ids), len(ref.ids))
        )
        problems.append(
            f"{label}: {len(r.ids)} tokens, undisturbed run {len(ref.ids)}; first difference at {i}: "
            f"{r.ids[i : i + 5]} vs {ref.ids[i : i + 5]}"
        )
    elif r.text != ref.text:
        problems.append(f"{label}: text {r.text!r} != undisturbed {ref.text!r}")
    assert ref.final is not None
    if (r.final.finish_reason, r.final.stop_token_id) != (ref.final.finish_reason, ref.final.stop_token_id):
        problems.append(f"{label}: ended {r.describe()}, undisturbed {ref.describe()}")
    return problems


@pytest.fixture(scope="module")
def seeded_references(failover_stack: Stack, prompts) -> list[Result]:
    """The seeded requests run once, undisturbed, on this stack."""

    async def run() -> list[Result]:
        channel, stub = gateway(failover_stack.gateway.address)
        async with channel:
            return await asyncio.gather(*(generate(stub, **_seeded_request(prompts, i, kw)) for i, kw in SEEDED))

    refs = asyncio.run(run())
    bad = [r.describe() for r in refs if r.error is not None or r.final is None]
    assert not bad, f"undisturbed seeded runs failed: {bad}"
    return refs


def _serving(stack: Stack, stats: gateway_pb2.GetStatsResponse) -> Service:
    """The verifier the gateway has the test's streams on (one session id: all on one verifier)."""
    busy = [b.address for b in stats.backends if b.active_requests > 0]
    assert len(busy) == 1, f"the streams are not all on one verifier: {stats}"
    return next(v for v in stack.verifiers if v.address == busy[0])


def test_verifier_killed_mid_stream_greedy_and_seeded_resume_exactly(
    failover_stack: Stack, prompts, greedy_references, tokenizer, seeded_references
):
    eos = tokenizer.eos_token_id
    greedy = [i for i in GREEDY_CANDIDATES if eos not in greedy_references[i][:MAX_TOKENS]][:3]
    assert len(greedy) == 3

    async def run():
        gch, stub = gateway(failover_stack.gateway.address)
        async with gch:
            before = await stub.GetStats(gateway_pb2.GetStatsRequest(), timeout=30)
            streams = [
                Stream(stub, prompt_token_ids=prompts[i], max_tokens=MAX_TOKENS, session_id=SESSION) for i in greedy
            ]
            streams += [Stream(stub, **_seeded_request(prompts, i, kw)) for i, kw in SEEDED]
            # Two token messages each: every stream has had a drafting step on the verifier about to die.
            await until(
                lambda: all(s.result.token_messages >= 2 or s.task.done() for s in streams),
                RPC_TIMEOUT_S,
                what="two token messages on every stream",
            )
            at_kill = await stub.GetStats(gateway_pb2.GetStatsRequest(), timeout=30)
            victim = _serving(failover_stack, at_kill)
            survivor = next(v for v in failover_stack.verifiers if v is not victim)
            vch, vstub = verifier(survivor.address)
            async with vch:
                survivor_before = (await engine_stats(vstub)).stats
                progress = [len(s.result.ids) for s in streams]
                running = [not s.task.done() for s in streams]
                victim.kill()
                results = await asyncio.gather(*(s.task for s in streams))
                _, survivor_after = await wait_engine_idle(vstub, 60)
            after = await stub.GetStats(gateway_pb2.GetStatsRequest(), timeout=30)
            return before, victim, survivor_before, progress, running, results, survivor_after, after

    before, victim, survivor_before, progress, running, results, survivor_after, after = asyncio.run(run())
    try:
        problems = []
        for i, r in zip(greedy, results[: len(greedy)], strict=True):
            problems += check_greedy(f"greedy prompt {i}", r, greedy_references[i], MAX_TOKENS, eos, tokenizer)
        for (i, kw), r, ref in zip(SEEDED, results[len(greedy) :], seeded_references, strict=True):
            problems += _same_as(f"seeded prompt {i} {kw}", r, ref)
        for i, r in zip(greedy + [i for i, _ in SEEDED], results, strict=True):
            if r.final is not None and r.final.usage.prompt_tokens != len(prompts[i]):
                problems.append(f"prompt {i}: usage.prompt_tokens {r.final.usage.prompt_tokens} != {len(prompts[i])}")
        assert not problems, "\n".join(problems)

        resumed_after = [len(r.ids) > p for r, p in zip(results, progress, strict=True)]
        assert sum(resumed_after) >= 4, (
            f"too few streams had tokens left at the kill: {progress} of {[len(r.ids) for r in results]}"
        )
        resumes = after.resumed_requests - before.resumed_requests
        # A stream that got tokens after the kill was resumed; one may have had all its tokens but not its end.
        assert sum(resumed_after) <= resumes <= sum(running), (resumes, resumed_after, running)
        # Usage counts both segments: the resumed segments' drafts are all the survivor drafted; the streams'
        # usage has more (the dead verifier's segments, from the running counts of its messages).
        survivor_drafted = survivor_after.drafted_tokens - survivor_before.drafted_tokens
        survivor_accepted = survivor_after.accepted_tokens - survivor_before.accepted_tokens
        drafted = sum(r.final.usage.drafted_tokens for r in results)
        accepted = sum(r.final.usage.accepted_tokens for r in results)
        assert survivor_drafted > 0, "nothing was drafted after the resume"
        assert drafted > survivor_drafted, f"usage drafted {drafted}: the dead segment's {drafted - survivor_drafted}"
        assert accepted >= survivor_accepted, (accepted, survivor_accepted)
        print(
            f"killed {victim.name} at {progress} tokens; {resumes} resumes; drafted {drafted} "
            f"({drafted - survivor_drafted} before the kill), accepted {accepted}"
        )
    finally:
        victim.restart()
        failover_stack.wait_healthy()
    assert victim.alive()


def test_proposer_killed_mid_stream_seeded_output_unchanged_then_reconnects(
    failover_stack: Stack, prompts, seeded_references
):
    async def run():
        gch, stub = gateway(failover_stack.gateway.address)
        async with gch:
            streams = [Stream(stub, **_seeded_request(prompts, i, kw)) for i, kw in SEEDED]
            await until(
                lambda: all(s.result.token_messages >= 2 or s.task.done() for s in streams),
                RPC_TIMEOUT_S,
                what="two token messages on every stream",
            )
            serving = _serving(failover_stack, await stub.GetStats(gateway_pb2.GetStatsRequest(), timeout=30))
            vch, vstub = verifier(serving.address)
            async with vch:
                drafted_before_kill = (await engine_stats(vstub)).stats.drafted_tokens
                progress = [len(s.result.ids) for s in streams]
                failover_stack.proposer.kill()
                noticed: list[Any] = []

                async def disconnected() -> bool:
                    s = (await engine_stats(vstub)).stats
                    noticed[:] = [s]
                    return not s.proposer_connected

                await until(disconnected, 60, what="the verifier to notice the dead proposer")
                results = await asyncio.gather(*(s.task for s in streams))
                after = (await engine_stats(vstub)).stats
                # Restarted on the same port: the verifier reconnects (its backoff is at most 10 s) and drafts.
                failover_stack.proposer.restart()
                await until(
                    lambda: _connected(vstub), 120, interval=0.5, what="the verifier to reconnect to the proposer"
                )
                i, kw = SEEDED[0]
                again = [await generate(stub, **_seeded_request(prompts, i, kw))]
                reconnected = (await engine_stats(vstub)).stats
            return drafted_before_kill, progress, noticed[0], results, after, again, reconnected

    drafted_before_kill, progress, at_notice, results, after, again, reconnected = asyncio.run(run())
    problems = []
    for (i, kw), r, ref in zip(SEEDED, results, seeded_references, strict=True):
        problems += _same_as(f"seeded prompt {i} {kw} (proposer killed)", r, ref)
    for (i, kw), r, ref in zip(SEEDED[:1], again, seeded_references[:1], strict=True):
        problems += _same_as(f"seeded prompt {i} {kw} (proposer restarted)", r, ref)
    assert not problems, "\n".join(problems)
    assert sum(len(r.ids) > p for r, p in zip(results, progress, strict=True)) >= 2, "the streams ended before the kill"
    assert drafted_before_kill > 0
    # This stack drafts ahead: an early answer that arrived before the kill can still be applied in the step after
    # the verifier noticed, at most one round per stream (nothing is sent once it knows).
    assert after.draft_rounds - at_notice.draft_rounds <= len(SEEDED), "drafting went on although the proposer is dead"
    assert after.emitted_tokens > at_notice.emitted_tokens, "no tokens after the proposer died"
    assert reconnected.proposer_connected
    assert reconnected.drafted_tokens > after.drafted_tokens, "nothing drafted after the proposer came back"
    assert all(r.final is not None and r.final.usage.drafted_tokens > 0 for r in again)
    failover_stack.wait_healthy()  # both verifiers connected again, for the soak


async def _connected(vstub) -> bool:
    return (await engine_stats(vstub)).stats.proposer_connected
