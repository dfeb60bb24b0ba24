"""Traces and metrics with the real OpenTelemetry SDK: gateway, verifier and proposer in-process on loopback.

The tiny random-weight target serves through the real gateway (real tokenizer); the proposer drafts with
a tiny random-weight draft model of another seed, so some drafts are accepted and some rejected. Spans
go to an in-memory exporter (one TracerProvider per service, as in three processes); metrics are read
through an in-memory reader and the Prometheus endpoint.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections import Counter
from collections.abc import Iterable

import grpc
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import GatewayConfig
from gateway.server import RunningGateway, start_gateway
from proposer_service.config import ProposerConfig
from proposer_service.server import ProposerServer
from shared.model.loader import build_model
from shared.proto_gen.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from shared.telemetry import Telemetry, setup_telemetry
from tests.service.test_proposer_service import draft_info, make_drafter, tiny_llama
from tests.service.test_verifier_service import vconfig
from verifier_service.server import VerifierServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def no_otel_environment(monkeypatch):
    """Only what a test passes in: no exporter from the developer's environment."""
    import os

    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)


class Stack:
    """Proposer + verifier + gateway, each with its own providers, all exporting to `spans`."""

    def __init__(self, tokenizer, metrics_port: int = 0) -> None:
        self.tokenizer = tokenizer
        self.spans = InMemorySpanExporter()
        self.readers: dict[str, InMemoryMetricReader] = {}
        self.metrics_port = metrics_port
        self.telemetry: dict[str, Telemetry] = {}

    def _telemetry(self, service: str, metrics_port: int = 0) -> Telemetry:
        self.readers[service] = InMemoryMetricReader()
        t = setup_telemetry(
            f"specdec-{service}",
            metrics_port=metrics_port,
            metrics_host="127.0.0.1",
            span_processors=[SimpleSpanProcessor(self.spans)],
            metric_readers=[self.readers[service]],
        )
        self.telemetry[service] = t
        return t

    async def __aenter__(self) -> Stack:
        self.proposer = await ProposerServer.start(
            ProposerConfig(host="127.0.0.1", port=0), make_drafter(seed=1), draft_info(), self._telemetry("proposer")
        )
        arch, state = tiny_llama()
        self.verifier = await VerifierServer.start(
            vconfig([f"127.0.0.1:{self.proposer.port}"], num_speculative_tokens=4),
            target=(build_model(arch, state), arch),
            model_name="tiny",
            telemetry=self._telemetry("verifier", self.metrics_port),
        )
        assert self.verifier.proposer is not None and await self.verifier.proposer.wait_connected(10)
        config = GatewayConfig(verifiers=(f"127.0.0.1:{self.verifier.port}",), host="127.0.0.1", port=0)
        self.gateway: RunningGateway = await start_gateway(config, self.tokenizer, self._telemetry("gateway"))
        self.channel = grpc.aio.insecure_channel(self.gateway.address)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.gateway.stop(0)
        await self.verifier.shutdown(0)
        await self.proposer.shutdown(0)

    async def generate(self, **fields) -> list[gateway_pb2.GenerateResponse]:
        return [r async for r in self.stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=60)]

    async def wait_for_spans(self, names: Iterable[str], timeout_s: float = 10.0) -> list[ReadableSpan]:
        """Request spans end just after the last message is sent: wait until every name is there."""
        wanted = set(names)
        for _ in range(int(timeout_s / 0.05)):
            spans = list(self.spans.get_finished_spans())
            if wanted <= {s.name for s in spans}:
                return spans
            await asyncio.sleep(0.05)
        raise AssertionError(f"missing spans {wanted - {s.name for s in spans}}")


