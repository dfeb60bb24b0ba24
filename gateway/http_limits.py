"""The HTTP port's limits: what --max-request-bytes and --max-concurrent-rpcs give the gRPC port, plus what
HTTP/1.1 adds (connections that send nothing, bodies that trickle in).

- Body: a declared Content-Length over --max-request-bytes is answered 413 before a byte of it is read; a
  body streamed without one (chunked) is counted as it arrives and refused (413) as soon as it passes the limit,
  so the gateway never holds more than the limit of one request's body.
- Requests in flight on the port (everything but /health): --max-concurrent-rpcs; past it 503 with Retry-After.
  (The generation requests of both ports together have their own cap in the core: RESOURCE_EXHAUSTED / 429.)
- Time: a connection must complete a request's headers within --http-read-timeout-s of opening (or of its
  previous response) and its body within as long again, or it is closed (408 for a body); an idle keep-alive
  connection is closed after --http-keep-alive-s. A client that stops reading its reply (the server's send
  buffers full) for --http-write-timeout-s is cut off, as nginx's send_timeout does: the request is cancelled
  and its KV blocks freed, instead of a generation slot held as long as the client keeps the socket open.
- Connections: at most --http-max-connections open; one more is closed at once.

/health is outside the body and request limits (the Kubernetes probes use the gRPC port's health service).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from shared.errors import InvalidRequestError

log = logging.getLogger(__name__)

EXEMPT_PATHS = frozenset({"/health"})
RETRY_AFTER_S = 1
# A body over the limit is read on and discarded (memory stays flat) up to this much more before the 413, so
# that an ordinary client, still sending, reads the answer instead of a reset connection; a larger one is
# answered at once and the connection closed.
DRAIN_BYTES = 1 << 20


class PayloadTooLargeError(InvalidRequestError):
    """A request body over --max-request-bytes: HTTP 413."""

    http_status = 413


class BodyTimeoutError(InvalidRequestError):
    """A request body that did not arrive within --http-read-timeout-s: HTTP 408."""

    http_status = 408


@dataclass(frozen=True)
class HttpLimits:
    max_body_bytes: int
    max_requests: int  # in flight on the port, /health not counted
    max_connections: int
    read_timeout_s: float  # a request's headers, and then its body, must arrive within this
    keep_alive_s: float  # an idle connection between requests
    write_timeout_s: float = 60.0  # a reply the client does not read for this long ends the connection


class LimitsMiddleware:
    """ASGI middleware: the body and in-flight limits (the connection ones are in `guarded_protocol`)."""

    def __init__(self, app: Any, limits: HttpLimits) -> None:
        self.app = app
        self.limits = limits
        self.active = 0
        self.refused: dict[int, int] = {}  # HTTP status -> requests refused here

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in EXEMPT_PATHS:
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limits.max_body_bytes:
            drained = declared <= self.limits.max_body_bytes + DRAIN_BYTES and await drain(
                receive, self.limits.read_timeout_s
            )
            limit = self.limits.max_body_bytes
            await self._refuse(send, 413, f"the request body is {declared} bytes; the limit is {limit}", drained)
            return
        if self.active >= self.limits.max_requests:
            await self._refuse(
                send,
                503,
                f"{self.active} requests are running on this port, its limit; retry in {RETRY_AFTER_S} s",
                keep_alive=False,
            )
            return
        self.active += 1
        try:
            await self.app(scope, BoundedBody(receive, self.limits.max_body_bytes, self.limits.read_timeout_s), send)
        finally:
            self.active -= 1

    async def _refuse(self, send: Any, status: int, message: str, keep_alive: bool) -> None:
        self.refused[status] = self.refused.get(status, 0) + 1
        log.info("event=http_refused status=%d reason=%r", status, message)
        kind = "invalid_request_error" if status == 413 else "service_unavailable_error"
        body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 503:
            headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
        if not keep_alive:  # an unread body stays unread: this connection is done
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def drain(receive: Any, timeout_s: float, budget: int = DRAIN_BYTES) -> bool:
    """Reads and discards the rest of a request body (at most `budget` bytes, within `timeout_s`); whether it
    ended."""
    try:
        async with asyncio.timeout(timeout_s):
            while budget >= 0:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return True
                budget -= len(message.get("body", b""))
    except TimeoutError:
        pass
    return False


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None  # h11 refuses a malformed one before us
    return None


class BoundedBody:
    """The request's `receive`: the body counted (PayloadTooLargeError past the limit) and timed
    (BodyTimeoutError past the deadline); after the body, messages (a disconnect) pass through untimed."""

    def __init__(self, receive: Any, max_bytes: int, timeout_s: float) -> None:
        self._receive = receive
        self._max_bytes = max_bytes
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self.received = 0
        self._body_done = False

    async def __call__(self) -> Any:
        if self._body_done:
            return await self._receive()
        try:
            message = await asyncio.wait_for(self._receive(), max(0.0, self._deadline - time.monotonic()))
        except TimeoutError:
            raise BodyTimeoutError(f"the request body did not arrive within {self._timeout_s:g} s") from None
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self._max_bytes:
                if message.get("more_body", False):
                    await drain(self._receive, max(0.0, self._deadline - time.monotonic()))
                self._body_done = True
                raise PayloadTooLargeError(f"the request body is over the limit of {self._max_bytes} bytes")
            self._body_done = not message.get("more_body", False)
        else:
            self._body_done = True
        return message


@dataclass
class ConnectionStats:
    closed_silent: int = 0  # closed for not sending a request's headers in time
    refused_over_limit: int = 0  # closed at once: --http-max-connections were open
    closed_unread: int = 0  # cut off for not reading the reply for --http-write-timeout-s


def guarded_protocol(
    limits: HttpLimits, stats: ConnectionStats, on_accept: Callable[[], object] | None = None
) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the connection limits. `on_accept` runs for each new connection before its
    TLS handshake (the HTTPS certificate's reload check)."""

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if on_accept is not None:
                on_accept()
            super().__init__(*args, **kwargs)
            self._header_timer: asyncio.TimerHandle | None = None
            self._write_timer: asyncio.TimerHandle | None = None
            self._buffered = 0  # the reply's bytes waiting in the transport when the write timer was armed

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                stats.refused_over_limit += 1
                transport.close()
                return
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a request's headers arrived: the body has its own deadline (BoundedBody)

        def on_response_complete(self) -> None:
            self._arm()  # before: the base class may start a pipelined request, which disarms it
            super().on_response_complete()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._arm_write_timer()

        def _arm_write_timer(self) -> None:
            self._buffered = self.transport.get_write_buffer_size()
            self._write_timer = self.loop.call_later(limits.write_timeout_s, self._unread)

        def resume_writing(self) -> None:
            self._cancel_write_timer()
            super().resume_writing()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._cancel_write_timer()
            super().connection_lost(exc)

        def _cancel_write_timer(self) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _unread(self) -> None:
            self._write_timer = None
            if self.transport.get_write_buffer_size() < self._buffered:
                # It read some, not enough to resume writing: a slow reader, not a stalled one (nginx's
                # send_timeout restarts at every write too). Another full timeout from here.
                self._arm_write_timer()
                return
            # abort, not close: close() waits for the unread buffer to drain, which is what never happens.
            # connection_lost then ends the request as a disconnect does.
            stats.closed_unread += 1
            log.info("event=http_write_timeout client=%s timeout_s=%g", self.client, limits.write_timeout_s)
            self.transport.abort()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(limits.read_timeout_s, self._silent)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _silent(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                stats.closed_silent += 1
                self.transport.close()

    return GuardedH11Protocol
