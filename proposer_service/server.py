"""The proposer service: a thin gRPC layer over a Drafter (draft model, EAGLE head or n-gram: builder.py).

One bidi `Propose` stream per verifier. Sequence state is scoped to the stream: seq ids are namespaced per
stream inside the (shared) drafter and everything a stream created is released when it ends, so a new
stream starts clean. Each request message is drafted with ONE `drafter.propose` call (the draft model
batches all its sequences into one forward per draft position), off the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc

from proposer_service.builder import ProposerInfo, build_drafter
from proposer_service.config import ProposerConfig
from proposer_service.paged_drafter import PagedDrafter
from proposer_service.telemetry import ProposerTelemetry
from shared.config import load_config
from shared.draft_codec import pack_draft
from shared.drafting import Draft, Drafter, DraftRequest
from shared.errors import InvalidRequestError, grpc_status_for
from shared.feature_codec import features_from_proto
from shared.grpc_server import add_health_and_reflection, new_server, set_serving, setup_logging
from shared.hugepages import advise_process_memory
from shared.malloc_tuning import tune_malloc
from shared.model.tp_group import TPModelRunner
from shared.omp_defaults import model_thread
from shared.proto_convert import sampling_params_from_proto
from shared.proto_gen.specdec.v1 import proposer_pb2, proposer_pb2_grpc
from shared.sampling import SamplingParams
from shared.service_runtime import ServiceRuntime
from shared.telemetry import Telemetry, setup_telemetry
from shared.tls import add_port, check_files_or_exit, server_interceptors

log = logging.getLogger("specdec.proposer")

SERVICE_NAME = proposer_pb2.DESCRIPTOR.services_by_name["Proposer"].full_name
# ---- proto <-> domain ---------------------------------------------------------------------------


def _params_usable(params: SamplingParams) -> bool:
    floats = (params.temperature, params.top_p, params.min_p)
    if not all(math.isfinite(x) for x in floats):
        return False
    try:
        params.validate()
    except ValueError:
        return False
    return True


# ---- the servicer -------------------------------------------------------------------------------


@dataclass
class _StreamState:
    number: int
    live: set[str]  # wire seq ids with state in the drafter
    blocked: set[str]  # wire seq ids that carried ids outside the vocabulary: never drafted
    last_round: tuple[list[DraftRequest], list[Draft]] = ([], [])  # the drafter's last call: what to draft ahead of

    def key(self, seq_id: str) -> str:
        return f"s{self.number}/{seq_id}"


class ProposerServicer(proposer_pb2_grpc.ProposerServicer):
    def __init__(
        self,
        drafter: Drafter,
        info: ProposerInfo,
        telemetry: Telemetry | None = None,
        compute: ThreadPoolExecutor | None = None,
    ) -> None:
        """`compute`: the drafter's model thread (shared.omp_defaults.model_thread), which built it; default: a
        new one. Every drafter call runs on it."""
        self.drafter = drafter
        self.info = info
        self.compute = compute or model_thread("drafter")
        self.telemetry = ProposerTelemetry(telemetry or Telemetry("specdec-proposer"), self)
        self._drafter_lock = threading.Lock()  # the drafter is not thread-safe; held by worker threads only
        self._stream_numbers = itertools.count(1)
        self._pending_release: list[str] = []
        self._inflight = 0  # messages being drafted
        self._idle = asyncio.Event()
        self._idle.set()
        # counters
        self.open_streams = 0
        self.drafter_calls = 0
        self.messages = 0
        self.invalid_features = 0

    async def GetInfo(self, request: proposer_pb2.GetInfoRequest, context: grpc.aio.ServicerContext):
        if request.max_tree_nodes:
            log.info("verifier %s scores token trees of up to %d nodes", context.peer(), request.max_tree_nodes)
        # A verifier drops drafts wider than it accepts: draft from no more top tokens than it said.
        drafter = self.drafter
        if isinstance(drafter, PagedDrafter) and 0 < request.max_draft_support < drafter.top_n:
            log.warning(
                "draft top-n lowered from %d to %d: the verifier's max_draft_support",
                drafter.top_n,
                request.max_draft_support,
            )
            drafter.top_n = request.max_draft_support
        return self.info.to_proto()

    async def Propose(  # type: ignore[override]
        self, request_iterator: AsyncIterator[proposer_pb2.ProposeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[proposer_pb2.ProposeResponse]:
        stream = _StreamState(next(self._stream_numbers), set(), set())
        self.open_streams += 1
        log.info("propose stream opened stream=%d peer=%s", stream.number, context.peer())
        try:
            async for request in request_iterator:
                self._inflight += 1
                self._idle.clear()
                try:
                    response = await self._answer(request, stream)
                except InvalidRequestError as err:
                    code, message = grpc_status_for(err)
                    log.warning("propose stream=%d rejected a message: %s", stream.number, message)
                    await context.abort(code, message)
                finally:
                    self._inflight -= 1
                    if not self._inflight:
                        self._idle.set()
                yield response
                self._start_drafting_ahead(stream)
        finally:
            self._pending_release.extend(stream.key(s) for s in stream.live)
            log.info("propose stream closed stream=%d sequences_released=%d", stream.number, len(stream.live))
            try:
                await self._on_compute(self._locked_call, [], [])  # applies the pending releases
            except BaseException:  # cancelled during shutdown: the drafter goes away with the process
                pass
            finally:
                self.open_streams -= 1

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def _answer(self, request: proposer_pb2.ProposeRequest, stream: _StreamState) -> proposer_pb2.ProposeResponse:
        started = self.telemetry.message_started(request)
        response = None
        try:
            response = await self._draft_message(request, stream)
        finally:
            self.telemetry.message_finished(started, response)
        return response

    async def _draft_message(
        self, request: proposer_pb2.ProposeRequest, stream: _StreamState
    ) -> proposer_pb2.ProposeResponse:
        self.messages += 1
        ids = [seq.seq_id for seq in request.sequences]
        if "" in ids or len(set(ids)) != len(ids):
            raise InvalidRequestError(f"step {request.step_id}: every seq_id must be non-empty and appear once")
        releases = []
        for seq_id in request.release_seq_ids:
            stream.blocked.discard(seq_id)
            if seq_id in stream.live:
                stream.live.discard(seq_id)
                releases.append(stream.key(seq_id))
        answers: list[Draft | None] = []  # None: filled in by the drafter
        to_draft: list[DraftRequest] = []
        for seq in request.sequences:
            answer = self._precheck(seq, stream, releases)
            answers.append(answer)
            if answer is None:
                to_draft.append(self._to_domain(seq, stream))
                stream.live.add(seq.seq_id)
        drafted = await self._draft(releases, to_draft)
        stream.last_round = (to_draft, drafted)
        drafts = iter(drafted)
        response = proposer_pb2.ProposeResponse(step_id=request.step_id)
        for seq, answer in zip(request.sequences, answers, strict=True):
            draft = answer if answer is not None else next(drafts)
            response.drafts.append(pack_draft(seq.seq_id, draft))
        return response

    def _start_drafting_ahead(self, stream: _StreamState) -> None:
        """After an answer went out: the drafter drafts the next round for its likely outcomes (draft_ahead.py), in
        a worker thread, until the stream's (or any stream's) next message arrives."""
        draft_ahead = getattr(self.drafter, "draft_ahead", None)
        cache = getattr(self.drafter, "cache", None)
        if draft_ahead is None or cache is None or not cache.ahead or not stream.last_round[0]:
            return
        requests, drafts = stream.last_round
        stream.last_round = ([], [])
        seen = self.messages

        def run() -> None:
            with self._drafter_lock:
                if self.messages == seen:
                    draft_ahead(requests, drafts, lambda: self.messages != seen)

        asyncio.get_running_loop().run_in_executor(self.compute, run).add_done_callback(_log_failure)

    def _precheck(self, seq: proposer_pb2.ProposeSequence, stream: _StreamState, releases: list[str]) -> Draft | None:
        """An answer that needs no drafter call, or None."""
        n = len(seq.new_token_ids)
        if (seq.full_sequence and n != seq.committed_len) or seq.committed_len < n:
            # Inconsistent message: forget the sequence; the verifier resends it whole.
            if seq.seq_id in stream.live:
                stream.live.discard(seq.seq_id)
                releases.append(stream.key(seq.seq_id))
            return Draft(seq.seq_id, seq.committed_len, [], needs_resync=True)
        vocab = self.info.vocab_size
        if vocab and any(not 0 <= t < vocab for t in seq.new_token_ids):
            log.warning(
                "sequence %s carries token ids outside the draft vocabulary [0, %d): not drafted", seq.seq_id, vocab
            )
            stream.blocked.add(seq.seq_id)
        if seq.seq_id in stream.blocked:
            if seq.seq_id in stream.live:
                stream.live.discard(seq.seq_id)
                releases.append(stream.key(seq.seq_id))
            return Draft(seq.seq_id, seq.committed_len, [])
        return None

    def _to_domain(self, seq: proposer_pb2.ProposeSequence, stream: _StreamState) -> DraftRequest:
        params = sampling_params_from_proto(seq.sampling_params)
        k = min(seq.k, self.info.max_k)
        if self.info.max_model_len:
            k = min(k, max(0, self.info.max_model_len - seq.committed_len))
        if not _params_usable(params):
            params, k = SamplingParams(), 0  # keep the history in step, draft nothing
        features, feature_start = None, 0
        if self.info.target_hidden_size and seq.HasField("target_features"):
            try:
                feature_start, features = features_from_proto(seq.target_features, self.info.feature_width)
            except ValueError as err:  # a broken block is dropped: the drafter fills what it lacks itself
                self.invalid_features += 1
                log.warning("features of sequence %s dropped: %s", seq.seq_id, err)
        return DraftRequest(
            stream.key(seq.seq_id),
            seq.committed_len,
            list(seq.new_token_ids),
            k,
            params,
            features,
            feature_start,
            seq.draft_position,
            seq.tenant,
            seq.max_tree_nodes if k > 0 else 0,
            max(0.0, seq.min_tree_node_prob) if math.isfinite(seq.min_tree_node_prob) else 0.0,
        )

    async def _draft(self, releases: list[str], requests: list[DraftRequest]) -> list[Draft]:
        if not requests and not releases and not self._pending_release:
            return []
        try:
            drafts = await self._on_compute(self._locked_call, releases, requests)
            if len(drafts) != len(requests):
                raise RuntimeError(f"drafter returned {len(drafts)} drafts for {len(requests)} sequences")
        except Exception:
            log.exception("drafting failed for %d sequences; they resync", len(requests))
            self._pending_release.extend(r.seq_id for r in requests)  # their state may be half-updated
            drafts = [Draft(r.seq_id, r.committed_len, [], needs_resync=True) for r in requests]
        return drafts

    async def _on_compute(self, fn: Callable[..., list[Draft]], *args: Any) -> list[Draft]:
        return await asyncio.get_running_loop().run_in_executor(self.compute, fn, *args)

    def _locked_call(self, releases: list[str], requests: list[DraftRequest]) -> list[Draft]:
        """Runs in a worker thread: releases (pending ones first), then one batched propose."""
        with self._drafter_lock:
            pending = []
            while self._pending_release:  # list.pop is atomic: the event loop thread may append meanwhile
                pending.append(self._pending_release.pop())
            if pending or releases:
                self.drafter.release([*pending, *releases])
            if not requests:
                return []
            self.drafter_calls += 1
            drafts = self.drafter.propose(requests)
            phases = getattr(self.drafter, "phase_seconds", None)  # read before drafting ahead adds to it
            if phases is not None:
                self.telemetry.record_phases(phases)
            return drafts


# ---- serving -----------------------------------------------------------------------------------


class ProposerServer(ServiceRuntime):
    """A running proposer: gRPC server, servicer, health."""

    role = "proposer"
    log = log

    def __init__(self, server: grpc.aio.Server, servicer: ProposerServicer, health, port: int) -> None:
        super().__init__()
        self.server = server
        self.servicer = servicer
        self.health = health
        self.port = port
        self.telemetry = Telemetry("specdec-proposer")

    @classmethod
    async def start(
        cls,
        config: ProposerConfig,
        drafter: Drafter | None = None,
        info: ProposerInfo | None = None,
        telemetry: Telemetry | None = None,
    ) -> ProposerServer:
        """`telemetry`: default from the OTEL_* environment and --metrics-port (shared/telemetry.py)."""
        compute = model_thread("drafter")  # built on the thread that will draft
        if drafter is None or info is None:
            drafter, info = await asyncio.get_running_loop().run_in_executor(compute, build_drafter, config)
        assert drafter is not None and info is not None
        await asyncio.to_thread(advise_process_memory, "proposer")  # the drafter's weights on huge pages
        if telemetry is None:
            telemetry = setup_telemetry("specdec-proposer", metrics_port=config.metrics_port, metrics_host=config.host)
        servicer = ProposerServicer(drafter, info, telemetry, compute)
        server = new_server([*telemetry.server_interceptors(), *server_interceptors(config)])
        proposer_pb2_grpc.add_ProposerServicer_to_server(servicer, server)
        health = add_health_and_reflection(server, [SERVICE_NAME])
        port = add_port(server, config.host, config.port, config, "proposer")
        tp_runner = _tp_runner(drafter)
        if not port:
            if tp_runner is not None:
                await asyncio.to_thread(tp_runner.close)
            telemetry.shutdown()
            raise OSError(f"cannot listen on {config.host}:{config.port}")
        await server.start()
        await set_serving(health, [SERVICE_NAME], True)
        log.info(
            "proposer serving host=%s port=%d kind=%s model=%s tensor_parallel_size=%d",
            config.host,
            port,
            info.kind,
            info.model,
            config.tensor_parallel_size,
        )
        instance = cls(server, servicer, health, port)
        instance.telemetry = telemetry
        instance.watch_rank_failures()
        return instance

    @property
    def tp_runner(self) -> TPModelRunner | None:
        return _tp_runner(self.servicer.drafter)

    async def _fail(self, reason: str) -> None:
        """A rank died: NOT_SERVING, stop serving (the verifier decodes with k = 0 or uses another proposer
        meanwhile), then `failed`: serve() exits non-zero."""
        log.error("tensor-parallel rank failure, the proposer stops serving: %s", reason)
        await set_serving(self.health, [SERVICE_NAME], False)
        await self.server.stop(0.5)
        self.failed.set()

    async def shutdown(self, grace_s: float) -> None:
        """NOT_SERVING, let the batches being drafted finish (at most grace_s), then close every stream."""
        log.info("proposer shutting down grace_s=%.1f open_streams=%d", grace_s, self.servicer.open_streams)
        await set_serving(self.health, [SERVICE_NAME], False)
        await self.servicer.wait_idle(grace_s)
        await self.server.stop(0.5)
        if self.tp_runner is not None:
            await asyncio.to_thread(self.tp_runner.close)  # "stop" to the other ranks, then wait for them
        await asyncio.to_thread(self.telemetry.shutdown)  # flushes spans still batched for export
        log.info("proposer stopped")


def _log_failure(done: asyncio.Future) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.error("drafting ahead failed: %r", done.exception())  # the next round drafts on demand


def _tp_runner(drafter: Drafter) -> TPModelRunner | None:
    runner = getattr(drafter, "runner", None)
    return runner if isinstance(runner, TPModelRunner) else None


async def serve(config: ProposerConfig, on_ready: Callable[[ProposerServer], None] | None = None) -> None:
    await ProposerServer.serve_until_stopped(lambda: ProposerServer.start(config), config.grace_period_s, on_ready)


def main(argv: list[str] | None = None) -> None:
    config = load_config(ProposerConfig, argv)
    setup_logging(config.log_level)
    check_files_or_exit(config, "proposer")
    tune_malloc()
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
