"""The suffix proposer (`--kind suffix`) over real grpc.aio on loopback with the real target: greedy output equals
transformers' at batch 1 and in a mixed batch of 8; a repeated question from another session is drafted from the
earlier answer (and accepted), never for another tenant; its metrics through the OpenTelemetry SDK."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from proposer_service.builder import build_drafter
from proposer_service.config import ProposerConfig
from proposer_service.server import ProposerServer
from proposer_service.suffix import GLOBAL, SuffixDrafter
from shared.config import load_config
from shared.proto_gen.specdec.v1 import proposer_pb2, verifier_pb2_grpc
from shared.telemetry import setup_telemetry
from tests.service.test_verifier_service import collect, request
from verifier_service.config import VerifierConfig
from verifier_service.server import VerifierServer

MAX_TOKENS = 64


def test_the_suffix_kind_is_built_from_its_flags_and_says_what_it_is():
    config = load_config(
        ProposerConfig,
        [
            "--kind",
            "suffix",
            "--suffix-cache-tokens",
            "5000",
            "--suffix-max-depth",
            "24",
            "--suffix-min-token-prob",
            "0.3",
        ],
    )
    drafter, info = build_drafter(config)
    assert isinstance(drafter, SuffixDrafter) and info.kind == "suffix" and info.vocab_size == 0
    assert (drafter.cache.budget_tokens, drafter.max_depth, drafter.min_token_prob) == (5000, 24, 0.3)
    assert drafter.grammar.compiler is not None  # formats are drafted with the target's tokenizer
    assert info.to_proto().kind == proposer_pb2.PROPOSER_KIND_SUFFIX
    for bad in (["--suffix-cache-tokens", "-1"], ["--suffix-max-depth", "1"], ["--suffix-min-token-prob", "2"]):
        with pytest.raises(SystemExit):  # the parser's error: the message names the flag
            load_config(ProposerConfig, ["--kind", "suffix", *bad])


def verifier_config(proposer_port: int, k: int, max_tree_nodes: int = 0) -> VerifierConfig:
    return VerifierConfig(
        host="127.0.0.1",
        port=0,
        proposer=(f"127.0.0.1:{proposer_port}",),
        max_model_len=1024,
        num_speculative_tokens=k,
        max_num_seqs=8,
        adaptive_k=False,  # every step drafts what the drafter has, up to k: the hard case for exactness
        warm_up=False,
        proposer_timeout_ms=60_000,
        max_tree_nodes=max_tree_nodes,
    )


class Services:
    def __init__(self, target, k: int, reader: InMemoryMetricReader | None = None, max_tree_nodes: int = 0) -> None:
        self.target, self.k, self.reader, self.max_tree_nodes = target, k, reader, max_tree_nodes

    async def __aenter__(self) -> Services:
        config = ProposerConfig(host="127.0.0.1", port=0, kind="suffix")
        drafter, info = build_drafter(config)
        telemetry = setup_telemetry("specdec-proposer", metric_readers=[self.reader]) if self.reader else None
        self.proposer = await ProposerServer.start(config, drafter, info, telemetry)
        self.verifier = await VerifierServer.start(
            verifier_config(self.proposer.port, self.k, self.max_tree_nodes), target=self.target, model_name="target"
        )
        assert self.verifier.proposer is not None and await self.verifier.proposer.wait_connected(30)
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.verifier.port}")
        self.stub = verifier_pb2_grpc.VerifierStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.verifier.shutdown(0.5)
        await self.proposer.shutdown(0.1)

    @property
    def drafter(self) -> SuffixDrafter:
        drafter = self.proposer.servicer.drafter
        assert isinstance(drafter, SuffixDrafter)
        return drafter

    async def generate(self, prompt: list[int], **kw):
        return await collect(self.stub, request(prompt, MAX_TOKENS, **kw))


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 900))


@pytest.mark.slow
def test_greedy_over_grpc_equals_transformers_at_batch_1_and_in_a_mixed_batch_of_8(target, prompts, greedy_references):
    async def body():
        async with Services(target, k=5) as services:
            for i in (0, 7):  # batch 1: one request at a time
                tokens, _ = await services.generate(prompts[i])
                assert tokens == greedy_references[i][:MAX_TOKENS], f"batch 1, prompt {i}"
            batch = list(range(8, 16))
            results = await asyncio.gather(*(services.generate(prompts[i]) for i in batch))
            for i, (tokens, _) in zip(batch, results, strict=True):
                assert tokens == greedy_references[i][:MAX_TOKENS], f"batch 8, prompt {i}"
            assert services.drafter.stats.proposals > 0
            assert sum(services.drafter.stats.draft_tokens.values()) > 0

    run(body())


@pytest.mark.slow
def test_token_trees_over_grpc_keep_greedy_output_equal_to_transformers(target, prompts, greedy_references):
    """The verifier takes trees of up to 12 nodes (`--max-tree-nodes`): the suffix proposer sends them where the
    text branched, on the wire, and the output is still transformers' greedy output."""
    reader = InMemoryMetricReader()

    async def body():
        async with Services(target, k=5, reader=reader, max_tree_nodes=12) as services:
            tokens, _ = await services.generate(prompts[1])
            assert tokens == greedy_references[1][:MAX_TOKENS], "batch 1, prompt 1"
            batch = [1, 2, 4, 5]  # one repeat: drafted from the earlier answer
            results = await asyncio.gather(*(services.generate(prompts[i]) for i in batch))
            for i, (tokens, _) in zip(batch, results, strict=True):
                assert tokens == greedy_references[i][:MAX_TOKENS], f"batch 4, prompt {i}"
            assert services.drafter.stats.tree_drafts >= 5, services.drafter.stats
            assert sum(r[1][-1].usage.accepted_tokens for r in results) > 0

    run(body())
    (point,) = next(
        m
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "specdec_proposer_suffix_tree_drafts"
    ).data.data_points
    assert point.value >= 5


