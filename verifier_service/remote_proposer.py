"""A Drafter that talks to a remote proposer over ONE long-lived bidi `Propose` stream.

The engine calls `propose` / `release` synchronously from its worker thread; the stream lives on the
service's event loop (grpc.aio), reached with `asyncio.run_coroutine_threadsafe`. Every round trip has a
deadline: past it the step gets empty drafts (k = 0, plain decoding) and the stream stays: the proposer
still applies that message in order, and its late reply is discarded by step id, so no state is lost.
Only an error, or MAX_LATE_REPLIES late replies in a row (a proposer that cannot keep up), drops the
stream; a background task then reconnects with exponential backoff, trying the configured addresses in
turn. A new stream holds no state, so fallback drafts then ask the engine to resend each sequence in full
(`needs_resync`). No request ever fails because a proposer did.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from shared.draft_codec import DEFAULT_MAX_DRAFT_SUPPORT, unpack_draft
from shared.drafting import Draft, DraftRequest
from shared.feature_codec import features_to_proto
from shared.grpc_server import CHANNEL_OPTIONS
from shared.placement import shares_cores
from shared.proto_convert import sampling_params_to_proto
from shared.proto_gen.specdec.v1 import proposer_pb2, proposer_pb2_grpc
from shared.telemetry import inject_context
from shared.tls import ClientTLS, aio_channel

log = logging.getLogger("specdec.verifier.proposer")


class IncompatibleProposerError(Exception):
    """The proposer drafts in another vocabulary: its token ids would be wrong for the target."""


MAX_LATE_REPLIES = 8  # in a row: past that the proposer cannot keep up and its backlog only grows: drop the stream


@dataclass(frozen=True)
class RoundTrip:
    """The last propose call as the verifier saw it (read by telemetry after the propose phase)."""

    seconds: float  # send to answer, as measured by the verifier
    draft_seconds: float  # what the proposer reports it spent on the message (0: unknown)
    fallback: bool  # answered without the proposer: k = 0 for this step
    invalid: tuple[tuple[str, str], ...] = ()  # (seq_id, why) of each draft discarded as invalid
    waited: float = 0.0  # of `seconds`, the time the verifier waited for it (less when it asked early)

    @property
    def network_seconds(self) -> float:
        return max(0.0, self.seconds - self.draft_seconds) if not self.fallback else 0.0


@dataclass
class PendingDrafts:
    """A sent propose request (RemoteProposer.send); without a message nothing was sent (no stream)."""

    requests: list[DraftRequest]
    message: proposer_pb2.ProposeRequest | None = None
    call: grpc.aio.StreamStreamCall | None = None
    loop: asyncio.AbstractEventLoop | None = None
    sent: float = 0.0
    future: concurrent.futures.Future | None = None
    answered: float = 0.0  # when the reply arrived (perf_counter), 0 until then

    def note_answer(self, future: concurrent.futures.Future) -> None:
        self.answered = time.perf_counter()


def requested_layers(info: proposer_pb2.GetInfoResponse) -> tuple[int, ...]:
    """The target layers a proposer's head reads; none listed: the final normed state (an EAGLE-1 head)."""
    return tuple(info.target_feature_layers) or (-1,)


