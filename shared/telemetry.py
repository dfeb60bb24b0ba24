"""OpenTelemetry for the three services: tracer and meter providers, gRPC interceptors, Prometheus endpoint.

Configured only by the standard OTEL_* environment variables, read by the SDK itself where it can:

- `OTEL_TRACES_EXPORTER` / `OTEL_METRICS_EXPORTER`: `otlp`, `console` or `none` (comma-separated). Unset,
  they are `otlp` when an OTLP endpoint is set (`OTEL_EXPORTER_OTLP_ENDPOINT`, or the per-signal
  `..._TRACES_ENDPOINT` / `..._METRICS_ENDPOINT`) and `none` otherwise: nothing configured means no
  export and no-op tracers, so an unconfigured service pays nothing for tracing.
- `OTEL_EXPORTER_OTLP_PROTOCOL` (or the per-signal variable): `grpc` (default) or `http/protobuf`
  (needs opentelemetry-exporter-otlp-proto-http installed). Endpoint, headers, timeout, compression:
  read by the exporters. `OTEL_BSP_*` by the batch span processor, `OTEL_METRIC_EXPORT_INTERVAL` by
  the periodic metric reader, `OTEL_TRACES_SAMPLER(_ARG)` by the tracer provider, `OTEL_SERVICE_NAME` /
  `OTEL_RESOURCE_ATTRIBUTES` by the resource (the service's own name is the default service.name),
  `OTEL_PROPAGATORS` by the propagator, `OTEL_SDK_DISABLED=true` turns everything off.

The Prometheus endpoint is not an OTEL_* setting: each service's config has `metrics_port` (0: none),
and the endpoint serves that service's own registry (so several services can share a test process).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

log = logging.getLogger("specdec.telemetry")

# gRPC methods never traced: health checks and stats polls run every few seconds per backend, and the
# Propose stream lives as long as the connection (its per-step context travels in each message instead).
UNTRACED_METHODS = ("Propose", "GetStats", "GetInfo")
UNTRACED_SERVICE_PREFIXES = ("grpc.health", "grpc.reflection")

# Seconds buckets: engine steps and phases (sub-millisecond on GPU, up to seconds on a busy CPU) and
# request latencies (up to minutes for long generations).
STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
REQUEST_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _exporter_names(signal: str) -> list[str]:
    """`OTEL_<SIGNAL>_EXPORTER`, defaulting to otlp only when an OTLP endpoint is configured."""
    raw = os.environ.get(f"OTEL_{signal}_EXPORTER")
    if raw is None:
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
            f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"
        )
        return ["otlp"] if endpoint else []
    return [name.strip().lower() for name in raw.split(",") if name.strip() and name.strip().lower() != "none"]


def _protocol(signal: str) -> str:
    return (
        os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    ).strip()


def _span_exporter(name: str) -> SpanExporter:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={name!r} is not supported here (otlp, console or none)")
    if _protocol("TRACES").startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter

        return HttpSpanExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def _metric_reader(name: str) -> MetricReader:
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    if name == "console":
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

        return PeriodicExportingMetricReader(ConsoleMetricExporter())
    if name != "otlp":
        raise ValueError(f"OTEL_METRICS_EXPORTER={name!r} is not supported here (otlp, console or none)")
    if _protocol("METRICS").startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetricExporter

        return PeriodicExportingMetricReader(HttpMetricExporter())
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

    return PeriodicExportingMetricReader(OTLPMetricExporter())


def _resource(service_name: str) -> Resource:
    """service.name from OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES when set there, else the service's."""
    named_by_env = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    return Resource.create({} if named_by_env else {SERVICE_NAME: service_name})


def _trace_filter() -> Any:
    from opentelemetry.instrumentation.grpc import filters

    untraced = [filters.method_name(m) for m in UNTRACED_METHODS]
    untraced += [filters.service_prefix(p) for p in UNTRACED_SERVICE_PREFIXES]
    return filters.negate(filters.any_of(*untraced))


@dataclass
class Telemetry:
    """One service's providers. `tracer_provider` None: tracing is off (no-op tracers, no interceptors)."""

    service_name: str
    tracer_provider: TracerProvider | None = None
    meter_provider: MeterProvider | None = None
    registry: Any = None  # prometheus_client.CollectorRegistry when the Prometheus reader is on
    metrics_port: int = 0  # the bound port of the Prometheus endpoint, 0 when there is none
    _http: Any = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def tracing(self) -> bool:
        return self.tracer_provider is not None

    def tracer(self, name: str) -> trace.Tracer:
        if self.tracer_provider is None:
            return trace.NoOpTracer()
        return self.tracer_provider.get_tracer(name)

    def meter(self, name: str) -> metrics.Meter:
        if self.meter_provider is None:
            return metrics.NoOpMeter(name)
        return self.meter_provider.get_meter(name)

    def server_interceptors(self) -> list[Any]:
        if self.tracer_provider is None:
            return []
        from opentelemetry.instrumentation.grpc import aio_server_interceptor

        return [aio_server_interceptor(tracer_provider=self.tracer_provider, filter_=_trace_filter())]

    def client_interceptors(self) -> list[Any]:
        if self.tracer_provider is None:
            return []
        from opentelemetry.instrumentation.grpc import aio_client_interceptors

        return list(aio_client_interceptors(tracer_provider=self.tracer_provider, filter_=_trace_filter()))

    def shutdown(self) -> None:
        """Flush and stop exporters and the Prometheus endpoint (idempotent)."""
        with self._lock:
            http, self._http = self._http, None
            tracer_provider, self.tracer_provider = self.tracer_provider, None
            meter_provider, self.meter_provider = self.meter_provider, None
        if http is not None:
            server, thread = http
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
        if tracer_provider is not None:
            tracer_provider.shutdown()
        if meter_provider is not None:
            meter_provider.shutdown()


