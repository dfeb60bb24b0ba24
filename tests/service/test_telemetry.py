"""Traces and metrics with the real OpenTelemetry SDK: gateway, verifier and proposer in-process on loopback.

The tiny random-weight target serves through the real gateway (real tokenizer); the proposer drafts with
a tiny random-weight draft model of another seed, so some drafts are accepted and some rejected. Spans
go to an in-memory exporter (one TracerProvider per service, as in three processes); metrics are read
through an in-memory reader and the Prometheus endpoint.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

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
from tests.service.test_gateway import free_port
from tests.service.test_proposer_service import draft_info, make_drafter, tiny_llama
from tests.service.test_verifier_service import vconfig
from verifier_service.server import VerifierServer

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_otel_environment(monkeypatch):
    """Only what a test passes in: no exporter from the developer's environment."""
    import os

    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)


class Stack:
    """Proposer + verifier + gateway, each with its own providers, all exporting to `spans`."""

    def __init__(self, tokenizer, prometheus: bool = False) -> None:
        self.tokenizer = tokenizer
        self.spans = InMemorySpanExporter()
        self.readers: dict[str, InMemoryMetricReader] = {}
        self.prometheus = prometheus
        self.telemetry: dict[str, Telemetry] = {}

    def _telemetry(self, service: str) -> Telemetry:
        self.readers[service] = InMemoryMetricReader()
        t = setup_telemetry(
            f"specdec-{service}",
            metrics_port=free_port() if self.prometheus else 0,
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
            telemetry=self._telemetry("verifier"),
        )
        assert self.verifier.proposer is not None and await self.verifier.proposer.wait_connected(10)
        config = GatewayConfig(verifiers=(f"127.0.0.1:{self.verifier.port}",), host="127.0.0.1", port=0, http_port=0)
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
    # Each service keys the request by its own id; the caller's is recorded beside it.
    assert gateway_span.attributes["specdec.client_request_id"] == "traced-1"
    gateway_id = gateway_span.attributes["specdec.request_id"]
    assert gateway_id not in ("", "traced-1")
    assert gateway_span.attributes["specdec.session_id"] == "s-1"
    assert gateway_span.attributes["specdec.finish_reason"] == "FINISH_REASON_LENGTH"
    assert gateway_span.attributes["specdec.prompt_tokens"] == 5
    assert gateway_span.attributes["specdec.completion_tokens"] == 12
    assert verifier_span.attributes["specdec.caller_request_id"] == gateway_id
    assert verifier_span.attributes["specdec.request_id"] not in ("", gateway_id)
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


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The Prometheus endpoint, parsed by prometheus_client's own parser: {(sample name, labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metric_identities_after_a_mixed_workload(tokenizer):
    async def scenario() -> None:
        async with Stack(tokenizer, prometheus=True) as stack:
            requests = [
                dict(prompt_token_ids=[1, 2, 3, 4], max_tokens=16),  # greedy
                dict(prompt_token_ids=[9, 8, 7], max_tokens=20, temperature=1.0, seed=1),
                dict(prompt_token_ids=[5, 5, 5, 5, 5, 5], max_tokens=9, temperature=0.7, top_p=0.9, seed=2),
                dict(prompt_token_ids=[3, 1, 4, 1, 5], max_tokens=12, max_draft_tokens=0),  # no speculation
                dict(prompt_token_ids=[2, 7, 1, 8], max_tokens=1),
            ]
            results = await asyncio.gather(*(stack.generate(**r) for r in requests))
            shared_prefix = list(range(10, 50))  # two full 16-token blocks, cached when the first one finishes
            for last in (1, 2):
                results.append(await stack.generate(prompt_token_ids=shared_prefix + [last], max_tokens=2))
            await cancelled_midway(stack)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stack.generate(prompt_token_ids=[1, 500], max_tokens=4)  # outside the target's vocabulary
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            await wait_idle(stack)
            for _ in range(100):  # the cancelled call's handler ends its span once gRPC has cancelled it
                spans = list(stack.spans.get_finished_spans())
                if len(by_name(spans, "verifier.request")) > len(results):
                    break
                await asyncio.sleep(0.05)
            check_error_spans(spans, len(results))
            check_metrics(stack, scrape(stack.telemetry["verifier"].metrics_port), results)
            check_dashboard({name for svc in stack.telemetry.values() for name, _ in scrape(svc.metrics_port)})

    asyncio.run(scenario())


def check_error_spans(spans: list[ReadableSpan], finished: int) -> None:
    """Errors set the span status with the gRPC code: the cancelled request on both hops, the refused one at
    the gateway (it never reached the verifier)."""
    from opentelemetry.trace import StatusCode

    def errors(name: str) -> list[str]:
        return sorted(
            s.status.description.split(":")[0] for s in by_name(spans, name) if s.status.status_code == StatusCode.ERROR
        )

    assert errors("gateway.request") == ["CANCELLED", "INVALID_ARGUMENT"]
    assert errors("verifier.request") == ["CANCELLED"]
    assert len(by_name(spans, "verifier.request")) == finished + 1
    refused = next(s for s in by_name(spans, "gateway.request") if "INVALID_ARGUMENT" in (s.status.description or ""))
    assert refused.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]


async def cancelled_midway(stack: Stack) -> None:
    call = stack.stub.Generate(gateway_pb2.GenerateRequest(prompt_token_ids=[4, 4, 4], max_tokens=200), timeout=60)
    async for _ in call:
        break
    call.cancel()


async def wait_idle(stack: Stack) -> None:
    loop = stack.verifier.loop
    for _ in range(200):
        if not loop.num_requests and not loop.engine.has_unfinished():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the verifier did not become idle")


