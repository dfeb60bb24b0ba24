"""The gateway's core, shared by its two front ends (gRPC: servicer.py, OpenAI HTTP: http_api.py).

Request flow: check fields (an output format is compiled here: a bad schema fails before routing) -> tokenize
(or render the chat template) -> pick a verifier -> stream Verifier.Generate, turning each verifier message
into one chunk (token ids + UTF-8 safe text, text that might begin a stop string held back, logprobs when
asked). The core keeps each live request's emitted tokens.
If its verifier fails mid-stream (UNAVAILABLE, or the verifier side cancelled the call) the request resumes
on another healthy verifier: the new prompt is the original prompt plus the tokens emitted so far and
max_tokens is lowered by their number, so the client sees one uninterrupted stream.

Cancellation: when the client goes away (a gRPC cancel or deadline, an HTTP disconnect) the front end's task
is cancelled; the verifier call is cancelled with it (in `finally`, and by the ClientCall's done-callback as a
second guard), so the verifier frees the request's KV blocks within one engine step. A stop string also
cancels the verifier call. The client's remaining deadline is passed on to the verifier call.

The front ends differ only in how they read requests and write responses; the core raises SpecdecError /
VerifierError and each front end maps them to its own statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.auth import ApiKeyAuth, Grant
from gateway.backends import BackendPool
from gateway.output import Chunk
from gateway.prepare import PreparedRequest, RequestFields, RequestPreparer
from gateway.telemetry import GatewayRequestTrace, GatewayTelemetry
from gateway.verifier_client import VerifierCall, VerifierError, VerifierFailed, VerifierFull, verifier_request
from shared.errors import (
    InternalError,
    InvalidRequestError,
    OverloadedError,
    RateLimitedError,
    SpecdecError,
    UnauthenticatedError,
    UnavailableError,
)
from shared.logprobs import TokenLogprob
from shared.logprobs import from_proto as logprobs_from_proto
from shared.proto_gen.specdec.v1 import common_pb2
from shared.request_ids import checked_or_empty, new_internal_id
from shared.telemetry import Telemetry

log = logging.getLogger(__name__)

FINISH_UNSPECIFIED = common_pb2.FINISH_REASON_UNSPECIFIED
FINISH_STOP = common_pb2.FINISH_REASON_STOP
FINISH_LENGTH = common_pb2.FINISH_REASON_LENGTH
FINISH_ABORT = common_pb2.FINISH_REASON_ABORT


@dataclass
class Final:
    finish_reason: int
    usage: common_pb2.Usage
    stop_string: str | None = None
    stop_token_id: int | None = None


@dataclass
class _Accounting:
    """Usage summed over the verifier segments of one request (more than one after a resume)."""

    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    cached_prompt: int | None = None

    def add_segment(self, segment: _Segment) -> None:
        # A segment that ended without its final message (cancelled after a stop string, or its verifier
        # died) has no usage: its steps are counted from the messages, its drafts from the running counts
        # every message carries.
        usage, steps_seen = segment.usage, segment.steps
        if usage is None:
            self.steps += steps_seen
            self.drafted += segment.drafted
            self.accepted += segment.accepted
            return
        self.drafted += usage.drafted_tokens
        self.accepted += usage.accepted_tokens
        self.steps += usage.num_steps or steps_seen
        if self.cached_prompt is None:
            self.cached_prompt = usage.cached_prompt_tokens


@dataclass
class _RequestRun:
    """One request across its verifier segments (more than one after a resume)."""

    request_id: str  # the gateway's own id: what verifiers, logs and spans key the request by
    traced: GatewayRequestTrace
    started: float  # time.monotonic() when the request arrived
    client_request_id: str = ""  # what the client sent (checked) or, if none, request_id: echoed back
    acct: _Accounting = field(default_factory=_Accounting)
    failed_backends: set[str] = field(default_factory=set)  # left out when picking the next verifier
    full_backends: set[str] = field(default_factory=set)  # whose queue was full for this request
    full_reason: str = ""  # the last full verifier's own message
    resumes: int = 0
    live_calls: list[Any] = field(default_factory=list)  # the verifier calls to cancel if the client goes away
    grant: Grant = field(default_factory=Grant)  # the API key's name and token charges


@dataclass
class GatewayCounters:
    active_requests: int = 0
    total_requests: int = 0
    resumed_requests: int = 0


@dataclass
class _Segment:
    usage: common_pb2.Usage | None = None
    steps: int = 0
    drafted: int = 0  # the verifier's running counts for this segment, from its latest message
    accepted: int = 0
    calls: list[Any] = field(default_factory=list)


class ClientCall(Protocol):
    """What the core needs of a front end's call: grpc.aio.ServicerContext has it, the HTTP front end adapts."""

    def time_remaining(self) -> float | None: ...  # the client's deadline, None without one

    def done(self) -> bool: ...  # the client has gone (cancelled, disconnected) or the call ended

    def add_done_callback(self, callback: Callable[[Any], object]) -> None: ...