@pytest.mark.slow
def test_a_repeated_question_is_drafted_from_the_earlier_answer_for_its_tenant_only(target, prompts, greedy_references):
    reader = InMemoryMetricReader()

    async def body():
        async with Services(target, k=8, reader=reader) as services:
            stats = services.drafter.stats
            prompt, reference = prompts[3], greedy_references[3][:MAX_TOKENS]
            tokens, first = await services.generate(prompt, session_id="a", tenant="acme")
            assert tokens == reference
            from_global = stats.draft_tokens[GLOBAL]
            tokens, again = await services.generate(prompt, session_id="b", tenant="acme")
            assert tokens == reference
            # Drafted from the first answer, nearly all accepted: far fewer steps.
            accepted = again[-1].usage.accepted_tokens
            assert stats.draft_tokens[GLOBAL] - from_global >= accepted >= 0.8 * MAX_TOKENS
            assert accepted > 3 * first[-1].usage.accepted_tokens
            tokens, other = await services.generate(prompt, session_id="c", tenant="globex")
            assert tokens == reference
            # globex's tree holds its own request only, and it drafted exactly as acme's first request did.
            cache = services.drafter.cache
            assert len(cache.trees["globex"].sequences) == 1 and len(cache.trees["acme"].sequences) == 2
            assert other[-1].usage.accepted_tokens == first[-1].usage.accepted_tokens
            assert other[-1].usage.drafted_tokens == first[-1].usage.drafted_tokens

    run(body())
    metrics = {
        m.name: m for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    }
    drafts = {p.attributes["tree"]: p.value for p in metrics["specdec_proposer_suffix_drafts"].data.data_points}
    assert drafts["global"] > 0 and drafts["local"] >= 0
    memory = {
        p.attributes["tree"]: p.value for p in metrics["specdec_proposer_suffix_tree_memory_bytes"].data.data_points
    }
    assert memory["global"] > 0
    assert metrics["specdec_proposer_suffix_cached_requests"].data.data_points[0].value == 3
    lengths = metrics["specdec_proposer_suffix_drafts_by_length"].data.data_points
    assert sum(p.value for p in lengths) == metrics["specdec_proposer_suffix_proposals"].data.data_points[0].value
