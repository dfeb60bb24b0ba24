"""Traces from three processes reach an OTLP receiver with one trace id.

The test runs a small OTLP/gRPC receiver (the TraceService and MetricsService of opentelemetry-proto)
and starts proposer (n-gram), verifier (a tiny random-weight Llama saved as an HF folder, so it loads in
a second) and gateway as separate processes configured only by OTEL_* variables. One request through the
gateway must produce spans from all three processes with the request's trace id; the verifier's OTLP
metrics must arrive too.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from shared.proto_gen.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from shared.settings import default_target_model
from specdec_local.processes import HOST, Service, Stack, free_port

pytestmark = pytest.mark.timeout(300)


class Receiver(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    """Keeps every span as (service.name, span) and the names of the metrics received per service."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[str, object]] = []
        self.metrics: dict[str, set[str]] = {}

    def Export(self, request, context):  # both services have a method of this name
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            with self.lock:
                for rs in request.resource_spans:
                    service = _service_name(rs.resource)
                    self.spans += [(service, span) for ss in rs.scope_spans for span in ss.spans]
            return trace_service_pb2.ExportTraceServiceResponse()
        with self.lock:
            for rm in request.resource_metrics:
                names = self.metrics.setdefault(_service_name(rm.resource), set())
                names.update(m.name for sm in rm.scope_metrics for m in sm.metrics)
        return metrics_service_pb2.ExportMetricsServiceResponse()


def _service_name(resource) -> str:
    return next((a.value.string_value for a in resource.attributes if a.key == "service.name"), "")


@pytest.fixture
def receiver():
    servicer = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{HOST}:0")
    server.start()
    yield servicer, port
    server.stop(0)


def save_tiny_target(path) -> None:
    from tests.tiny import tiny_hf_model

    tiny_hf_model(seed=0, vocab_size=96, logit_scale=4.0).save_pretrained(path)


def test_spans_from_three_processes_share_the_request_trace_id(receiver, tmp_path, monkeypatch):
    servicer, otlp_port = receiver
    for name, value in {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{HOST}:{otlp_port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
    }.items():
        monkeypatch.setenv(name, value)
    save_tiny_target(tmp_path / "tiny")
    stack = build(tmp_path)
    stack.start()
    try:
        stack.wait_ready()
        with grpc.insecure_channel(stack.gateway.address) as channel:
            request = gateway_pb2.GenerateRequest(
                request_id="otlp-1", prompt_token_ids=[5, 6, 7, 5, 6, 7, 5, 6], max_tokens=8, ignore_eos=True
            )
            responses = list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=60))
        assert responses[-1].usage.completion_tokens == 8
        trace_id = wait_for_request_trace(servicer, "otlp-1")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with servicer.lock:
                in_trace = [(svc, s) for svc, s in servicer.spans if s.trace_id == trace_id]
                metric_names = set(servicer.metrics.get("specdec-verifier", ()))
            services = {svc for svc, _ in in_trace}
            if len(services) == 3 and "specdec_step_phase_duration_seconds" in metric_names:  # histograms come later
                break
            time.sleep(0.2)
        names = {(svc, s.name) for svc, s in in_trace}
        assert services == {"specdec-gateway", "specdec-verifier", "specdec-proposer"}, (names, stack.logs())
        for expected in [
            ("specdec-gateway", "gateway.request"),
            ("specdec-gateway", "/specdec.v1.Verifier/Generate"),
            ("specdec-verifier", "verifier.request"),
            ("specdec-verifier", "engine.step"),
            ("specdec-verifier", "propose"),
            ("specdec-proposer", "proposer.draft"),
        ]:
            assert expected in names, names
        assert "specdec_drafted_tokens" in metric_names and "specdec_step_phase_duration_seconds" in metric_names
    finally:
        problems = stack.stop()
    assert not problems, problems


def wait_for_request_trace(servicer: Receiver, request_id: str, timeout_s: float = 30.0) -> bytes:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with servicer.lock:
            for _, span in servicer.spans:
                attrs = {a.key: a.value.string_value for a in span.attributes}
                if span.name == "gateway.request" and attrs.get("specdec.client_request_id") == request_id:
                    return span.trace_id
        time.sleep(0.2)
    raise AssertionError(f"no gateway.request span for {request_id} reached the receiver")


def build(tmp_path) -> Stack:
    proposer_port, verifier_port, gateway_port = free_port(), free_port(), free_port()
    stack = Stack("otlp")

    def service(name: str, script: str, port: int, args: list[str]) -> Service:
        return Service(
            f"otlp-{name}", script, [*args, "--host", HOST, "--port", str(port)], tmp_path / f"{name}.log", port
        )

    stack.services = [
        service("proposer", "specdec-proposer", proposer_port, ["--kind", "ngram"]),
        service(
            "verifier",
            "specdec-verifier",
            verifier_port,
            [
                "--model",
                str(tmp_path / "tiny"),
                "--proposer",
                f"{HOST}:{proposer_port}",
                "--no-adaptive-k",
                "--max-model-len",
                "256",
                "--device",
                "cpu",
            ],
        ),
        service(
            "gateway",
            "specdec-gateway",
            gateway_port,
            # --expose-backends: the harness waits for a healthy verifier in the gateway's GetStats.
            [
                "--verifiers",
                f"{HOST}:{verifier_port}",
                "--tokenizer",
                default_target_model(),
                "--expose-backends",
                "--http-port",
                "0",
            ],
        ),
    ]
    return stack
