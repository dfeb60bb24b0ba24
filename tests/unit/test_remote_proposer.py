"""RemoteProposer's stream handling with fake gRPC calls on an event loop of its own (the engine's thread is the
test's): which stream a failure belongs to, replies that cannot come, a write that waits behind another, and the
engine's whole resend on a new stream. The services' own reconnect tests (tests/service) run real proposers."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from shared.drafting import DraftRequest
from verifier_service.remote_proposer import RemoteProposer

VOCAB = 96


class FakeCall:
    """A bidi stream that records what is written and never answers (or, `gated`, holds its first write until
    `gate` is set: HTTP/2 flow control behind a large message)."""

    def __init__(self, name: str, gated: bool = False) -> None:
        self.name, self.written, self.cancelled = name, [], False
        self.held, self.opened = gated, asyncio.Event()
        self.replies: asyncio.Queue = asyncio.Queue()

    async def write(self, message) -> None:
        if self.held:
            self.held = False
            await self.opened.wait()
        self.written.append(message.step_id)

    async def read(self):
        return await self.replies.get()

    def cancel(self) -> None:
        self.cancelled = True


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop

    async def cancel_the_rest() -> None:  # the streams' readers and writes still waiting
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in rest:
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    on_loop(loop, cancel_the_rest())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def on_loop(loop: asyncio.AbstractEventLoop, coro):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(5)


def proposer(loop: asyncio.AbstractEventLoop, timeout_s: float = 2.0) -> RemoteProposer:
    rp = RemoteProposer(["127.0.0.1:1"], vocab_size=VOCAB, timeout_s=timeout_s)

    async def attach() -> None:  # what start() and a connection set, without a server
        rp._loop, rp._loop_thread, rp._lost = loop, threading.get_ident(), asyncio.Event()

    on_loop(loop, attach())
    return rp


def connect(loop: asyncio.AbstractEventLoop, rp: RemoteProposer, name: str, gated: bool = False):
    """A new stream as `_connect_and_hold` sets one up (its reader running), in one turn of the loop."""

    async def up():
        call = FakeCall(name, gated)
        rp._pending, rp._write_lock, rp._late_in_a_row = {}, asyncio.Lock(), 0
        reader = asyncio.ensure_future(rp._read_replies(call))  # type: ignore[arg-type]
        rp._lost.clear()  # type: ignore[union-attr]
        rp._call, rp._connected = call, True  # type: ignore[assignment]
        rp.connections += 1
        return call, reader

    return on_loop(loop, up())


def requests(seq_id: str = "x") -> list[DraftRequest]:
    return [DraftRequest(seq_id, 10, [1], 3)]


def settle() -> None:
    time.sleep(0.05)


def test_an_old_streams_failure_collected_late_leaves_the_new_stream_in_use(loop) -> None:
    rp = proposer(loop)
    old, old_reader = connect(loop, rp, "A")
    sent_on_old = rp.send(requests())
    settle()
    # The old stream goes (the proposer restarted) and a new one is up before the step collects its answer.
    loop.call_soon_threadsafe(old_reader.cancel)
    settle()
    new, new_reader = connect(loop, rp, "B")
    drafts = rp.collect(sent_on_old)
    settle()
    assert drafts[0].needs_resync and drafts[0].unreachable  # this step decodes plainly, the sequence resent
    assert rp.connected and rp._call is new
    assert rp.send(requests()).message is not None  # the next step drafts again
    # The negative control: the current stream's own failure does disconnect, until a new stream is up.
    failing = rp.send(requests())
    settle()
    loop.call_soon_threadsafe(new_reader.cancel)  # as `_connect_and_hold` does on losing it
    assert rp.collect(failing)[0].needs_resync
    settle()
    assert not rp.connected and rp._call is None


def test_a_stream_the_verifier_drops_fails_its_awaited_replies_at_once(loop) -> None:
    rp = proposer(loop, timeout_s=2.0)
    call, reader = connect(loop, rp, "A")
    pending = rp.send(requests())
    settle()
    assert call.written == [pending.message.step_id]
    loop.call_soon_threadsafe(reader.cancel)  # what `_connect_and_hold` does once the stream is lost
    started = time.perf_counter()
    drafts = rp.collect(pending)
    assert time.perf_counter() - started < 1.0  # not the 2 s deadline
    assert drafts[0].needs_resync and drafts[0].unreachable and rp.timeouts == 0


def test_a_message_past_its_deadline_behind_a_large_write_is_still_written(loop) -> None:
    rp = proposer(loop, timeout_s=0.2)
    call, _ = connect(loop, rp, "A", gated=True)
    rp.notify([DraftRequest("y", 50, list(range(40)), 0)])  # a catch-up whose write waits for the proposer
    settle()
    rp.release(["x"])
    late = rp.send(requests("z"))
    drafts = rp.collect(late)  # past the deadline while its write waited for the lock
    assert drafts[0].token_ids == [] and not drafts[0].needs_resync  # the stream keeps this step's tokens...
    assert list(late.message.release_seq_ids) == ["x"]
    loop.call_soon_threadsafe(call.opened.set)
    deadline = time.monotonic() + 2
    while len(call.written) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert call.written == [1, late.message.step_id]  # ...because it was written, after the catch-up, in order
