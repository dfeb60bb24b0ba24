"""shared/telemetry.py reads only the standard OTEL_* variables; nothing configured means no-op tracing."""

from __future__ import annotations

import os

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

from shared.telemetry import setup_telemetry


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)


def test_nothing_configured_means_no_providers_and_no_op_tracers():
    t = setup_telemetry("specdec-test")
    assert t.tracer_provider is None and t.meter_provider is None
    assert not t.server_interceptors() and not t.client_interceptors()
    span = t.tracer("x").start_span("s")
    assert not span.is_recording() and span is trace.INVALID_SPAN


def test_an_otlp_endpoint_turns_on_otlp_export_with_the_standard_settings(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-verifier")
    t = setup_telemetry("specdec-verifier")
    try:
        assert isinstance(t.tracer_provider, TracerProvider)
        assert t.meter_provider is None
        assert isinstance(t.tracer_provider.sampler, ParentBasedTraceIdRatio)
        assert t.tracer_provider.resource.attributes["service.name"] == "my-verifier"  # the environment wins
        assert len(t.server_interceptors()) == 1 and len(t.client_interceptors()) == 4
    finally:
        t.shutdown()


def test_the_service_name_is_the_default_and_sdk_disabled_turns_everything_off(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    t = setup_telemetry("specdec-gateway")
    assert t.tracer_provider is not None
    assert t.tracer_provider.resource.attributes["service.name"] == "specdec-gateway"
    t.shutdown()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert setup_telemetry("specdec-gateway").tracer_provider is None


def test_unknown_exporter_is_refused(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        setup_telemetry("specdec-gateway")
