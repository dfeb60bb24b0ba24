"""Drafting ahead over real gRPC on loopback: the verifier asks for the next step's drafts as soon as a step
committed, the proposer drafts the next round while the verifier scores and answers hits from its speculation
cache, and the verifier's greedy output stays the target's; the proposer's metrics count hits, misses and wasted
tokens."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import grpc
import pytest

from proposer_service.builder import ProposerInfo
from proposer_service.config import ProposerConfig
from proposer_service.paged_drafter import PHASES
from proposer_service.server import ProposerServer
from shared.proto_gen.specdec.v1 import verifier_pb2_grpc
from shared.telemetry import setup_telemetry
from specdec_local.processes import free_port
from specdec_local.run_figures import figures, scrape, value
from tests.service.test_proposer_service import MAX_LEN, VOCAB, make_drafter
from tests.service.test_verifier_service import (
    PROMPTS,
    collect,
    greedy_equals_reference,
    kill_the_proposer_mid_generation,
    reference,
    request,
    start_verifier,
    stats,
)

MIXED = [PROMPTS[i % 3] + [i + 1] * (i % 4) for i in range(6)]


async def start_ahead_proposer(port: int = 0, telemetry=None) -> ProposerServer:
    drafter = make_drafter()  # the target's own weights: chains accepted whole, the next token guessed ahead
    drafter.cache.ahead = 4
    info = ProposerInfo("draft-model", "tiny", VOCAB, "", 8, MAX_LEN)
    config = ProposerConfig(host="127.0.0.1", port=port, draft_ahead=4)
    return await ProposerServer.start(config, drafter, info, telemetry)


@pytest.mark.parametrize("batch", [1, 6])
def test_greedy_over_grpc_with_drafting_ahead_is_exact_and_hits(monkeypatch, batch):
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)

    async def body():
        telemetry = setup_telemetry("specdec-proposer", metrics_port=free_port(), metrics_host="127.0.0.1")
        proposer = await start_ahead_proposer(telemetry=telemetry)
        drafter = proposer.servicer.drafter
        # The draft here costs what the target costs, so drafting a round ahead races the verifier's own step; a
        # slower target step (as a real target is to its draft) lets drafting ahead finish before the next ask.
        verifier = await start_verifier(
            [f"127.0.0.1:{proposer.port}"],
            step_delay_s=0.02,
            num_speculative_tokens=3,
            max_num_seqs=8,
            metrics_port=free_port(),
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                await greedy_equals_reference(stub, MIXED[:batch], 40)
                assert (await stats(stub)).accepted_tokens > 0
                early = verifier.loop.engine.early_stats
                assert 0 < early.used <= early.asked  # the verifier asked for next steps' drafts early
                # the figures `make run` prints, from the services' Prometheus endpoints
                verifier_samples = scrape(f"127.0.0.1:{verifier.telemetry.metrics_port}")
                # The last round's drafting ahead may still run in the proposer's worker thread: read its metrics
                # and its stats at one moment, while it waits.
                with proposer.servicer._drafter_lock:
                    proposer_samples = scrape(f"127.0.0.1:{telemetry.metrics_port}")
                    cache = dataclasses.replace(drafter.cache.stats)
                    rounds = proposer.servicer.drafter_calls
        finally:
            await verifier.shutdown(0.5)
            await proposer.shutdown(0.1)
        assert cache.hits > 0, cache
        assert value(proposer_samples, "specdec_proposer_draft_ahead_hits_total") == cache.hits
        assert value(proposer_samples, "specdec_proposer_draft_ahead_misses_total") == cache.misses
        assert value(proposer_samples, "specdec_proposer_draft_ahead_wasted_total") == cache.drafted - cache.used
        assert value(verifier_samples, "specdec_early_drafts_used_total") == early.used
        lines = figures(verifier_samples, proposer_samples)
        hit_rate = f"{cache.hits / (cache.hits + cache.misses):.0%} of rounds answered from the speculation cache"
        assert any(hit_rate in line for line in lines), lines
        assert any(line.startswith("propose on the verifier's critical path: ") for line in lines), lines
        # every drafter round's time, by phase (paged_drafter.PHASES), and the line that splits a message's time
        phase = "specdec_proposer_phase_duration_seconds"
        for name in PHASES:
            assert value(proposer_samples, f"{phase}_count", phase=name) == rounds > 0
        assert value(proposer_samples, f"{phase}_sum", phase="catch_up") > 0
        assert value(proposer_samples, f"{phase}_sum", phase="draft") > 0
        round_line = [line for line in lines if line.startswith("a propose message: ")]
        assert len(round_line) == 1 and "catch-up" in round_line[0] and "on the network" in round_line[0], lines
        telemetry.shutdown()

    asyncio.run(asyncio.wait_for(body(), 120))


def test_proposer_killed_while_drafting_ahead_output_stays_exact_and_the_cache_refills():
    async def body():
        proposer = await start_ahead_proposer()
        port = proposer.port
        verifier = await start_verifier([f"127.0.0.1:{port}"], step_delay_s=0.02, num_speculative_tokens=3)
        remote = verifier.proposer
        assert remote is not None
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)

                async def drafting_ahead() -> None:  # stopped once it drafts ahead: it dies with its cache
                    while proposer.servicer.drafter.cache.stats.drafted == 0:
                        await asyncio.sleep(0.005)

                await kill_the_proposer_mid_generation(stub, proposer, drafting_ahead)
                assert remote.fallback_steps > 0
                # back on the same port with an empty cache: the verifier reconnects and the cache refills
                proposer = await start_ahead_proposer(port)
                assert await remote.wait_connected(10)
                tokens, messages = await collect(stub, request(PROMPTS[2], 40))
                assert tokens == reference(tuple(PROMPTS[2]), 40)
                assert messages[-1].usage.accepted_tokens > 0
                assert proposer.servicer.drafter.cache.stats.hits > 0
        finally:
            await verifier.shutdown(0.5)
            await proposer.shutdown(0.1)

    asyncio.run(asyncio.wait_for(body(), 120))
