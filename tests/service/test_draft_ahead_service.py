"""Drafting ahead over real gRPC on loopback: the proposer drafts the next round while the verifier scores,
answers hits from its speculation cache, and the verifier's greedy output stays the target's; the proposer's
metrics count hits, misses and wasted tokens."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from proposer_service.builder import ProposerInfo
from proposer_service.config import ProposerConfig
from proposer_service.server import ProposerServer
from shared.proto_gen.specdec.v1 import verifier_pb2_grpc
from shared.telemetry import setup_telemetry
from tests.service.test_proposer_service import MAX_LEN, VOCAB, make_drafter
from tests.service.test_verifier_service import PROMPTS, collect, reference, request, start_verifier, stats

MIXED = [PROMPTS[i % 3] + [i + 1] * (i % 4) for i in range(6)]


def metric_values(reader: InMemoryMetricReader) -> dict[str, float]:
    values = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name.startswith("specdec_proposer_draft_ahead_"):
                    values[metric.name] = sum(point.value for point in metric.data.data_points)
    return values


@pytest.mark.parametrize("batch", [1, 6])
def test_greedy_over_grpc_with_drafting_ahead_is_exact_and_hits(monkeypatch, batch):
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)

    async def body():
        drafter = make_drafter()  # the target's own weights: chains accepted whole, the next token guessed ahead
        drafter.cache.ahead = 4
        reader = InMemoryMetricReader()
        telemetry = setup_telemetry("specdec-proposer", metric_readers=[reader])
        info = ProposerInfo("draft-model", "tiny", VOCAB, "", 8, MAX_LEN)
        proposer = await ProposerServer.start(ProposerConfig(host="127.0.0.1", draft_ahead=4), drafter, info, telemetry)
        verifier = await start_verifier([f"127.0.0.1:{proposer.port}"], num_speculative_tokens=3, max_num_seqs=8)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                prompts = MIXED[:batch]
                results = await asyncio.gather(*(collect(stub, request(p, 40)) for p in prompts))
                for prompt, (tokens, _) in zip(prompts, results, strict=True):
                    assert tokens == reference(tuple(prompt), 40)
                assert (await stats(stub)).accepted_tokens > 0
        finally:
            await verifier.shutdown(0.5)
            await proposer.shutdown(0.1)
        cache = drafter.cache.stats
        assert cache.hits > 0, cache
        values = metric_values(reader)
        assert values["specdec_proposer_draft_ahead_hits"] == cache.hits
        assert values["specdec_proposer_draft_ahead_misses"] == cache.misses
        assert values["specdec_proposer_draft_ahead_wasted"] == cache.drafted - cache.used
        telemetry.shutdown()

    asyncio.run(asyncio.wait_for(body(), 120))
