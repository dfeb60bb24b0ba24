"""The gateway's traces and metrics.

`gateway.request` is the public request's span (child of the gRPC server span, parent of the gRPC
client span of each verifier call, so the verifier's spans join the same trace); after a resume it
holds one verifier call per segment. Latency metrics are the client's view: time to first streamed
token, inter-token latency, end to end.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from gateway.verifier_client import status_of
from shared.telemetry import RequestLatency, Telemetry, observable_counter, observable_gauge, set_error


@dataclass
class GatewayRequestTrace:
    span: trace.Span
    started: float
    last_chunk: float | None = None
    ended: bool = False


class GatewayTelemetry:
    def __init__(self, telemetry: Telemetry, counters: Any) -> None:
        self.tracer = telemetry.tracer("specdec.gateway")
        meter = telemetry.meter("specdec.gateway")

        observable_gauge(
            meter,
            "specdec_gateway_requests_active",
            "requests being served",
            lambda: counters.active_requests,
            "{request}",
        )
        observable_counter(
            meter,
            "specdec_gateway_resumes",
            "requests resumed on another verifier after theirs failed",
            lambda: counters.resumed_requests,
            "{request}",
        )
        self.requests = meter.create_counter(
            "specdec_gateway_requests", unit="{request}", description="requests ended, by gRPC status code"
        )
        self.prompt_tokens = meter.create_counter("specdec_gateway_prompt_tokens", unit="{token}")
        self.completion_tokens = meter.create_counter("specdec_gateway_completion_tokens", unit="{token}")
        # Refused before any work: a request without a valid key, or over its key's limits (gateway/auth.py).
        self.auth_rejections = meter.create_counter(
            "specdec_gateway_auth_rejections",
            unit="{request}",
            description="requests refused with UNAUTHENTICATED, by reason (missing, malformed, unknown, revoked)",
        )
        self.rate_limited = meter.create_counter(
            "specdec_gateway_rate_limited",
            unit="{request}",
            description="requests refused with RESOURCE_EXHAUSTED by their API key's limits, by key name and limit",
        )
        latency = RequestLatency.create(meter, "specdec_gateway_", "gateway")
        self.ttft, self.itl, self.e2e = latency.ttft, latency.itl, latency.e2e

    def request_started(
        self, request_id: str, session_id: str, api_key: str = "", client_request_id: str = ""
    ) -> GatewayRequestTrace:
        """`request_id`: the gateway's own; `client_request_id`: the client's (checked), if it sent one;
        `api_key`: the key's name (never the key) when the gateway has keys."""
        attributes = {"specdec.request_id": request_id, "specdec.session_id": session_id}
        if client_request_id:
            attributes["specdec.client_request_id"] = client_request_id
        if api_key:
            attributes["specdec.api_key_name"] = api_key
        span = self.tracer.start_span("gateway.request", attributes=attributes)
        return GatewayRequestTrace(span, time.perf_counter())

    @contextlib.contextmanager
    def current(self, req: GatewayRequestTrace) -> Iterator[None]:
        """The request span as the current one (around creating a verifier call, whose client span and
        metadata then carry it). Synchronous on purpose: no await may happen in between."""
        token = otel_context.attach(trace.set_span_in_context(req.span))
        try:
            yield
        finally:
            otel_context.detach(token)

    def chunk(self, req: GatewayRequestTrace, num_tokens: int) -> None:
        if not num_tokens:
            return
        now = time.perf_counter()
        if req.last_chunk is None:
            self.ttft.record(now - req.started)
        else:
            self.itl.record((now - req.last_chunk) / num_tokens)
        req.last_chunk = now

    def event(self, req: GatewayRequestTrace, name: str, attributes: dict[str, Any]) -> None:
        req.span.add_event(name, attributes)

    def finished(self, req: GatewayRequestTrace, usage: Any, finish_reason: str, resumes: int) -> None:
        self.e2e.record(time.perf_counter() - req.started)
        self.prompt_tokens.add(usage.prompt_tokens)
        self.completion_tokens.add(usage.completion_tokens)
        req.span.set_attributes(
            {
                "specdec.prompt_tokens": usage.prompt_tokens,
                "specdec.completion_tokens": usage.completion_tokens,
                "specdec.drafted_tokens": usage.drafted_tokens,
                "specdec.accepted_tokens": usage.accepted_tokens,
                "specdec.num_steps": usage.num_steps,
                "specdec.finish_reason": finish_reason,
                "specdec.resumes": resumes,
            }
        )
        self._end(req, grpc.StatusCode.OK)

    def failed(self, req: GatewayRequestTrace, err: Exception) -> None:
        """The request ended with `err` (a domain error or a verifier's status), unless it ended already."""
        if not req.ended:
            code, message = status_of(err)
            set_error(req.span, code, message)
            self._end(req, code)

    def cancelled(self, req: GatewayRequestTrace) -> None:
        """The call ended before the request finished (the client left), unless it ended already."""
        if not req.ended:
            set_error(req.span, grpc.StatusCode.CANCELLED, "the call ended before the request finished")
            self._end(req, grpc.StatusCode.CANCELLED)

    def _end(self, req: GatewayRequestTrace, code: grpc.StatusCode) -> None:
        req.ended = True
        self.requests.add(1, {"code": code.name})
        req.span.end()