def check_metrics(stack: Stack, m: dict, results: list) -> None:
    stats = stack.verifier.loop.engine.stats

    def value(name: str, **labels: str) -> float:
        return m[(name, tuple(sorted(labels.items())))]

    drafted, accepted = value("specdec_drafted_tokens_total"), value("specdec_accepted_tokens_total")
    emitted, seq_steps = value("specdec_emitted_tokens_total"), value("specdec_sequence_steps_total")
    rounds = value("specdec_draft_rounds_total")
    # The metrics are the engine's counters ...
    assert (drafted, accepted, emitted) == (stats.drafted_tokens, stats.accepted_tokens, stats.emitted_tokens)
    assert (seq_steps, rounds, value("specdec_engine_steps_total")) == (
        stats.sequence_steps,
        stats.draft_rounds,
        stats.steps,
    )
    # ... and the identities hold.
    assert 0 < accepted < drafted
    assert emitted == accepted + seq_steps
    assert value("specdec_tokens_per_draft_round") == pytest.approx(1 + accepted / rounds)
    assert value("specdec_mean_accepted_length") == value("specdec_tokens_per_draft_round")  # deprecated name
    assert value("specdec_acceptance_rate") == pytest.approx(accepted / drafted)
    k = stack.verifier.loop.engine.config.num_speculative_tokens
    by_pos_drafted = [value("specdec_drafted_tokens_by_position_total", position=str(i)) for i in range(k)]
    by_pos_accepted = [value("specdec_accepted_tokens_by_position_total", position=str(i)) for i in range(k)]
    assert sum(by_pos_drafted) == drafted and sum(by_pos_accepted) == accepted
    assert by_pos_drafted[0] == rounds  # every draft round drafts position 0
    assert all(a <= d for a, d in zip(by_pos_accepted, by_pos_drafted, strict=True))
    assert by_pos_accepted == sorted(by_pos_accepted, reverse=True)  # accepting position i needs i - 1
    for i in range(k):
        if by_pos_drafted[i]:
            assert value("specdec_acceptance_rate_by_position", position=str(i)) == pytest.approx(
                by_pos_accepted[i] / by_pos_drafted[i]
            )
    # Phases: one observation per step (network per remote round trip), latencies per request.
    for phase in ("propose", "score", "verify"):
        assert value("specdec_step_phase_duration_seconds_count", phase=phase) == stats.steps
    assert 0 < value("specdec_step_phase_duration_seconds_count", phase="network") <= stats.steps
    assert value("specdec_step_duration_seconds_count") == stats.steps
    assert value("specdec_time_to_first_token_seconds_count") == len(results) + 1  # the cancelled one too
    assert value("specdec_e2e_request_latency_seconds_count") == len(results)
    assert value("specdec_inter_token_latency_seconds_count") > 0
    # Gauges and state counters after the workload.
    assert value("specdec_requests_running") == value("specdec_requests_waiting") == 0
    assert value("specdec_kv_blocks_used") == 0
    prefix = stack.verifier.loop.engine.scheduler.prefix_cache
    assert value("specdec_prefix_cache_hit_tokens_total") == prefix.hit_tokens >= 32
    assert value("specdec_prefix_cache_query_tokens_total") == prefix.query_tokens
    assert value("specdec_prefix_cache_hit_rate") == pytest.approx(prefix.hit_tokens / prefix.query_tokens)
    assert value("specdec_prefix_cache_evictions_total") == stack.verifier.loop.engine.blocks.num_evictions
    assert value("specdec_kv_blocks_cached") == stack.verifier.loop.engine.blocks.num_cached_blocks > 0
    assert value("specdec_kv_blocks_free") == stack.verifier.loop.engine.blocks.num_blocks
    assert value("specdec_requests_finished_total") == len(results)
    assert value("specdec_requests_aborted_total") == 1
    assert value("specdec_preemptions_total") == 0
    assert value("specdec_proposer_fallback_steps_total") == 0
    assert value("specdec_proposer_connected") == 1
    # The gateway's view, through its OTLP-side reader (the same instruments).
    gateway = points(stack.readers["gateway"])
    assert gateway["specdec_gateway_completion_tokens"][()] == sum(r[-1].usage.completion_tokens for r in results)
    assert gateway["specdec_gateway_requests"] == {
        (("code", "OK"),): len(results),
        (("code", "CANCELLED"),): 1,
        (("code", "INVALID_ARGUMENT"),): 1,
    }
    assert gateway["specdec_gateway_time_to_first_token_seconds"][()] == len(results) + 1
    assert points(stack.readers["proposer"])["specdec_proposer_draft_tokens"][()] == drafted


def points(reader: InMemoryMetricReader) -> dict[str, dict[tuple, float]]:
    """{metric: {labels: value}} (histograms: their count) from an in-memory reader."""
    out: dict[str, dict[tuple, float]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for p in metric.data.data_points:
                    labels = tuple(sorted((p.attributes or {}).items()))
                    out.setdefault(metric.name, {})[labels] = getattr(p, "count", None) or getattr(p, "value", 0)
    return out


def check_dashboard(exposed: set[str]) -> None:
    """Every metric the Grafana dashboard queries is one the services expose."""
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "specdec-dashboard.json").read_text())
    queried = {
        name.removesuffix("_bucket")
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"specdec_[a-z0-9_]+", target["expr"])
    }
    assert len(queried) > 20
    exposed_bases = exposed | {n.removesuffix("_bucket") for n in exposed}
    assert queried <= exposed_bases, queried - exposed_bases
