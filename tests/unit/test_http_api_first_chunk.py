"""gateway/http_api.py's wait for a streamed request's first chunk, with a fake core: the generation runs in a task
of its own while the handler waits (keep-alive comments), and whatever ends the handler ends the generation."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request

from gateway import http_api
from gateway.auth import Grant


class QueuedCore:
    """A core whose request waits for its first token until cancelled (queued on a busy verifier)."""

    def __init__(self) -> None:
        self.preparer = type("Preparer", (), {"tokenizer": object()})()
        self.state = "not started"
        self.grant_released = False

    def admit(self, values: Any, peer: str, limits: bool = True) -> Grant:
        grant = Grant()
        grant.hold(lambda: setattr(self, "grant_released", True))
        return grant

    async def generate(self, fields: Any, call: Any, grant: Grant) -> Any:
        self.state = "waiting"
        try:
            await asyncio.sleep(3600)
            yield "id", None, None
        except asyncio.CancelledError:
            self.state = "cancelled"
            raise


def streaming_request() -> Request:
    body = json.dumps({"prompt": "hi", "stream": True}).encode()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays connected
        raise AssertionError("unreachable")

    scope = {
        "type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b"",
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "scheme": "http", "root_path": "", "app": None,
    }  # fmt: skip
    return Request(scope, receive)


def test_a_handler_cancelled_while_its_stream_waits_for_a_first_token_ends_the_generation():
    """uvicorn cancels request tasks at shutdown after its deadline: the generation, waiting in its own task for the
    first token, must end with the handler (its verifier call cancelled), not run on with its grant released."""

    async def scenario() -> None:
        core = QueuedCore()
        api = http_api._Api(core, "m", sse_keepalive_s=15.0)  # type: ignore[arg-type]
        handler = asyncio.ensure_future(api._serve(streaming_request(), http_api.CompletionRequest, chat=False))
        await asyncio.sleep(0.2)
        assert core.state == "waiting"
        handler.cancel()
        await asyncio.gather(handler, return_exceptions=True)
        await asyncio.sleep(0.1)
        assert core.state == "cancelled" and core.grant_released
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    asyncio.run(scenario())


def test_cancelling_the_pending_first_chunk_keeps_the_callers_own_cancellation():
    async def scenario() -> None:
        caller = asyncio.ensure_future(http_api._cancel(asyncio.ensure_future(asyncio.sleep(3600))))
        await asyncio.sleep(0)  # the caller now waits for the cancelled task to end
        caller.cancel()  # and is cancelled itself meanwhile: that must go on, not be swallowed
        (result,) = await asyncio.gather(caller, return_exceptions=True)
        assert isinstance(result, asyncio.CancelledError)
        pending = asyncio.ensure_future(asyncio.sleep(3600))
        await http_api._cancel(pending)  # the pending task's own cancellation is no error of the caller's
        assert pending.cancelled()

    asyncio.run(scenario())