class GatewayCore:
    """One generation path for both front ends: admission, validation, tokenization, routing, resume,
    detokenization, stop strings, logprobs, usage."""

    def __init__(
        self,
        preparer: RequestPreparer,
        pool: BackendPool,
        telemetry: Telemetry | None = None,
        auth: ApiKeyAuth | None = None,
    ) -> None:
        self.preparer = preparer
        self.auth = auth  # None: no API keys (--api-keys-file unset)
        self.pool = pool
        self.router = pool.router
        self.config = preparer.config
        self.counters = GatewayCounters()
        self.active_generations = 0  # admitted generation requests of both front ends, until their grant is released
        self.telemetry = GatewayTelemetry(telemetry or Telemetry("specdec-gateway"), self.counters)

    def admit(self, authorization: Iterable[str], peer: str, limits: bool = True) -> Grant:
        """The caller's API key (UNAUTHENTICATED) and its limits (RESOURCE_EXHAUSTED), before any work.
        `authorization`: the values of the caller's authorization headers ('Bearer <key>'). With `limits` (a
        generation request) one of the --max-concurrent-rpcs generation slots of both ports is taken too:
        the gRPC server's own cap is set above it, so health checks always find room."""
        grant = self._admit_key(authorization, peer, limits)
        if not limits:
            return grant
        if self.active_generations >= self.config.max_concurrent_rpcs:
            grant.release()
            self.telemetry.rate_limited.add(1, {"api_key": grant.name, "limit": "gateway_streams"})
            raise OverloadedError(
                f"this gateway is serving {self.active_generations} requests, its limit; retry in 1 s", 1
            )
        self.active_generations += 1
        grant.hold(self._release_generation)
        return grant

    def _release_generation(self) -> None:
        self.active_generations -= 1

    def _admit_key(self, authorization: Iterable[str], peer: str, limits: bool) -> Grant:
        if self.auth is None:
            return Grant()
        values = list(authorization)
        try:
            return self.auth.admit(values, limits)
        except UnauthenticatedError as err:
            self.telemetry.auth_rejections.add(1, {"reason": err.reason})
            log.info("event=unauthenticated reason=%s peer=%s", err.reason, peer)
            raise
        except RateLimitedError as err:
            self.telemetry.rate_limited.add(1, {"api_key": err.client, "limit": err.limit})
            log.info(
                "event=rate_limited api_key=%s limit=%s retry_after_s=%d", err.client, err.limit, err.retry_after_s
            )
            raise

    # -- the request loop --------------------------------------------------------------------------

    async def generate(
        self, fields: RequestFields, context: ClientCall, grant: Grant
    ) -> AsyncGenerator[tuple[str, Chunk, Final | None], None]:
        """Yields (request_id, chunk, final-or-None) per verifier message; raises SpecdecError / VerifierError.

        Here: the request's lifecycle (counters, trace, validation, the log line of how it ended); the verifier
        segments and resumes are in _resume_loop, the usage and the trace's end in _finish."""
        self.counters.total_requests += 1
        self.counters.active_requests += 1
        started = time.monotonic()
        live_calls: list[Any] = []
        # Second guard: whatever the handler task is doing when the client goes away, cancel the verifier call.
        context.add_done_callback(lambda _ctx: [call.cancel() for call in live_calls])
        # Our own id keys the request everywhere (verifiers, proposer, logs); the client's, checked below, is
        # only echoed back and recorded beside it.
        internal_id = new_internal_id()
        # check_fields refuses an id that fails the checks; until then it stays out of logs and spans
        client_id = checked_or_empty(fields.request_id)
        session_id = checked_or_empty(fields.session_id)
        traced = self.telemetry.request_started(internal_id, session_id, grant.name, client_id)
        run = _RequestRun(internal_id, traced, started, client_id or internal_id, live_calls=live_calls, grant=grant)
        try:
            # Off the event loop: a long prompt or a large format must not stall every other stream and the health
            # checks.
            vocab = self.router.vocab_limit()
            prepared = await asyncio.to_thread(self.preparer.prepare_request, fields, vocab, internal_id, grant.tenant)
            grant.charge(len(prepared.prompt_ids))
            final: Final | None = None
            async with contextlib.aclosing(self._resume_loop(prepared, run, context)) as parts:
                async for chunk, final in parts:
                    yield run.client_request_id, chunk, final
            if final is not None:
                self._log_finished(run, final)
        except asyncio.CancelledError:
            log.info("event=cancelled request_id=%s seconds=%.3f", run.request_id, time.monotonic() - run.started)
            raise
        except (SpecdecError, VerifierError) as err:
            level = logging.INFO if isinstance(err, InvalidRequestError) else logging.WARNING
            log.log(
                level,
                "event=rejected request_id=%s client_request_id=%r error=%r",
                run.request_id,
                client_id,
                str(err),
            )
            self.telemetry.failed(run.traced, err)
            raise
        except Exception as err:  # a bug: the log gets the exception, the client a generic message to quote
            log.exception("event=internal_error request_id=%s client_request_id=%r", run.request_id, client_id)
            internal = InternalError(
                f"internal error (request id {run.client_request_id}); the server's log has the details"
            )
            self.telemetry.failed(run.traced, internal)
            raise internal from err
        finally:
            self.telemetry.cancelled(run.traced)
            self.counters.active_requests -= 1
            for call in live_calls:
                call.cancel()

    async def _resume_loop(
        self, prepared: PreparedRequest, run: _RequestRun, context: ClientCall
    ) -> AsyncGenerator[tuple[Chunk, Final | None], None]:
        """One verifier segment after another until the request has its final message: a verifier that fails
        mid-stream is left out and the next one continues from the tokens emitted so far."""
        out = self.preparer.output(prepared)
        final: Final | None = None
        while final is None:
            final = self._finished_before_call(prepared, out.token_ids)
            if final is not None:
                # Only reachable after a resume: nothing left to generate (see _finished_before_call).
                tail = out.finish()
                self._finish(run, prepared, out.token_ids, final)
                yield tail, final
                break
            backend = await self._pick_backend(prepared.session_id, run.failed_backends | run.full_backends, run)
            if not out.token_ids:
                prepared = self.preparer.check_context(prepared, backend.max_model_len)
                out.max_tokens = prepared.max_tokens
            segment = _Segment(calls=run.live_calls)
            stream = self._call_verifier(prepared, out, backend.address, segment, context, run.traced)
            try:
                async with contextlib.aclosing(stream):
                    async for chunk, final in stream:
                        self.telemetry.chunk(run.traced, len(chunk.token_ids))
                        run.grant.charge(len(chunk.token_ids))
                        if final is not None:
                            run.acct.add_segment(segment)
                            self._finish(run, prepared, out.token_ids, final)
                        yield chunk, final
            except VerifierFull as err:
                run.full_backends.add(backend.address)  # not a failure: the next pick skips it
                run.full_reason = str(err)
            except VerifierFailed as err:
                run.acct.add_segment(segment)
                self._resume_or_give_up(run, backend.address, len(out.token_ids), err)

    async def _pick_backend(self, session_id: str, exclude: set[str], run: _RequestRun) -> Any:
        try:
            return self.router.pick(session_id, exclude=exclude)
        except UnavailableError:
            if run.full_backends:  # every verifier left is full: shed the load now instead of queueing it
                raise OverloadedError(
                    f"every verifier's queue is full ({len(run.full_backends)} tried; last: {run.full_reason}); "
                    "retry in 1 s"
                ) from None
            # Maybe a verifier came back since the last periodic check: look now, then decide.
            await self.pool.recheck_unhealthy()
            return self.router.pick(session_id, exclude=exclude)

    def _resume_or_give_up(self, run: _RequestRun, address: str, emitted: int, err: VerifierFailed) -> None:
        """The verifier at `address` failed mid-stream: leave it out and resume, or UNAVAILABLE after
        max_resumes."""
        run.failed_backends.add(address)
        self.pool.mark_failed(address, str(err))
        if run.resumes >= self.config.max_resumes:
            # The verifiers' addresses and errors stay in the log: a client learns nothing of the pods behind us.
            log.warning(
                "event=gave_up request_id=%s verifiers_tried=%d last_error=%r",
                run.request_id,
                run.resumes + 1,
                str(err),
            )
            raise UnavailableError(
                f"the request failed on {run.resumes + 1} verifiers in turn (request id {run.client_request_id}); "
                "retry later"
            ) from None
        run.resumes += 1
        self.counters.resumed_requests += 1
        self.telemetry.event(run.traced, "resume", {"specdec.failed_backend": address})
        # A seeded request resumes exactly: the new verifier is told the output position it starts at
        # (output_offset), and a seeded token depends only on (seed, position, target distribution).
        log.warning(
            "event=resume request_id=%s failed_backend=%s emitted_tokens=%d reason=%r",
            run.request_id,
            address,
            emitted,
            str(err),
        )

    def _finish(self, run: _RequestRun, prepared: PreparedRequest, emitted: list[int], final: Final) -> None:
        """The final message's usage (summed over the segments) and the trace's end, before it is sent."""
        final.usage = self._usage(prepared, emitted, run.acct)
        self.telemetry.finished(run.traced, final.usage, common_pb2.FinishReason.Name(final.finish_reason), run.resumes)

    def _log_finished(self, run: _RequestRun, final: Final) -> None:
        """After the final message was taken by the client."""
        log.info(
            "event=finished request_id=%s client_request_id=%s finish_reason=%s prompt_tokens=%d "
            "completion_tokens=%d drafted=%d accepted=%d resumes=%d seconds=%.3f api_key=%s",
            run.request_id,
            run.client_request_id,
            common_pb2.FinishReason.Name(final.finish_reason),
            final.usage.prompt_tokens,
            final.usage.completion_tokens,
            final.usage.drafted_tokens,
            final.usage.accepted_tokens,
            run.resumes,
            time.monotonic() - run.started,
            run.grant.name or "-",
        )

    def _finished_before_call(self, prepared: PreparedRequest, emitted: list[int]) -> Final | None:
        """After a resume: is the request already complete? (its verifier died before sending the end)."""
        if not emitted:
            return None
        last = emitted[-1]
        # The verifier stops on all of the model's EOS ids, not only the tokenizer's one.
        eos = self.router.eos_token_ids() | {self.preparer.eos_token_id}
        if last in prepared.stop_token_ids or (last in eos and not prepared.ignore_eos):
            return Final(FINISH_STOP, common_pb2.Usage(), stop_token_id=last)
        if len(emitted) >= prepared.max_tokens:
            return Final(FINISH_LENGTH, common_pb2.Usage())
        limit = self.router.context_limit()
        if limit and len(prepared.prompt_ids) + len(emitted) >= limit:
            return Final(FINISH_LENGTH, common_pb2.Usage())
        return None

    async def _call_verifier(
        self,
        prepared: PreparedRequest,
        out: Any,
        address: str,
        segment: _Segment,
        context: ClientCall,
        traced: GatewayRequestTrace,
    ) -> AsyncGenerator[tuple[Chunk, Final | None], None]:
        backend = self.pool[address]
        emitted = list(out.token_ids)
        timeout = context.time_remaining()  # the client's deadline, passed on; None when it set none
        if timeout is None:
            timeout = self.config.verifier_call_timeout_s
        request = verifier_request(prepared, emitted)
        with self.telemetry.current(traced):  # the call's client span and metadata carry the request's trace
            call = VerifierCall(backend.stub, request, timeout, self.config.stream_idle_timeout_s, address)
        segment.calls.append(call)
        backend.load.active_requests += 1
        last: tuple[Chunk, Final] | None = None
        try:
            async for msg in call.messages(context.done):
                if last is not None:
                    continue  # nothing follows the final message; reading on to the end completes the call
                if msg.token_ids:
                    segment.steps += 1
                segment.drafted = max(segment.drafted, msg.drafted_tokens)
                segment.accepted = max(segment.accepted, msg.accepted_tokens)
                if msg.HasField("usage"):
                    segment.usage = msg.usage  # the last message's; a verifier may also send it earlier
                # before out.add: a verifier whose logprobs do not fit is left with none of its tokens taken
                logprobs = self._logprobs(msg, address) if prepared.num_logprobs is not None else None
                chunk = out.add(msg.token_ids)
                if logprobs is not None:
                    chunk.logprobs = logprobs[: len(chunk.token_ids)]
                if chunk.stop_string is not None:
                    call.cancel()  # the verifier frees the request's KV blocks
                    yield chunk, Final(FINISH_STOP, common_pb2.Usage(), stop_string=chunk.stop_string)
                    return
                reason = msg.finish_reason
                if reason == FINISH_UNSPECIFIED and not chunk.length_reached:
                    yield chunk, None
                    continue
                if reason == FINISH_UNSPECIFIED:  # max_tokens reached, the verifier sent more: cut and stop
                    call.cancel()
                    yield self._last_chunk(chunk, out, FINISH_LENGTH, msg)
                    return
                # The status follows the last message at once. Reading it ends the call (and its client
                # span, which the tracing interceptor closes when the response stream is exhausted).
                last = self._last_chunk(chunk, out, reason, msg)
        except (VerifierFailed, VerifierFull, VerifierError):
            if last is None:
                raise
            # the request was complete before the call failed: fall through and deliver it
        finally:
            backend.load.active_requests -= 1
            if not call.done():
                call.cancel()
            segment.calls.remove(call)
        if last is not None:
            yield last
            return
        # The stream ended without a finish reason: a broken verifier; resume elsewhere.
        raise VerifierFailed(f"verifier {address} ended the stream without a finish reason")

    @staticmethod
    def _logprobs(msg: Any, address: str) -> list[TokenLogprob]:
        try:
            return logprobs_from_proto(msg.logprobs, msg.token_ids)
        except ValueError as err:  # a broken verifier: its output cannot be trusted, go on elsewhere
            raise VerifierFailed(f"verifier {address} sent malformed logprobs: {err}") from None

    def _last_chunk(self, chunk: Chunk, out: Any, reason: int, msg: Any) -> tuple[Chunk, Final]:
        tail = out.finish()
        chunk.text += tail.text
        final = Final(reason, common_pb2.Usage())
        if tail.stop_string is not None:  # a stop string completed in the held-back text
            final.finish_reason, final.stop_string = FINISH_STOP, tail.stop_string
        elif reason == FINISH_STOP:
            if msg.HasField("stop_token_id"):
                final.stop_token_id = msg.stop_token_id
            elif out.token_ids:
                final.stop_token_id = out.token_ids[-1]
        return chunk, final

    def _usage(self, prepared: PreparedRequest, emitted: list[int], acct: _Accounting) -> common_pb2.Usage:
        completion = len(emitted)
        return common_pb2.Usage(
            prompt_tokens=len(prepared.prompt_ids),
            completion_tokens=completion,
            # A resumed segment's cache count is of its longer prompt (the emitted tokens resent with it).
            cached_prompt_tokens=min(acct.cached_prompt or 0, len(prepared.prompt_ids)),
            drafted_tokens=acct.drafted,
            accepted_tokens=min(acct.accepted, acct.drafted),
            num_steps=acct.steps,
            mean_accepted_length=completion / acct.steps if acct.steps else 0.0,  # deprecated: tokens_per_step
            tokens_per_step=completion / acct.steps if acct.steps else 0.0,
        )
