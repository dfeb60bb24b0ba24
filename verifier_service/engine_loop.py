"""Drives the Engine from asyncio: one background task steps it while there is work.

The engine is not thread-safe. Its steps run in a worker thread (so the event loop keeps serving and the
RemoteProposer's stream keeps flowing), back to back while an asyncio lock is held, each step's outputs handed to
the event loop as it ends; whatever must change the engine (a new request, an abort, a hand-over) asks the thread
to stop after its current step and takes the same lock, i.e. it runs between steps. Each request has an
asyncio.Queue of updates that `generate()` yields from; a consumer that stops iterating (client cancel, deadline)
aborts its request, which frees its KV blocks before the next step runs. No grpc in here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from shared.errors import InvalidRequestError, NumericalError, ReaderStalledError, UnavailableError
from shared.grammar import GrammarMatcher
from shared.logprobs import TokenLogprob
from shared.omp_defaults import model_thread
from shared.sampling import SamplingParams
from verifier_service.engine import Engine, RequestOutput, SpeculationRatios
from verifier_service.remote_proposer import RemoteProposer
from verifier_service.sequence import FinishReason

log = logging.getLogger("specdec.verifier.loop")

# Updates a request may have waiting for its reader. A reader that stops (a stalled client behind gRPC flow
# control) must not make the verifier buffer its tokens without bound: past this it is failed, its blocks freed.
MAX_BUFFERED_UPDATES = 4096
# A request's output format is compiled by its own small pool of threads (llguidance releases the GIL), never
# on the event loop nor in the default executor that runs the engine's steps: a large schema costs its sender
# the wait, not every running stream. Past the timeout the request is refused (the compile, bounded by the
# grammar engine's own limits, finishes in the background and is cached).
# A quarter of the cores, at least one: compiling must not take the CPU the engine's steps need either.
GRAMMAR_THREADS = max(1, (os.cpu_count() or 1) // 4)
GRAMMAR_TIMEOUT_S = 10.0


@dataclass
class RequestUsage:
    """Token accounting of one request (the proto Usage)."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    completion_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    num_steps: int = 0  # engine steps that emitted tokens for this request

    @property
    def tokens_per_step(self) -> float:
        return self.completion_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Deprecated name of tokens_per_step (the proto keeps filling it)."""
        return self.tokens_per_step


@dataclass(frozen=True)
class Update:
    """What one engine step committed for one request. The last one has `finish_reason` set."""

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    usage: RequestUsage  # cumulative, a snapshot
    stop_token_id: int | None = None  # when finish_reason is STOP: the token that stopped it
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StatsSnapshot(SpeculationRatios):
    """The engine's counters and gauges at one moment: the proto EngineStats, field for field (its ratios are
    the properties below; server.stats_to_proto copies every proto field by name)."""

    running_requests: int
    waiting_requests: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_used: int
    kv_blocks_cached: int
    kv_block_size: int
    drafted_tokens: int
    accepted_tokens: int
    emitted_tokens: int
    steps: int
    sequence_steps: int
    draft_rounds: int
    preemptions: int
    proposer_connected: bool
    finished_requests: int
    aborted_requests: int
    stale_drafts: int = 0
    proposer_fallback_steps: int = 0
    invalid_drafts: int = 0
    prefix_cache_query_tokens: int = 0  # prompt tokens of admitted requests
    prefix_cache_hit_tokens: int = 0  # of which served from the prefix cache
    prefix_cache_evictions: int = 0  # cached blocks reused for other content

    @property
    def mean_accepted_length(self) -> float:
        """Deprecated name of tokens_per_step (the proto keeps filling it)."""
        return self.tokens_per_step

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / self.prefix_cache_query_tokens if self.prefix_cache_query_tokens else 0.0


_TICK = object()  # a keep-alive interval passed (EngineLoop.generate)


@dataclass
class _Tracked:
    queue: asyncio.Queue
    usage: RequestUsage


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        proposer: RemoteProposer | None = None,
        max_buffered_updates: int = MAX_BUFFERED_UPDATES,
        step_thread: ThreadPoolExecutor | None = None,
    ) -> None:
        """`step_thread`: the engine's model thread (shared.omp_defaults.model_thread), which already loaded and
        warmed it up; default: a new one."""
        self.max_buffered_updates = max_buffered_updates
        self.grammar_timeout_s = GRAMMAR_TIMEOUT_S
        self._grammar_pool = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="grammar")
        self._step_thread = step_thread or model_thread("engine-step")  # every step on the model's one thread
        self.engine = engine
        self.proposer = proposer
        self._lock = asyncio.Lock()  # held while the engine steps, adds or aborts
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # no request tracked
        self._idle.set()
        self._requests: dict[str, _Tracked] = {}
        self._pending_aborts: set[str] = set()
        # Set (from the event loop) when something waits to change the engine: the step thread ends its run of
        # steps after the current one and hands the engine back.
        self._interrupt = threading.Event()
        self._dispatch_error: BaseException | None = None
        self._claims = 0  # coroutines waiting for the engine between steps (_engine_held): a run keeps _interrupt
        self._accepting = True
        self._stopping = False
        self._task: asyncio.Task | None = None
        self.finished_requests = 0
        self.aborted_requests = 0
        self.dead: BaseException | None = None  # set when the loop itself died
        # Called once if the loop itself dies (a failing step is not that: it fails its requests and the loop
        # goes on). Its requests have failed with UNAVAILABLE by then and new ones are refused.
        self.on_dead: Callable[[BaseException], None] | None = None

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._supervised(), name="engine-loop")

    async def _supervised(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # a bug outside engine.step: nothing would step again, every stream hangs
            log.critical(
                "the engine loop died; failing %d requests with UNAVAILABLE", len(self._requests), exc_info=err
            )
            self.dead = err
            self._accepting = False
            self._fail_all(UnavailableError("this verifier's engine loop stopped; retry on another verifier"))
            if self.on_dead is not None:
                self.on_dead(err)

    def _request_engine(self) -> None:
        """Ask the step thread to end its run of steps after the current step."""
        self._interrupt.set()

    @contextlib.asynccontextmanager
    async def _engine_held(self) -> AsyncIterator[None]:
        """The engine between steps, to change it: the run of steps ends after its current step and none starts
        while this waits (counted in _claims, so _run does not clear the interrupt meant for it)."""
        self._claims += 1
        self._request_engine()
        try:
            await self._lock.acquire()
        finally:
            self._claims -= 1
        try:
            yield
        finally:
            self._lock.release()

    def stop_accepting(self) -> None:
        """New requests get UnavailableError from now on; running ones continue."""
        self._accepting = False

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every request has finished; False if some are still running after timeout_s."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def hand_over_all(self, message: str) -> int:
        """End every request now with UnavailableError(message): their output so far stays valid and the
        caller (the gateway) resumes them elsewhere. An ABORT finish instead would read as the answer's end."""
        async with self._engine_held():
            ids = list(self._requests)
            self._fail_all(UnavailableError(message))
        return len(ids)

    async def stop(self) -> None:
        """Stop the stepping task after the current step (requests should be drained or aborted first)."""
        self._stopping = True
        self._request_engine()
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        self._step_thread.shutdown(wait=False, cancel_futures=True)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ---- requests --------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        max_draft_tokens: int | None = None,
        output_offset: int = 0,
        num_logprobs: int | None = None,
        tenant: str = "",
        keepalive_s: float | None = None,
    ) -> AsyncGenerator[Update | None, None]:
        """Add the request (raising InvalidRequestError / QueueFullError / UnavailableError before the first
        update) and yield its updates until it finishes. Stop iterating (or close) to cancel it. With
        `keepalive_s`, also None after each such interval without an update during which the engine stepped (the
        request waits behind others); a stuck engine steps no more and yields none, so an idle limit still
        catches it."""
        if self.dead is not None:
            raise UnavailableError("this verifier's engine loop stopped; retry on another verifier")
        if not self._accepting or self._stopping:
            raise UnavailableError("the verifier is shutting down; retry on another verifier")
        tracked = _Tracked(asyncio.Queue(), RequestUsage(prompt_tokens=len(prompt_ids)))
        grammar = await self._build_grammar(params, prompt_ids, output_offset)
        async with self._engine_held():
            if not self._accepting or self._stopping:  # shutdown began while this waited for the lock
                raise UnavailableError("the verifier is shutting down; retry on another verifier")
            # raises on bad input or a full queue
            self.engine.add_request(
                request_id, list(prompt_ids), params, max_draft_tokens, output_offset, num_logprobs, tenant, grammar
            )
            self._requests[request_id] = tracked
            self._idle.clear()
        self._wake.set()
        done = False
        loop = asyncio.get_running_loop()
        steps = self.engine.stats.steps
        try:
            while True:
                # A timer that queues a tick, not a task and a wait per update: every running stream reads
                # an update per step, on the event loop, while the next step waits for the GIL.
                timer = loop.call_later(keepalive_s, tracked.queue.put_nowait, _TICK) if keepalive_s else None
                try:
                    item = await tracked.queue.get()
                finally:
                    if timer is not None:
                        timer.cancel()
                if item is _TICK:
                    if self.engine.stats.steps != steps:
                        steps = self.engine.stats.steps
                        yield None
                    continue
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if item.finished:
                    done = True
                yield item
                if done:
                    return
        finally:
            if not done:
                self.abort(request_id)

    async def _build_grammar(
        self, params: SamplingParams, prompt_ids: list[int], output_offset: int
    ) -> GrammarMatcher | None:
        """The request's format matcher, built in the grammar pool while the engine keeps stepping."""
        if params.structured_output is None:
            return None
        work = asyncio.get_running_loop().run_in_executor(
            self._grammar_pool, self.engine.build_grammar, params, list(prompt_ids), output_offset
        )
        try:
            return await asyncio.wait_for(asyncio.shield(work), self.grammar_timeout_s)
        except TimeoutError:
            raise InvalidRequestError(
                f"the output format took longer than {self.grammar_timeout_s:g} s to compile: simplify it"
            ) from None

    def abort(self, request_id: str) -> None:
        """Cancel a request: applied at the next step boundary (its blocks are free before the next step)."""
        if request_id in self._requests:
            self._pending_aborts.add(request_id)
            self._request_engine()
            self._wake.set()

    # ---- the loop --------------------------------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            while not self._stopping:
                async with self._lock:
                    self._apply_aborts()
                    if not self.engine.has_unfinished():
                        break
                    if not self._claims:  # else the run is one step long: those waiting take the lock after it
                        self._interrupt.clear()
                    loop = asyncio.get_running_loop()
                    step_error: Exception | None = None
                    try:
                        await loop.run_in_executor(self._step_thread, self._steps, loop)
                    except Exception as err:
                        step_error = err
                    broken, self._dispatch_error = self._dispatch_error, None
                    if broken is not None:
                        raise broken  # a bug outside engine.step: the loop dies (_supervised)
                    if step_error is not None:
                        log.error(
                            "engine step failed; failing the %d running requests",
                            len(self._requests),
                            exc_info=step_error,
                        )
                        self._fail_all(step_error)
                        continue
                await asyncio.sleep(0)  # let handlers and new requests in between runs of steps

        async with self._lock:
            self._apply_aborts()

    def _steps(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the step thread: step while there is work and nothing waits for the engine, handing each step's
        outputs to the event loop as it goes. Going from one step straight to the next spares each step a
        hand-off through the event loop, and the wake-up of a sleeping thread (in a VM, a halted vCPU woken by
        an interrupt): about 1 ms a step, measured, while the event loop streams the previous step's tokens
        beside the next step."""
        while True:
            outputs = self.engine.step()
            loop.call_soon_threadsafe(self._deliver, outputs)
            if self._interrupt.is_set() or self._stopping or not self.engine.has_unfinished():
                return

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """On the event loop: a step's outputs to their requests. An error here is kept for _run to raise
        (a callback's exception would only be logged by asyncio), and ends the run of steps."""
        if self._dispatch_error is not None:
            return
        try:
            self._dispatch(outputs)
        except BaseException as err:
            self._dispatch_error = err
            self._request_engine()

    def _apply_aborts(self) -> None:
        pending, self._pending_aborts = self._pending_aborts, set()
        for request_id in pending:
            self.engine.abort(request_id)  # a stalled reader's request left self._requests already
            if self._requests.pop(request_id, None) is None:
                continue
            self.aborted_requests += 1
            log.info("request cancelled request_id=%s", request_id)
        self._update_idle()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            tracked = self._requests.get(out.request_id)
            if tracked is None:
                continue  # cancelled while the step ran; the engine already forgot it or will at abort
            if out.error is not None:  # this request failed alone; the engine freed it already
                log.error("request failed request_id=%s: %s", out.request_id, out.error)
                tracked.queue.put_nowait(NumericalError(out.error))
                self._requests.pop(out.request_id)
                self.aborted_requests += 1
                continue
            usage = tracked.usage
            usage.cached_prompt_tokens = out.num_cached_prompt
            usage.completion_tokens += len(out.new_token_ids)
            usage.drafted_tokens += out.num_drafted
            usage.accepted_tokens += out.num_accepted
            usage.num_steps += 1
            if tracked.queue.qsize() >= self.max_buffered_updates and not out.finished:
                self._stalled(out.request_id, tracked)
                continue
            stop_token = out.new_token_ids[-1] if out.finish_reason == FinishReason.STOP and out.new_token_ids else None
            update = Update(
                out.request_id,
                list(out.new_token_ids),
                out.finish_reason,
                dataclasses.replace(usage),
                stop_token,
                out.logprobs,
            )
            tracked.queue.put_nowait(update)
            if out.finished:
                self._requests.pop(out.request_id)
                if out.finish_reason == FinishReason.ABORT:
                    self.aborted_requests += 1
                else:
                    self.finished_requests += 1
        self._update_idle()

    def _stalled(self, request_id: str, tracked: _Tracked) -> None:
        """Its reader fell max_buffered_updates behind: free it now; the reader gets the error after the backlog."""
        log.warning("request's reader stalled request_id=%s buffered_updates=%d", request_id, tracked.queue.qsize())
        self._pending_aborts.add(request_id)  # the engine may be stepping: freed before its next run of steps
        self._request_engine()
        self._requests.pop(request_id, None)
        self.aborted_requests += 1
        tracked.queue.put_nowait(
            ReaderStalledError(
                f"the request was ended: its reader fell {tracked.queue.qsize()} messages behind (stopped reading)"
            )
        )

    def _fail_all(self, err: Exception) -> None:
        for request_id, tracked in list(self._requests.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # the engine is in trouble already; free what we can
                log.exception("abort failed request_id=%s", request_id)
            tracked.queue.put_nowait(err)
            self.aborted_requests += 1
        self._requests.clear()
        self._update_idle()

    def _update_idle(self) -> None:
        if self._requests:
            self._idle.clear()
        else:
            self._idle.set()

    # ---- stats -----------------------------------------------------------------------------------

    def stats(self) -> StatsSnapshot:
        engine = self.engine
        s = engine.stats
        blocks = engine.blocks
        free = blocks.num_free_blocks
        return StatsSnapshot(
            running_requests=len(engine.scheduler.running),
            waiting_requests=len(engine.scheduler.waiting),
            kv_blocks_total=blocks.num_blocks,
            kv_blocks_free=free,
            kv_blocks_used=blocks.num_blocks - free,
            kv_blocks_cached=blocks.num_cached_blocks,
            kv_block_size=blocks.block_size,
            drafted_tokens=s.drafted_tokens,
            accepted_tokens=s.accepted_tokens,
            emitted_tokens=s.emitted_tokens,
            steps=s.steps,
            sequence_steps=s.sequence_steps,
            draft_rounds=s.draft_rounds,
            preemptions=engine.scheduler.num_preemptions,
            proposer_connected=self.proposer is not None and self.proposer.connected,
            finished_requests=self.finished_requests,
            aborted_requests=self.aborted_requests,
            stale_drafts=s.stale_drafts,
            proposer_fallback_steps=self.proposer.fallback_steps if self.proposer is not None else 0,
            invalid_drafts=self.proposer.invalid_drafts if self.proposer is not None else 0,
            prefix_cache_query_tokens=engine.scheduler.prefix_cache.query_tokens,
            prefix_cache_hit_tokens=engine.scheduler.prefix_cache.hit_tokens,
            prefix_cache_evictions=blocks.num_evictions,
        )