def setup_telemetry(
    service_name: str,
    *,
    metrics_port: int = 0,
    metrics_host: str = "0.0.0.0",
    span_processors: Sequence[SpanProcessor] = (),
    metric_readers: Sequence[MetricReader] = (),
) -> Telemetry:
    """Providers for one service from the OTEL_* environment, plus extra processors / readers (tests and
    benchmarks pass in-memory ones). A Prometheus endpoint on `metrics_host:metrics_port` when the port
    is not 0."""
    if _truthy("OTEL_SDK_DISABLED"):
        return Telemetry(service_name)
    resource = _resource(service_name)
    processors: list[SpanProcessor] = [BatchSpanProcessor(_span_exporter(name)) for name in _exporter_names("TRACES")]
    processors += list(span_processors)
    tracer_provider = None
    if processors:
        tracer_provider = TracerProvider(resource=resource)  # sampler from OTEL_TRACES_SAMPLER
        for processor in processors:
            tracer_provider.add_span_processor(processor)
    readers = [_metric_reader(name) for name in _exporter_names("METRICS")] + list(metric_readers)
    registry = None
    if metrics_port:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry(auto_describe=False)
        readers.append(PrometheusMetricReader(registry=registry, scope_info_enabled=False))
    meter_provider = MeterProvider(resource=resource, metric_readers=readers) if readers else None
    telemetry = Telemetry(service_name, tracer_provider, meter_provider, registry)
    if registry is not None:
        from prometheus_client import start_http_server

        server, thread = start_http_server(metrics_port, metrics_host, registry=registry)
        telemetry._http = (server, thread)
        telemetry.metrics_port = server.server_address[1]
        log.info("prometheus endpoint serving service=%s port=%d", service_name, telemetry.metrics_port)
    if tracer_provider is not None or meter_provider is not None:
        log.info(
            "telemetry on service=%s traces=%s metrics=%s",
            service_name,
            ",".join(_exporter_names("TRACES")) or ("in-process" if span_processors else "none"),
            ",".join(_exporter_names("METRICS") + (["prometheus"] if registry is not None else [])) or "none",
        )
    return telemetry


def install_global(telemetry: Telemetry) -> None:
    """Make a process's providers the global ones (service processes; libraries that trace find them)."""
    if telemetry.tracer_provider is not None:
        trace.set_tracer_provider(telemetry.tracer_provider)
    if telemetry.meter_provider is not None:
        metrics.set_meter_provider(telemetry.meter_provider)


def inject_context(carrier: dict[str, str]) -> dict[str, str]:
    """The current span's W3C context into `carrier` (for messages of a long-lived stream)."""
    from opentelemetry import propagate

    propagate.inject(carrier)
    return carrier


def extract_context(carrier: Any) -> Any:
    from opentelemetry import propagate

    return propagate.extract(dict(carrier))


def set_error(span: trace.Span, code: Any, message: str) -> None:
    """Error status on a span for a grpc.StatusCode: `rpc.grpc.status_code` (its number, as the gRPC
    instrumentation sets it) and the status description "NAME: message"."""
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("rpc.grpc.status_code", code.value[0])
    span.set_status(Status(StatusCode.ERROR, f"{code.name}: {message}"))


def observe(read: Callable[[], float]) -> Callable[[CallbackOptions], Iterable[Observation]]:
    """A callback for an observable instrument that reports one current value."""

    def callback(_options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(read())]

    return callback


def observable_counter(meter: Any, name: str, description: str, read: Callable[[], float], unit: str) -> None:
    """A monotonic counter whose value is read from the service's own state at each collection."""
    meter.create_observable_counter(name, [observe(read)], unit=unit, description=description)


def observable_gauge(meter: Any, name: str, description: str, read: Callable[[], float], unit: str) -> None:
    """A gauge whose value is read from the service's own state at each collection."""
    meter.create_observable_gauge(name, [observe(read)], unit=unit, description=description)


@dataclass(frozen=True)
class RequestLatency:
    """The per-request latency histograms a streaming hop records (gateway and verifier alike)."""

    ttft: Any
    itl: Any
    e2e: Any

    @staticmethod
    def create(meter: Any, prefix: str, where: str) -> RequestLatency:
        def histogram(name: str, description: str, buckets: tuple[float, ...]) -> Any:
            return meter.create_histogram(
                f"{prefix}{name}", unit="s", description=description, explicit_bucket_boundaries_advisory=buckets
            )

        return RequestLatency(
            ttft=histogram(
                "time_to_first_token_seconds",
                f"request arrival at the {where} to its first streamed tokens",
                REQUEST_BUCKETS_S,
            ),
            itl=histogram(
                "inter_token_latency_seconds",
                "gap between streamed messages divided by the tokens they carry (one record per message)",
                STEP_BUCKETS_S,
            ),
            e2e=histogram(
                "e2e_request_latency_seconds", f"request arrival at the {where} to its last token", REQUEST_BUCKETS_S
            ),
        )