def by_name(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def test_one_request_is_one_trace_across_the_three_services(tokenizer):
    async def scenario() -> None:
        async with Stack(tokenizer) as stack:
            responses = await stack.generate(
                request_id="traced-1",
                session_id="s-1",
                prompt_token_ids=[5, 6, 7, 8, 9],
                max_tokens=12,
                temperature=1.0,
                seed=3,
            )
            spans = await stack.wait_for_spans(
                ["gateway.request", "verifier.request", "engine.step", "propose", "score", "verify", "proposer.draft"]
            )
            check_trace(stack, spans, responses)

    asyncio.run(scenario())


def check_trace(stack: Stack, spans: list[ReadableSpan], responses: list[gateway_pb2.GenerateResponse]) -> None:
    stats = stack.verifier.loop.engine.stats
    usage = responses[-1].usage
    assert usage.completion_tokens == 12
    # One trace: the gRPC spans of both hops, our request spans, the steps and the proposer's work.
    assert {s.context.trace_id for s in spans} == {spans[0].context.trace_id}
    services = {s.resource.attributes["service.name"] for s in spans}
    assert services == {"specdec-gateway", "specdec-verifier", "specdec-proposer"}
    names = Counter(s.name for s in spans)
    assert names["/specdec.v1.Gateway/Generate"] == 1 and names["/specdec.v1.Verifier/Generate"] == 2  # client, server
    gateway_span, verifier_span = by_name(spans, "gateway.request")[0], by_name(spans, "verifier.request")[0]
    assert gateway_span.attributes["specdec.request_id"] == "traced-1"
    assert gateway_span.attributes["specdec.session_id"] == "s-1"
    assert gateway_span.attributes["specdec.finish_reason"] == "FINISH_REASON_LENGTH"
    assert gateway_span.attributes["specdec.prompt_tokens"] == 5
    assert gateway_span.attributes["specdec.completion_tokens"] == 12
    assert verifier_span.attributes["specdec.request_id"] == "traced-1"
    assert verifier_span.attributes["specdec.completion_tokens"] == 12
    # The verifier's request span descends from the gateway's through gRPC metadata.
    parents = {s.context.span_id: s.parent.span_id if s.parent else None for s in spans}
    node = verifier_span.context.span_id
    while node is not None and node != gateway_span.context.span_id:
        node = parents.get(node)
    assert node == gateway_span.context.span_id

    # Step spans: one per engine step, attribute sums equal to the engine's counters.
    steps = by_name(spans, "engine.step")
    assert len(steps) == stats.steps
    assert sum(s.attributes["specdec.drafted_tokens"] for s in steps) == stats.drafted_tokens
    assert sum(s.attributes["specdec.accepted_tokens"] for s in steps) == stats.accepted_tokens
    assert sum(s.attributes["specdec.emitted_tokens"] for s in steps) == stats.emitted_tokens
    assert sum(sum(s.attributes["specdec.k"]) for s in steps) == stats.drafted_tokens
    assert stats.drafted_tokens > stats.accepted_tokens > 0  # a mixed draft: the numbers mean something
    assert verifier_span.attributes["specdec.drafted_tokens"] == usage.drafted_tokens == stats.drafted_tokens
    assert verifier_span.attributes["specdec.accepted_tokens"] == usage.accepted_tokens == stats.accepted_tokens
    assert all(s.parent.span_id == verifier_span.context.span_id for s in steps)  # a lone request leads its steps
    # The request links to every step that sampled for it, with one `step` event each.
    sampled = [s for s in steps if s.attributes["specdec.sampling_sequences"]]
    assert {link.context.span_id for link in verifier_span.links} == {s.context.span_id for s in sampled}
    events = [e for e in verifier_span.events if e.name == "step"]
    assert len(events) == len(sampled) == usage.num_steps
    assert sum(e.attributes["specdec.accepted"] for e in events) == stats.accepted_tokens
    assert sum(e.attributes["specdec.emitted"] for e in events) == stats.emitted_tokens

    # Phases are children of their step; the proposer's span is the child of the verifier's propose span.
    step_ids = {s.context.span_id for s in steps}
    for name in ("propose", "score", "verify"):
        phase = by_name(spans, name)
        assert len(phase) == stats.steps and all(p.parent.span_id in step_ids for p in phase)
    propose_ids = {p.context.span_id for p in by_name(spans, "propose")}
    drafts = by_name(spans, "proposer.draft")
    assert drafts and all(d.parent.span_id in propose_ids for d in drafts)
    assert sum(d.attributes["specdec.drafted_tokens"] for d in drafts) == stats.drafted_tokens
    remote = [p for p in by_name(spans, "propose") if "specdec.proposer.round_trip_seconds" in p.attributes]
    assert len(remote) == len(drafts)
    for p in remote:
        a = p.attributes
        assert 0 < a["specdec.proposer.draft_seconds"] <= a["specdec.proposer.round_trip_seconds"]
        assert a["specdec.proposer.network_seconds"] == pytest.approx(
            a["specdec.proposer.round_trip_seconds"] - a["specdec.proposer.draft_seconds"]
        )