class RemoteProposer:
    """Drafter protocol over gRPC. Create and `start()` on the event loop that serves; call `propose` and
    `release` from any other thread (the engine's worker thread)."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        vocab_size: int,
        hidden_size: int = 0,
        feature_layers: tuple[int, ...] = (-1,),
        tokenizer_fingerprint: str = "",
        timeout_s: float = 2.0,
        reconnect_initial_s: float = 0.05,
        reconnect_max_s: float = 10.0,
        tls: ClientTLS | None = None,
        max_draft_support: int = DEFAULT_MAX_DRAFT_SUPPORT,
        max_tree_nodes: int = 0,
        target_on_cpu: bool = True,
    ) -> None:
        if not addresses:
            raise ValueError("RemoteProposer needs at least one address")
        self.addresses = list(addresses)
        self.vocab_size = vocab_size
        # The widest draft distribution per position accepted, stated to the proposer at each handshake.
        self.max_draft_support = min(max_draft_support, vocab_size)
        self.hidden_size = hidden_size
        # Once a proposer asked for the target's features the engine keeps them, also while reconnecting,
        # so a sequence resent in full after a reconnect carries them all.
        self.needs_target_features = False
        self.capturable_layers = tuple(feature_layers)  # what this verifier may capture (--feature-layers)
        # What the engine keeps and sends: the connected proposer's layers, in its order.
        self.feature_layers: tuple[int, ...] = (-1,)
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.timeout_s = timeout_s
        self.reconnect_initial_s = reconnect_initial_s
        self.reconnect_max_s = reconnect_max_s
        self.tls = tls  # read at each connection: a reconnect presents a rotated client certificate
        self.max_tree_nodes = max_tree_nodes  # stated at the handshake; each sequence's bound travels with it
        self.target_on_cpu = target_on_cpu
        # Whether the engine has the proposer follow sequences that decode with k = 0 (`notify`): not where the
        # proposer shares this verifier's CPU cores (shared/placement.py), set at each handshake.
        self.follows_plain = True
        self.info: proposer_pb2.GetInfoResponse | None = None
        self.address: str | None = None  # the proposer in use
        # counters (read by stats)
        self.fallback_steps = 0  # propose calls answered without the proposer (k = 0 for that step)
        self.timeouts = 0
        self.errors = 0
        self.invalid_drafts = 0
        # Draft tokens in every reply read, used or not (early drafts no step took, late replies, drafts cut
        # to the scheduled length): the proposer's own count of tokens drafted equals it.
        self.received_draft_tokens = 0
        self.connections = 0
        self.last_round_trip: RoundTrip | None = None
        self._connected = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        self._lost: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self._step_ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}  # step id -> its reply (event loop only)
        self._write_lock: asyncio.Lock | None = None
        self._late_in_a_row = 0
        self._releases: list[str] = []
        self._release_lock = threading.Lock()

    # ---- lifecycle (event loop) ------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._connected

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._lost = asyncio.Event()
        self._task = asyncio.create_task(self._maintain(), name="remote-proposer")

    async def wait_connected(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self._connected and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self._connected

    async def close(self) -> None:
        self._closed = True
        self._connected = False
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _maintain(self) -> None:
        backoff = self.reconnect_initial_s
        for attempt in itertools.count():
            if self._closed:
                return
            address = self.addresses[attempt % len(self.addresses)]
            up_since = None
            try:
                up_since = await self._connect_and_hold(address)
            except IncompatibleProposerError as err:
                log.error("proposer refused address=%s: %s; decoding with k = 0", address, err)
                backoff = self.reconnect_max_s
            except Exception as err:  # unreachable, refused, reset: never fatal, always retried
                detail = err.details() if isinstance(err, grpc.aio.AioRpcError) else f"{type(err).__name__}: {err}"
                log.warning("proposer unreachable address=%s error=%s retry_in_s=%.2f", address, detail, backoff)
            if up_since is not None and time.monotonic() - up_since > 5.0:
                backoff = self.reconnect_initial_s  # it was up for a while: a fresh failure, retry fast
            if self._closed:
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.reconnect_max_s)

    async def _connect_and_hold(self, address: str) -> float | None:
        """Open a channel and the stream; return (after it is lost) when it was established, if it was."""
        assert self._lost is not None
        channel = aio_channel(address, self.tls, CHANNEL_OPTIONS)
        call = None
        try:
            stub = proposer_pb2_grpc.ProposerStub(channel)
            handshake = proposer_pb2.GetInfoRequest(
                max_tree_nodes=self.max_tree_nodes, max_draft_support=self.max_draft_support
            )
            info = await stub.GetInfo(handshake, timeout=max(self.timeout_s, 1.0))
            self._check_compatible(info)
            self.needs_target_features = self.needs_target_features or info.needs_target_features
            if info.needs_target_features:
                self.feature_layers = requested_layers(info)
            shared_cores = self.target_on_cpu and shares_cores(info.host_id, info.cpus)
            self.follows_plain = not shared_cores
            call = stub.Propose()
            self._pending = {}
            self._write_lock = asyncio.Lock()
            self._late_in_a_row = 0
            reader = asyncio.create_task(self._read_replies(call), name="proposer-replies")
            self._lost.clear()
            self.info, self.address, self._call = info, address, call
            with self._release_lock:
                self._releases.clear()  # a new stream starts clean: nothing to release there
            self._connected = True
            self.connections += 1
            call.add_done_callback(lambda c: self._drop(c, "stream ended"))
            log.info(
                "proposer connected address=%s kind=%s model=%s vocab_size=%d max_k=%d shares_cores=%s%s",
                address,
                proposer_pb2.ProposerKind.Name(info.kind),
                info.model,
                info.vocab_size,
                info.max_k,
                shared_cores,
                " (sequences decoding with k = 0 are not followed: a draft request carries their catch-up)"
                if shared_cores
                else "",
            )
            up_since = time.monotonic()
            await self._lost.wait()
            reader.cancel()
            return up_since
        finally:
            self._connected = False
            if self._call is call:
                self._call = None
            if call is not None:
                call.cancel()
            await channel.close()

    def _check_compatible(self, info: proposer_pb2.GetInfoResponse) -> None:
        if info.vocab_size and info.vocab_size != self.vocab_size:
            raise IncompatibleProposerError(
                f"its draft vocabulary has {info.vocab_size} ids but the target's has {self.vocab_size}: "
                "speculative decoding needs a draft model that shares the target's tokenizer"
            )
        if info.needs_target_features and info.target_hidden_size != self.hidden_size:
            raise IncompatibleProposerError(
                f"its head reads features of size {info.target_hidden_size} but the target's hidden size is "
                f"{self.hidden_size}: the head was trained for another target"
            )
        missing = [i for i in requested_layers(info) if i not in self.capturable_layers]
        if info.needs_target_features and missing:
            raise IncompatibleProposerError(
                f"its head reads target layers {list(requested_layers(info))}, but this verifier captures only "
                f"{list(self.capturable_layers)} (--feature-layers), not {missing}: start the verifier with "
                "--feature-layers listing them, or serve a head trained on these layers"
            )
        fingerprints = (info.tokenizer_fingerprint, self.tokenizer_fingerprint)
        if all(fingerprints) and fingerprints[0] != fingerprints[1]:
            raise IncompatibleProposerError(
                f"its tokenizer fingerprint {info.tokenizer_fingerprint} differs from the target's "
                f"{self.tokenizer_fingerprint}: the vocabularies are not the same"
            )

    def _drop(self, call: grpc.aio.StreamStreamCall, reason: str) -> None:
        """On the event loop: forget the stream (if still current) and wake the reconnecting task. A failure of an
        older stream, collected after a new one came up, leaves the new one in use: `_lose` may have marked the
        proposer disconnected from the engine's thread meanwhile, and the new stream is connected (its call is
        set with the flag, on this loop)."""
        if call is not self._call or call is None:
            if call is not None and self._call is not None and not self._closed:
                self._connected = True
            return
        if self._connected and not self._closed:
            log.warning(
                "proposer stream lost address=%s reason=%s; decoding with k = 0 until it is back", self.address, reason
            )
        self._connected = False
        self._call = None
        call.cancel()
        if self._lost is not None:
            self._lost.set()

    # ---- Drafter protocol (worker thread) --------------------------------------------------------

    def release(self, seq_ids: list[str]) -> None:
        if not seq_ids:
            return
        with self._release_lock:
            self._releases.extend(seq_ids)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return self.collect(self.send(requests))

    def send(self, requests: list[DraftRequest]) -> PendingDrafts:
        """Send a propose request and return at once; `collect` waits for its drafts (the engine asks for the next
        step's drafts this way as soon as a step committed its tokens)."""
        call, loop = self._call, self._loop
        if not requests or not self._connected or call is None or loop is None:
            return PendingDrafts(requests)
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError("RemoteProposer.propose must not run on the event loop thread (it would deadlock)")
        message = self._build_request(requests)
        inject_context(message.trace_context)  # type: ignore[arg-type]
        pending = PendingDrafts(requests, message, call, loop, time.perf_counter())
        pending.future = asyncio.run_coroutine_threadsafe(self._exchange(call, message), loop)
        pending.future.add_done_callback(pending.note_answer)
        return pending

    def collect(self, pending: PendingDrafts) -> list[Draft]:
        """The drafts of a sent request, waiting at most what is left of the deadline since it was sent."""
        requests, future, call, loop = pending.requests, pending.future, pending.call, pending.loop
        if not requests:
            return []
        if future is None or call is None or loop is None or pending.message is None:
            return self._fallback(requests)
        waited = time.perf_counter()
        try:
            response = future.result(max(0.0, self.timeout_s - (waited - pending.sent)))
            answered = pending.answered or time.perf_counter()
            self.last_round_trip = RoundTrip(
                answered - pending.sent, response.draft_time_us / 1e6, False, waited=time.perf_counter() - waited
            )
            self._late_in_a_row = 0
        except concurrent.futures.TimeoutError:
            future.cancel()  # stops waiting; the message is still written (`_exchange`) and applied in order
            self.timeouts += 1
            self._late_in_a_row += 1
            if self._late_in_a_row >= MAX_LATE_REPLIES:
                self._lose(
                    call, loop, f"{self._late_in_a_row} answers in a row later than {self.timeout_s * 1000:.0f} ms"
                )
                return self._fallback(requests)
            return self._fallback(requests, resync=False)
        except Exception as err:  # grpc.aio.AioRpcError, EOF, protocol errors, a cancelled future
            self.errors += 1
            detail = err.details() if isinstance(err, grpc.aio.AioRpcError) else f"{type(err).__name__}: {err}"
            self._lose(call, loop, detail)
            return self._fallback(requests)
        return self._unpack(requests, pending.message, response, call, loop)

    def notify(self, requests: list[DraftRequest]) -> None:
        """Send sequences' committed tokens (k = 0) without waiting for the answer: the proposer follows them off
        the verifier's critical path. It applies the message in order, before the next one; its empty reply is
        dropped. Without a stream nothing is sent, and the next call resends what is missing (needs_resync)."""
        call, loop = self._call, self._loop
        if not requests or not self._connected or call is None or loop is None:
            return
        message = self._build_request(requests)
        future = asyncio.run_coroutine_threadsafe(self._exchange(call, message), loop)
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # an error surfaces on the next call

    def _lose(self, call: grpc.aio.StreamStreamCall, loop: asyncio.AbstractEventLoop, reason: str) -> None:
        if self._connected and call is self._call:
            log.warning(
                "proposer round trip failed address=%s reason=%s; this step decodes with k = 0", self.address, reason
            )
        if call is self._call:  # an older stream's failure says nothing of the current one
            self._connected = False  # at once, so the next step does not use the stream
        loop.call_soon_threadsafe(self._drop, call, reason)

    def _fallback(self, requests: list[DraftRequest], resync: bool = True) -> list[Draft]:
        """No drafts this step. `resync`: the proposer's view of each sequence is unknown (a new stream will
        hold nothing), so resend it in full; without it the stream stays and the proposer has this step's
        tokens."""
        self.fallback_steps += 1
        self.last_round_trip = RoundTrip(0.0, 0.0, True)
        return [Draft(r.seq_id, r.committed_len, [], needs_resync=resync, unreachable=True) for r in requests]

    def _build_request(self, requests: list[DraftRequest]) -> proposer_pb2.ProposeRequest:
        with self._release_lock:
            releases, self._releases = self._releases, []
        info = self.info
        sequences = []
        for r in requests:
            k = r.k
            if info is not None:
                if info.max_k:
                    k = min(k, info.max_k)
                if info.max_model_len:
                    k = min(k, max(0, info.max_model_len - r.committed_len))
            sequence = proposer_pb2.ProposeSequence(
                seq_id=r.seq_id,
                committed_len=r.committed_len,
                new_token_ids=r.new_token_ids,
                full_sequence=len(r.new_token_ids) == r.committed_len,
                k=max(0, k),
                sampling_params=sampling_params_to_proto(r.params),
                draft_position=r.draft_position,
                tenant=r.tenant,
                max_tree_nodes=r.max_tree_nodes,
                min_tree_node_prob=r.min_node_prob if r.max_tree_nodes else 0.0,
            )
            if r.features is not None and info is not None and info.needs_target_features:
                sequence.target_features.CopyFrom(features_to_proto(r.feature_start, r.features, info.feature_dtype))
            sequences.append(sequence)
        return proposer_pb2.ProposeRequest(step_id=next(self._step_ids), sequences=sequences, release_seq_ids=releases)

    async def _exchange(
        self, call: grpc.aio.StreamStreamCall, message: proposer_pb2.ProposeRequest
    ) -> proposer_pb2.ProposeResponse:
        """Send `message` and wait for the reply with its step id (cancelled by the caller past its deadline;
        the reader then discards that reply when it comes)."""
        assert self._write_lock is not None
        reply: asyncio.Future = asyncio.get_running_loop().create_future()
        pending = self._pending  # this stream's: the reader fails what is left in it when the stream goes
        pending[message.step_id] = reply
        lock = self._write_lock

        async def write() -> None:
            async with lock:  # one write at a time, also while an abandoned one still flushes
                await call.write(message)

        try:
            # Shielded: a caller past its deadline stops waiting, but the message is still written, in order, so
            # the proposer has its tokens and releases as `collect` assumes (a cancel that came while the write
            # waited for the lock behind a large one had dropped the message unsent).
            written = asyncio.ensure_future(write())
            written.add_done_callback(lambda task: task.cancelled() or task.exception())  # shown to no one else
            await asyncio.shield(written)
            return await reply
        finally:
            pending.pop(message.step_id, None)

    async def _read_replies(self, call: grpc.aio.StreamStreamCall) -> None:
        """The stream's one reader: each reply goes to the call waiting for its step id; late ones are dropped.
        When the stream goes, every reply still awaited on it fails at once, also where this verifier dropped the
        stream itself (a malformed reply, too many late ones: the reader is cancelled), so that no step waits out
        its deadline for a reply that cannot come, and its drafts are resent whole on the next stream."""
        pending = self._pending
        try:
            while (response := await call.read()) is not grpc.aio.EOF:
                assert isinstance(response, proposer_pb2.ProposeResponse)
                self.received_draft_tokens += sum(len(d.draft_token_ids) for d in response.drafts)
                reply = pending.pop(response.step_id, None)
                if reply is not None and not reply.done():
                    reply.set_result(response)
            failure: Exception = ConnectionError("the proposer closed the stream")
        except asyncio.CancelledError:
            _fail_all(pending, ConnectionError("the stream was dropped"))
            raise
        except Exception as err:  # grpc.aio.AioRpcError and the like: the stream is gone
            failure = err
        _fail_all(pending, failure)
        self._drop(call, str(failure))

    def _unpack(
        self,
        requests: list[DraftRequest],
        message: proposer_pb2.ProposeRequest,
        response: proposer_pb2.ProposeResponse,
        call: grpc.aio.StreamStreamCall,
        loop: asyncio.AbstractEventLoop,
    ) -> list[Draft]:
        if len(response.drafts) != len(requests):
            self.errors += 1
            self._lose(call, loop, f"{len(response.drafts)} drafts for {len(requests)} sequences")
            return self._fallback(requests)
        drafts, invalid = [], []
        for req, sent, msg in zip(requests, message.sequences, response.drafts, strict=True):
            try:
                draft = unpack_draft(
                    msg, self.vocab_size, sent.k, sent.max_tree_nodes, max_support=self.max_draft_support
                )
            except ValueError as err:  # k = 0 for this sequence this step; never an exception, never a token
                self.invalid_drafts += 1
                invalid.append((req.seq_id, str(err)))
                log.warning("invalid draft discarded seq_id=%s: %s", req.seq_id, err)
                draft = Draft(req.seq_id, req.committed_len, [], needs_resync=True)
            drafts.append(draft)
        if invalid and self.last_round_trip is not None:
            self.last_round_trip = dataclasses.replace(self.last_round_trip, invalid=tuple(invalid))
        return drafts


def _fail_all(pending: dict[int, asyncio.Future], failure: Exception) -> None:
    for reply in pending.values():
        if not reply.done():
            reply.set_exception(failure)
