"""The proposer's traces and metrics.

Each ProposeRequest that carries a trace context (the verifier's `propose` span of that step) gets a
`proposer.draft` span, its child, so the proposer's time shows in the step's trace. Messages without
one (the verifier does not trace that step) get no span: the verifier's sampling decides. Every answer
reports the time spent on it (`draft_time_us`), which the verifier subtracts from its round trip to get
the network time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
from opentelemetry import trace

from proposer_service.draft_ahead import SpeculationCache
from proposer_service.suffix import SuffixDrafter
from proposer_service.suffix_telemetry import register_suffix_metrics
from shared.proto_gen.specdec.v1 import proposer_pb2
from shared.telemetry import (
    STEP_BUCKETS_S,
    Telemetry,
    extract_context,
    observable_counter,
    observable_gauge,
    set_error,
)


class ProposerTelemetry:
    def __init__(self, telemetry: Telemetry, servicer: Any) -> None:
        self.tracing = telemetry.tracing
        self.tracer = telemetry.tracer("specdec.proposer")
        meter = telemetry.meter("specdec.proposer")

        observable_counter(
            meter,
            "specdec_proposer_messages",
            "propose messages answered (one per verifier step that drafts)",
            lambda: servicer.messages,
            "{message}",
        )
        observable_gauge(
            meter,
            "specdec_proposer_open_streams",
            "open Propose streams (one per connected verifier)",
            lambda: servicer.open_streams,
            "{stream}",
        )
        cache = getattr(servicer.drafter, "cache", None)
        if isinstance(cache, SpeculationCache):  # drafting ahead (the suffix drafter's cache is another thing)
            for name, description in (
                ("hits", "rounds answered from drafting ahead's speculation cache"),
                ("misses", "rounds drafted on demand while drafting ahead is on (the outcome was not guessed)"),
                ("drafted", "draft tokens drafted ahead"),
                ("wasted", "draft tokens drafted ahead and never sent"),
            ):
                unit = "{round}" if name in ("hits", "misses") else "{token}"
                observable_counter(meter, f"specdec_proposer_draft_ahead_{name}", description, _stat(cache, name), unit)
        branches = getattr(servicer.drafter, "branches", None)
        if branches is not None:  # --suffix-branches: the request's own text beside the model's drafts
            for name, description, unit in (
                ("tree_tokens", "nodes the request's own text added to the model's token trees", "{token}"),
                ("trees", "token trees the request's own text added nodes to", "{draft}"),
                ("chains", "greedy chains sent as the request's own text in place of the model's", "{draft}"),
            ):
                observable_counter(
                    meter, f"specdec_proposer_suffix_branch_{name}", description, _stat(branches, name), unit
                )
        self.proposed_tokens = meter.create_counter(
            "specdec_proposer_draft_tokens", unit="{token}", description="draft tokens proposed"
        )
        if isinstance(servicer.drafter, SuffixDrafter):
            register_suffix_metrics(meter, servicer.drafter)
        self.draft_seconds = meter.create_histogram(
            "specdec_proposer_draft_duration_seconds",
            unit="s",
            description="time to answer one propose message (state updates and drafting)",
            explicit_bucket_boundaries_advisory=STEP_BUCKETS_S,
        )
        self.phase_seconds = meter.create_histogram(
            "specdec_proposer_phase_duration_seconds",
            unit="s",
            description="a model drafter's round by phase: ingest (tokens of rounds answered from the speculation "
            "cache), catch_up (its state brought up to the committed tokens), draft (the chains and trees)",
            explicit_bucket_boundaries_advisory=STEP_BUCKETS_S,
        )
        self._phase_attrs: dict[str, dict[str, str]] = {}

    def record_phases(self, seconds: dict[str, float]) -> None:
        """One drafter round's time by phase (paged_drafter.PHASES); from the drafting thread."""
        for phase, value in seconds.items():
            self.phase_seconds.record(value, self._phase_attrs.setdefault(phase, {"phase": phase}))

    def message_started(self, request: proposer_pb2.ProposeRequest) -> tuple[float, trace.Span | None]:
        span = None
        if self.tracing and request.trace_context:
            span = self.tracer.start_span(
                "proposer.draft",
                context=extract_context(request.trace_context),
                kind=trace.SpanKind.SERVER,
                attributes={
                    "specdec.step_id": request.step_id,
                    "specdec.batch_size": len(request.sequences),
                    "specdec.k": [seq.k for seq in request.sequences],
                    "specdec.released_sequences": len(request.release_seq_ids),
                },
            )
        return time.perf_counter(), span

    def message_finished(
        self, started: tuple[float, trace.Span | None], response: proposer_pb2.ProposeResponse | None
    ) -> None:
        """`response` None: the message was refused (the stream is aborted with INVALID_ARGUMENT)."""
        begin, span = started
        seconds = time.perf_counter() - begin
        if response is None:
            if span is not None:
                set_error(span, grpc.StatusCode.INVALID_ARGUMENT, "propose message refused")
                span.end()
            return
        response.draft_time_us = int(seconds * 1e6)
        drafted = sum(len(d.draft_token_ids) for d in response.drafts)
        self.draft_seconds.record(seconds)
        if drafted:
            self.proposed_tokens.add(drafted)
        if span is not None:
            span.set_attributes(
                {
                    "specdec.drafted_tokens": drafted,
                    "specdec.drafted": [len(d.draft_token_ids) for d in response.drafts],
                    "specdec.resyncs": sum(d.needs_resync for d in response.drafts),
                }
            )
            span.end()


def _stat(cache: Any, name: str) -> Callable[[], float]:
    return lambda: getattr(cache.stats, name)
