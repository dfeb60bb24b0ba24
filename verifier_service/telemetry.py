"""The verifier's traces and metrics: engine step spans, request spans, and the metric instruments.

Spans (see docs/observability.md):
- `verifier.request`, one per Generate call, child of the gRPC server span (so of the gateway's call).
- `engine.step`, one per engine step, with children `propose`, `score`, `verify`. A step serves many
  requests, so every request span it served gets a link to it (and a `step` event with that request's
  own k / accepted / emitted). The step span's parent is the request span of the oldest sequence in the
  batch, so the trace of a lone request holds its whole story; under batching each request's trace
  holds the steps it led and links to the others.
- The `propose` span's context travels in the ProposeRequest, so the proposer's `proposer.draft` span is
  its child; a request for the next step's drafts sent as soon as a step committed (the engine's early ask)
  travels under an `ask_early` span, a child of that step.

Counters are read from the engine's own counters (EngineStats, scheduler, RemoteProposer) when metrics
are collected, so metric values are those counters, and a step costs nothing for them. Only histograms
and per-position acceptance are recorded per step. With tracing off no span work is done at all.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.metrics import Observation

from shared.telemetry import (
    STEP_BUCKETS_S,
    RequestLatency,
    Telemetry,
    observable_counter,
    observable_gauge,
    set_error,
)
from verifier_service.engine import Engine, MaskTiming, RequestOutput
from verifier_service.remote_proposer import RemoteProposer
from verifier_service.scheduler import ScheduledSeq

PHASES = ("propose", "score", "verify")


def _ns(perf_s: float, offset_ns: int) -> int:
    return int(perf_s * 1e9) + offset_ns


@dataclass
class RequestTrace:
    """One Generate call: its span, latency clocks and what the steps that served it cost."""

    request_id: str
    span: trace.Span
    started: float  # time.perf_counter at arrival
    last_update: float | None = None
    ended: bool = False
    num_steps: int = 0
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys((*PHASES, "network"), 0.0))


@dataclass
class _StepInProgress:
    span: trace.Span
    propose_span: trace.Span
    token: object
    scheduled_k: dict[str, int]
    batch_size: int


class VerifierTelemetry:
    """Engine step observer (engine.observer) plus request tracking for the servicer."""

    def __init__(self, telemetry: Telemetry, engine: Engine, proposer: RemoteProposer | None, loop: Any) -> None:
        self.engine = engine
        self.proposer = proposer
        self.loop = loop  # EngineLoop: finished / aborted request counters
        self.tracing = telemetry.tracing
        self.tracer = telemetry.tracer("specdec.verifier")
        self._offset_ns = time.time_ns() - int(time.perf_counter() * 1e9)  # perf_counter -> epoch ns
        self._lock = threading.Lock()  # request registry: the event loop adds / ends, the step thread reads
        self._requests: dict[str, RequestTrace] = {}
        self._step: _StepInProgress | None = None
        k_max = engine.config.num_speculative_tokens
        self.drafted_by_position = [0] * k_max
        self.accepted_by_position = [0] * k_max
        self._instruments(telemetry.meter("specdec.verifier"))
        if self.tracing or telemetry.meter_provider is not None:
            engine.observer = self

    # ---- metrics ---------------------------------------------------------------------------------

    def _instruments(self, meter: Any) -> None:
        engine, stats = self.engine, self.engine.stats

        def counter(name: str, description: str, read: Callable[[], float], unit: str = "{token}") -> None:
            observable_counter(meter, name, description, read, unit)

        def gauge(name: str, description: str, read: Callable[[], float], unit: str = "1") -> None:
            observable_gauge(meter, name, description, read, unit)

        counter("specdec_drafted_tokens", "draft tokens scored by the target", lambda: stats.drafted_tokens)
        counter("specdec_accepted_tokens", "draft tokens accepted", lambda: stats.accepted_tokens)
        counter(
            "specdec_emitted_tokens",
            "tokens sampled by verification: accepted plus one recovered or bonus per sequence step",
            lambda: stats.emitted_tokens,
        )
        counter("specdec_engine_steps", "engine steps", lambda: stats.steps, "{step}")
        counter("specdec_sequence_steps", "(sequence, step) pairs that sampled tokens", lambda: stats.sequence_steps)
        counter(
            "specdec_draft_rounds", "sequence steps that scored at least one draft token", lambda: stats.draft_rounds
        )
        counter("specdec_stale_drafts", "drafts discarded because built on another prefix", lambda: stats.stale_drafts)
        counter(
            "specdec_preemptions",
            "sequences preempted (KV freed, recomputed later)",
            lambda: engine.scheduler.num_preemptions,
        )
        counter(
            "specdec_proposer_fallback_steps",
            "steps decoded with k = 0 because the proposer was unavailable",
            lambda: self.proposer.fallback_steps if self.proposer is not None else 0,
            "{step}",
        )
        counter(
            "specdec_early_drafts_asked",
            "sequences whose next draft was asked for as soon as their step committed (a remote proposer)",
            lambda: engine.early_stats.asked,
        )
        counter(
            "specdec_early_drafts_used",
            "of those, drafts the next step took (the others were asked again in its propose phase)",
            lambda: engine.early_stats.used,
        )
        counter(
            "specdec_received_draft_tokens",
            "draft tokens received from the proposer, verified or not (early drafts no step took, late replies, "
            "drafts cut to the scheduled length)",
            lambda: self.proposer.received_draft_tokens if self.proposer is not None else 0,
            "{token}",
        )
        counter(
            "specdec_invalid_drafts",
            "drafts discarded as invalid (bad ids, counts or probabilities): k = 0 for that sequence and step",
            lambda: self.proposer.invalid_drafts if self.proposer is not None else 0,
            "{draft}",
        )
        counter(
            "specdec_requests_finished",
            "requests finished (stop or length)",
            lambda: self.loop.finished_requests,
            "{request}",
        )
        counter(
            "specdec_requests_aborted", "requests cancelled or aborted", lambda: self.loop.aborted_requests, "{request}"
        )
        meter.create_observable_counter(
            "specdec_drafted_tokens_by_position",
            [lambda _o: _by_position(self.drafted_by_position)],
            unit="{token}",
            description="draft tokens scored, by position in the draft (0 = first)",
        )
        meter.create_observable_counter(
            "specdec_accepted_tokens_by_position",
            [lambda _o: _by_position(self.accepted_by_position)],
            unit="{token}",
            description="draft tokens accepted, by position in the draft (0 = first)",
        )
        prefix = engine.scheduler.prefix_cache
        counter(
            "specdec_prefix_cache_query_tokens",
            "prompt tokens looked up in the prefix cache",
            lambda: prefix.query_tokens,
        )
        counter(
            "specdec_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache", lambda: prefix.hit_tokens
        )
        counter(
            "specdec_prefix_cache_evictions",
            "cached KV blocks evicted to make room",
            lambda: engine.blocks.num_evictions,
            "{block}",
        )
        gauge("specdec_prefix_cache_hit_rate", "hit tokens / query tokens since start", lambda: prefix.hit_rate)
        gauge(
            "specdec_kv_blocks_cached",
            "free KV blocks that still hold reusable prefix-cache content",
            lambda: engine.blocks.num_cached_blocks,
            "{block}",
        )
        gauge("specdec_acceptance_rate", "accepted / drafted tokens since start", lambda: stats.acceptance_rate)
        gauge(
            "specdec_tokens_per_draft_round",
            "tokens per draft round since start: 1 + accepted / draft rounds",
            lambda: stats.tokens_per_draft_round,
            "{token}",
        )
        gauge(
            "specdec_mean_accepted_length",
            "deprecated: the same as specdec_tokens_per_draft_round",
            lambda: stats.tokens_per_draft_round,
            "{token}",
        )
        meter.create_observable_gauge(
            "specdec_acceptance_rate_by_position",
            [lambda _o: self._acceptance_by_position()],
            unit="1",
            description="accepted / drafted at each draft position since start",
        )
        gauge(
            "specdec_requests_running",
            "sequences in the running batch",
            lambda: len(engine.scheduler.running),
            "{request}",
        )
        gauge(
            "specdec_requests_waiting",
            "sequences waiting for admission",
            lambda: len(engine.scheduler.waiting),
            "{request}",
        )
        gauge("specdec_kv_blocks_free", "free KV cache blocks", lambda: engine.blocks.num_free_blocks, "{block}")
        gauge(
            "specdec_kv_blocks_used",
            "KV cache blocks in use",
            lambda: engine.blocks.num_blocks - engine.blocks.num_free_blocks,
            "{block}",
        )
        gauge(
            "specdec_proposer_connected",
            "1 while the proposer stream is up",
            lambda: float(self.proposer is not None and self.proposer.connected),
        )
        self.step_seconds = meter.create_histogram(
            "specdec_step_duration_seconds",
            unit="s",
            description="engine step wall time",
            explicit_bucket_boundaries_advisory=STEP_BUCKETS_S,
        )
        self.phase_seconds = meter.create_histogram(
            "specdec_step_phase_duration_seconds",
            unit="s",
            description="engine step time by phase: propose, score, verify, network (propose round trip "
            "minus the proposer's own time), grammar_mask (structured output's masks, computed while the target "
            "scores) and grammar_wait (how long verify waited for them)",
            explicit_bucket_boundaries_advisory=STEP_BUCKETS_S,
        )
        latency = RequestLatency.create(meter, "specdec_", "verifier")
        self.ttft, self.itl, self.e2e = latency.ttft, latency.itl, latency.e2e
        self._phase_attrs = {p: {"phase": p} for p in (*PHASES, "network", "grammar_mask", "grammar_wait")}

    def _acceptance_by_position(self) -> Iterable[Observation]:
        for i, (drafted, accepted) in enumerate(zip(self.drafted_by_position, self.accepted_by_position, strict=True)):
            if drafted:
                yield Observation(accepted / drafted, {"position": str(i)})

    # ---- requests (event loop thread) --------------------------------------------------------------

    def request_started(
        self, request_id: str, session_id: str, prompt_tokens: int, caller_request_id: str = ""
    ) -> RequestTrace:
        """`request_id`: the verifier's own (the engine's key); `caller_request_id`: the caller's (checked)."""
        attributes: dict[str, str | int] = {
            "specdec.request_id": request_id,
            "specdec.session_id": session_id,
            "specdec.prompt_tokens": prompt_tokens,
        }
        if caller_request_id:
            attributes["specdec.caller_request_id"] = caller_request_id
        span = self.tracer.start_span("verifier.request", kind=trace.SpanKind.INTERNAL, attributes=attributes)
        req = RequestTrace(request_id, span, time.perf_counter())
        if span.is_recording():
            with self._lock:
                self._requests[request_id] = req
        return req

    def request_update(self, req: RequestTrace, num_tokens: int) -> None:
        now = time.perf_counter()
        if req.last_update is None:
            self.ttft.record(now - req.started)
        elif num_tokens:
            self.itl.record((now - req.last_update) / num_tokens)
        req.last_update = now

    def request_finished(self, req: RequestTrace, usage: Any, finish_reason: str | None) -> None:
        self.e2e.record(time.perf_counter() - req.started)
        span = req.span
        if span.is_recording():
            span.set_attributes(
                {
                    "specdec.completion_tokens": usage.completion_tokens,
                    "specdec.drafted_tokens": usage.drafted_tokens,
                    "specdec.accepted_tokens": usage.accepted_tokens,
                    "specdec.num_steps": usage.num_steps,
                    "specdec.finish_reason": str(finish_reason or ""),
                    **{f"specdec.{phase}_seconds": s for phase, s in req.phase_seconds.items()},
                }
            )
        self._end(req)

    def request_failed(self, req: RequestTrace, code: Any, message: str) -> None:
        set_error(req.span, code, message)
        self._end(req)

    def request_cancelled(self, req: RequestTrace) -> None:
        """The call ended without a last update (client cancel, deadline); no-op for an ended request."""
        if not req.ended:
            set_error(req.span, grpc.StatusCode.CANCELLED, "the call ended before the request finished")
            self._end(req)

    def _end(self, req: RequestTrace) -> None:
        with self._lock:
            self._requests.pop(req.request_id, None)
            req.ended = True
            req.span.end()

    # ---- engine steps (the engine's worker thread) ---------------------------------------------------

    def step_started(self, batch: list[ScheduledSeq]) -> None:
        if self.proposer is not None:
            self.proposer.last_round_trip = None
        if not self.tracing:
            return
        if self._step is not None:  # the previous step raised before it finished: close its spans
            self._abandon_step(self._step)
        with self._lock:
            leader = next((self._requests[s.seq.seq_id] for s in batch if s.seq.seq_id in self._requests), None)
        parent = trace.set_span_in_context(leader.span) if leader is not None else otel_context.Context()
        span = self.tracer.start_span("engine.step", context=parent, attributes={"specdec.batch_size": len(batch)})
        if not span.is_recording():
            return
        step_ctx = trace.set_span_in_context(span)
        propose_span = self.tracer.start_span("propose", context=step_ctx)
        # Current in this thread while the drafter runs: RemoteProposer puts it into the ProposeRequest.
        token = otel_context.attach(trace.set_span_in_context(propose_span, step_ctx))
        scheduled_k = {s.seq.seq_id: s.k for s in batch if s.samples}
        self._step = _StepInProgress(span, propose_span, token, scheduled_k, len(batch))

    def _abandon_step(self, step: _StepInProgress) -> None:
        self._step = None
        for span in (step.propose_span, step.span):
            if span.is_recording():
                span.set_status(trace.Status(trace.StatusCode.ERROR, "the engine step failed"))
                span.end()

    def propose_finished(self, proposed: float) -> None:
        step = self._step
        if step is None:
            return
        otel_context.detach(step.token)  # type: ignore[arg-type]
        rt = self.proposer.last_round_trip if self.proposer is not None else None
        if rt is not None:
            step.propose_span.set_attributes(
                {
                    "specdec.proposer.round_trip_seconds": rt.seconds,
                    "specdec.proposer.draft_seconds": rt.draft_seconds,
                    "specdec.proposer.network_seconds": rt.network_seconds,
                    "specdec.proposer.waited_seconds": rt.waited,
                    "specdec.proposer.fallback": rt.fallback,
                }
            )
            for seq_id, why in rt.invalid:
                step.propose_span.add_event("invalid_draft", {"specdec.seq_id": seq_id, "specdec.reason": why})
        step.propose_span.end(end_time=_ns(proposed, self._offset_ns))

    def asking_early(self, num_seqs: int) -> tuple[trace.Span, object] | None:
        """The next step's drafts are asked for after this step's commit: an `ask_early` span, a child of this
        step, is current while the request is sent, so the proposer's `proposer.draft` span is its child."""
        step = self._step
        if step is None:
            return None
        span = self.tracer.start_span(
            "ask_early", context=trace.set_span_in_context(step.span), attributes={"specdec.sequences": num_seqs}
        )
        return span, otel_context.attach(trace.set_span_in_context(span))

    def asked_early(self, token: tuple[trace.Span, object] | None) -> None:
        if token is not None:
            span, attached = token
            otel_context.detach(attached)  # type: ignore[arg-type]
            span.end()

    def step_finished(
        self, outputs: list[RequestOutput], start: float, proposed: float, scored: float, verified: float
    ) -> None:
        end = time.perf_counter()
        times = {"propose": proposed - start, "score": scored - proposed, "verify": verified - scored}
        rt = self.proposer.last_round_trip if self.proposer is not None else None
        if rt is not None and not rt.fallback:
            times["network"] = rt.network_seconds
        self.step_seconds.record(end - start)
        for phase, seconds in times.items():
            self.phase_seconds.record(seconds, self._phase_attrs[phase])
        masks = self.engine.last_masks
        if masks is not None and masks.start < start:
            masks = None  # an earlier step's
        if masks is not None:
            self.phase_seconds.record(masks.end - masks.start, self._phase_attrs["grammar_mask"])
            self.phase_seconds.record(masks.waited, self._phase_attrs["grammar_wait"])
        for out in outputs:
            for i in range(min(out.draft_depth, len(self.drafted_by_position))):
                self.drafted_by_position[i] += 1
                if i < out.num_accepted:
                    self.accepted_by_position[i] += 1
        step, self._step = self._step, None
        if step is not None:
            self._finish_step_span(step, outputs, times, proposed, scored, verified, end, masks)

    def _finish_step_span(
        self,
        step: _StepInProgress,
        outputs: list[RequestOutput],
        times: dict[str, float],
        proposed: float,
        scored: float,
        verified: float,
        end: float,
        masks: MaskTiming | None = None,
    ) -> None:
        ctx = trace.set_span_in_context(step.span)
        offset = self._offset_ns
        k = [o.num_drafted for o in outputs]
        accepted = [o.num_accepted for o in outputs]
        drafted, num_accepted, emitted = sum(k), sum(accepted), sum(len(o.new_token_ids) for o in outputs)
        self.tracer.start_span(
            "score", context=ctx, start_time=_ns(proposed, offset), attributes={"specdec.scored_tokens": drafted}
        ).end(end_time=_ns(scored, offset))
        self.tracer.start_span(
            "verify",
            context=ctx,
            start_time=_ns(scored, offset),
            attributes={"specdec.accepted_tokens": num_accepted, "specdec.emitted_tokens": emitted},
        ).end(end_time=_ns(verified, offset))
        if masks is not None:  # overlaps the score span: it ran in a worker thread meanwhile
            self.tracer.start_span(
                "grammar_mask",
                context=ctx,
                start_time=_ns(masks.start, offset),
                attributes={"specdec.masked_positions": masks.rows, "specdec.wait_ms": masks.waited * 1000},
            ).end(end_time=_ns(masks.end, offset))
        step.span.set_attributes(
            {
                "specdec.step": self.engine.stats.steps,
                "specdec.sampling_sequences": len(outputs),
                "specdec.drafted_tokens": drafted,
                "specdec.accepted_tokens": num_accepted,
                "specdec.emitted_tokens": emitted,
                "specdec.k": k,
                "specdec.scheduled_k": [step.scheduled_k.get(o.request_id, 0) for o in outputs],
                "specdec.accepted": accepted,
                "specdec.request_ids": [o.request_id for o in outputs],
            }
        )
        step.span.end(end_time=_ns(end, offset))
        self._annotate_requests(step, outputs, times)

    def _annotate_requests(self, step: _StepInProgress, outputs: list[RequestOutput], times: dict[str, float]) -> None:
        step_ctx = step.span.get_span_context()
        number = self.engine.stats.steps
        with self._lock:
            for out in outputs:
                req = self._requests.get(out.request_id)
                if req is None:
                    continue
                req.span.add_link(step_ctx)
                req.span.add_event(
                    "step",
                    {
                        "specdec.step": number,
                        "specdec.k": out.num_drafted,
                        "specdec.accepted": out.num_accepted,
                        "specdec.emitted": len(out.new_token_ids),
                    },
                )
                req.num_steps += 1
                for phase, seconds in times.items():
                    req.phase_seconds[phase] += seconds


def _by_position(counts: list[int]) -> Iterable[Observation]:
    return [Observation(n, {"position": str(i)}) for i, n in enumerate(counts)]
