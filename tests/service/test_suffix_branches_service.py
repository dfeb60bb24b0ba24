"""The request's own text beside the model's drafts over real gRPC on loopback (proposer_service/suffix_branches.py):
greedy output stays the target's with trees and with chains, batch 1 and a mixed batch, while the text joins the
drafts; the proposer's counters say how often, and `make run`'s figures print them."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import grpc
import pytest

from proposer_service.builder import ProposerInfo
from proposer_service.config import ProposerConfig
from proposer_service.server import ProposerServer
from proposer_service.suffix_branches import SuffixBranches
from shared.proto_gen.specdec.v1 import verifier_pb2_grpc
from shared.telemetry import setup_telemetry
from specdec_local.processes import free_port
from specdec_local.run_figures import figures, scrape, value
from tests.service.test_proposer_service import MAX_LEN, VOCAB, make_drafter
from tests.service.test_verifier_service import greedy_equals_reference, start_verifier

# Prompts whose text repeats, so that it says what comes next, and the target's greedy output, which loops
LOOPING = [[3, 17, 42, 8] * 3, [60, 2, 9, 33, 71] * 2 + [60, 2], [5, 6] * 5, [100, 50, 25, 12, 6, 3, 1, 0, 127] * 2]


@pytest.mark.parametrize(("batch", "tree_nodes"), [(1, 8), (4, 8), (4, 0)])
def test_greedy_over_grpc_with_the_text_beside_the_model_is_exact_and_counted(monkeypatch, batch, tree_nodes):
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)

    async def body():
        telemetry = setup_telemetry("specdec-proposer", metrics_port=free_port(), metrics_host="127.0.0.1")
        drafter = make_drafter(seed=1)  # another tiny model than the target: its guesses are often wrong
        drafter.branches = SuffixBranches()
        info = ProposerInfo("draft-model", "tiny", VOCAB, "", 8, MAX_LEN)
        proposer = await ProposerServer.start(ProposerConfig(host="127.0.0.1", port=0), drafter, info, telemetry)
        verifier = await start_verifier(
            [f"127.0.0.1:{proposer.port}"], num_speculative_tokens=4, max_num_seqs=8, max_tree_nodes=tree_nodes
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                await greedy_equals_reference(stub, LOOPING[:batch], 32)
            with proposer.servicer._drafter_lock:
                samples = scrape(f"127.0.0.1:{telemetry.metrics_port}")
                counted = dataclasses.replace(drafter.branches.stats)
        finally:
            await verifier.shutdown(0.5)
            await proposer.shutdown(0.1)
            telemetry.shutdown()
        assert (counted.tree_tokens if tree_nodes else counted.chains) > 0, counted
        for name in ("tree_tokens", "trees", "chains"):
            assert value(samples, f"specdec_proposer_suffix_branch_{name}_total") == getattr(counted, name)
        line = f"{counted.tree_tokens} nodes added to {counted.trees} token trees, {counted.chains} greedy chains"
        assert any(line in printed for printed in figures({}, samples)), figures({}, samples)
        # the text's own time, a phase of every drafter round beside the model's (0 would be a round without it)
        phase = "specdec_proposer_phase_duration_seconds"
        rounds = value(samples, f"{phase}_count", phase="draft")
        assert value(samples, f"{phase}_count", phase="text") == rounds > 0
        assert value(samples, f"{phase}_sum", phase="text") > 0
        assert any(
            "the request's own text " in printed and "a drafter round" in printed for printed in figures({}, samples)
        )

    asyncio.run(asyncio.wait_for(body(), 120))
