"""The OpenAI-compatible HTTP front end (FastAPI) of the gateway core: the same generation path as gRPC.

    POST /v1/completions        prompt (text or token ids) -> text; SSE with "stream": true
    POST /v1/chat/completions   messages -> assistant message, rendered with the model's chat template
    GET  /v1/models             the served model
    GET  /health                200 while at least one verifier is healthy, else 503

Each request is admitted by the core (the `Authorization: Bearer <key>` header, as on gRPC), validated,
and run by `GatewayCore.generate`; its chunks become OpenAI JSON or SSE events (`data: {...}` lines, then
`data: [DONE]`; a request still waiting for its first token after --http-sse-keepalive-s gets its stream
started with `: keep-alive` comments meanwhile). Errors are OpenAI's shape,
{"error": {"message", "type", "param", "code"}}, with the status of shared/errors.py's mapping. A client that
disconnects cancels the request: its verifier call is cancelled and the verifier frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.auth import Grant
from gateway.core import Final, GatewayCore
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from gateway.output import Chunk
from gateway.prepare import RequestFields
from gateway.token_text import TokenText
from gateway.verifier_client import VerifierError, status_of
from shared.errors import (
    InvalidRequestError,
    NotFoundError,
    SpecdecError,
    UnavailableError,
    grpc_trailing_metadata_for,
    http_status_for_grpc_code,
)
from shared.logprobs import TokenLogprob
from shared.proto_gen.specdec.v1 import common_pb2

log = logging.getLogger(__name__)

FINISH_NAMES: dict[int, str] = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",  # no OpenAI value; vLLM's name for it
}


@dataclass
class HttpCall:
    """The core's ClientCall for one HTTP request: no deadline; done once the client left or the reply ended."""

    _done: bool = False
    _callbacks: list[Callable[[Any], object]] = field(default_factory=list)

    def time_remaining(self) -> float | None:
        return None

    def done(self) -> bool:
        return self._done

    def add_done_callback(self, callback: Callable[[Any], object]) -> None:
        self._callbacks.append(callback)

    def close(self) -> None:
        if not self._done:
            self._done = True
            for callback in self._callbacks:
                callback(self)


def error_response(err: Exception) -> JSONResponse:
    code, message = status_of(err)
    status, kind = http_status_for_grpc_code(code.name)
    status = getattr(err, "http_status", status)  # an HTTP-only error (http_limits.py: 413, 408)
    headers = dict(grpc_trailing_metadata_for(err))  # retry-after
    body = {"error": {"message": message, "type": kind, "param": None, "code": _error_code(err, code.name)}}
    return JSONResponse(body, status_code=status, headers={k.title(): v for k, v in headers.items()})


def _error_code(err: Exception, code_name: str) -> str | None:
    if isinstance(err, NotFoundError):
        return "model_not_found"
    if code_name == "UNAUTHENTICATED":
        return "invalid_api_key"
    if code_name == "RESOURCE_EXHAUSTED":
        return "rate_limit_exceeded"
    return None


def make_app(core: GatewayCore, model_name: str, sse_keepalive_s: float = 0.0) -> FastAPI:
    app = FastAPI(title="specdec OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    api = _Api(core, model_name, sse_keepalive_s)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = {"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("event=http_internal_error path=%s", request.url.path)
        return error_response(exc)  # a generic message (shared/errors.py): the details are in the log

    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/health", api.health, methods=["GET"])
    return app


class _Api:
    def __init__(self, core: GatewayCore, model_name: str, sse_keepalive_s: float = 0.0) -> None:
        self.core = core
        self.model_name = model_name
        self.sse_keepalive_s = sse_keepalive_s
        self.tokens = TokenText(core.preparer.tokenizer)

    # -- endpoints ---------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Any:
        return await self._serve(request, CompletionRequest, chat=False)

    async def chat_completions(self, request: Request) -> Any:
        return await self._serve(request, ChatCompletionRequest, chat=True)

    async def models(self, request: Request) -> Any:
        try:
            self._admit(request, limits=False)
        except SpecdecError as err:
            return error_response(err)
        entry = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "specdec"}
        limit = self.core.router.context_limit()
        if limit:
            entry["max_model_len"] = limit
        return {"object": "list", "data": [entry]}

    async def health(self) -> Any:
        if not self.core.pool.healthy_count():
            return error_response(UnavailableError("no verifier is healthy: requests would fail now"))
        return {"status": "ok"}

    # -- one request -------------------------------------------------------------------------------

    async def _serve(self, request: Request, schema: type[Any], chat: bool) -> Any:
        try:
            grant = self._admit(request)  # before any work, as on gRPC
        except SpecdecError as err:
            return error_response(err)
        with contextlib.ExitStack() as stack:
            stack.callback(grant.release)
            try:
                body = await _parse(request, schema)
                if body.model is not None and body.model != self.model_name:
                    raise NotFoundError(f"the model {body.model!r} does not exist; this server has {self.model_name!r}")
                fields = body.to_fields()
            except SpecdecError as err:
                return error_response(err)
            reply = _Reply(self, body, fields, chat)
            call = HttpCall()
            parts = self.core.generate(fields, call, grant)
            if body.stream:
                # The first chunk: a request refused before any token gets its HTTP status, unless it waited so
                # long for it that the stream started with keep-alive comments (then an error event).
                pending = asyncio.ensure_future(_next(parts))
                try:
                    first = await _watch_disconnect(request, call, _first_chunk(pending, self.sse_keepalive_s))
                except (SpecdecError, VerifierError, _ClientGone) as err:
                    call.close()
                    await _cancel(pending)
                    await parts.aclose()
                    return error_response(err) if not isinstance(err, _ClientGone) else JSONResponse({}, 499)
                except BaseException:  # this handler cancelled (a shutdown's deadline): nothing else ends `pending`
                    call.close()
                    pending.cancel()  # the generator ends with it
                    raise
                stack.pop_all()  # the stream now owns the grant
                waiting = pending if first is _WAITING else None
                events = reply.sse(None if first in (_WAITING, _END) else first, parts, call, grant, waiting)

                async def close() -> None:
                    await events.aclose()
                    call.close()
                    await _cancel(pending)
                    await parts.aclose()
                    grant.release()

                return _SseResponse(events, close)
            try:
                return await _watch_disconnect(request, call, reply.whole(parts))
            except (SpecdecError, VerifierError) as err:
                return error_response(err)
            except _ClientGone:
                return JSONResponse({}, status_code=499)  # nobody reads it
            finally:
                call.close()
                await parts.aclose()

    def _admit(self, request: Request, limits: bool = True) -> Grant:
        values = request.headers.getlist("authorization")
        peer = f"{request.client.host}:{request.client.port}" if request.client else ""
        return self.core.admit(values, peer, limits)


async def _parse(request: Request, schema: type[Any]) -> Any:
    try:
        raw = await request.body()
        return schema.model_validate_json(raw)
    except pydantic.ValidationError as err:
        errors = err.errors()
        where = ".".join(str(p) for p in errors[0]["loc"]) if errors else ""
        message = errors[0]["msg"] if errors else str(err)
        raise InvalidRequestError(f"invalid request body: {where}: {message}" if where else message) from None


class _SseResponse(StreamingResponse):
    """Server-sent events whose request is always closed when the response ends, however it ends: Starlette
    leaves a body iterator that a disconnect interrupted (or that never started) to the garbage collector,
    and with it the verifier call and the KV blocks it holds."""

    def __init__(self, events: AsyncIterator[str], close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._close = close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


class _ClientGone(Exception):
    """The HTTP client disconnected before its reply was ready."""


_END = object()  # the core's generator ended
_WAITING = object()  # no first chunk yet: the stream starts with keep-alive comments


async def _next(parts: AsyncGenerator[Any, None]) -> Any:
    try:
        return await parts.__anext__()
    except StopAsyncIteration:
        return _END


async def _first_chunk(pending: asyncio.Future[Any], keepalive_s: float) -> Any:
    """The first chunk, or _WAITING once `keepalive_s` passed without one (0: wait as long as it takes)."""
    done, _ = await asyncio.wait({pending}, timeout=keepalive_s or None)
    return pending.result() if done else _WAITING


async def _cancel(task: asyncio.Future[Any]) -> None:
    """A pending `_next` must end before its generator can be closed. Its own result or error no longer matters;
    a cancellation of the caller itself goes on."""
    if not task.done():
        task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
    except Exception:  # noqa: S110 (the request is over: what it would have said goes nowhere)
        pass


async def _watch_disconnect(request: Request, call: HttpCall, work: Any) -> Any:
    """Runs `work`; a client that disconnects meanwhile cancels it (Starlette does not for plain responses)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        call.close()  # the client left: the core cancels its verifier call
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise _ClientGone()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


class _Reply:
    """Builds one request's OpenAI JSON (whole or as SSE events) from the core's chunks."""

    def __init__(self, api: _Api, body: Any, fields: RequestFields, chat: bool) -> None:
        self.api = api
        self.body = body
        self.fields = fields
        self.chat = chat
        self.created = int(time.time())
        self.text_offset = 0  # completions logprobs: where each token's text starts
        self.id = ""

    # -- whole -------------------------------------------------------------------------------------

    async def whole(self, parts: AsyncGenerator[tuple[str, Chunk, Final | None], None]) -> dict[str, Any]:
        text: list[str] = []
        logprobs: list[TokenLogprob] = []
        token_ids: list[int] = []
        final: Final | None = None
        async for request_id, chunk, last in parts:
            self.id = request_id
            text.append(chunk.text)
            token_ids += chunk.token_ids
            logprobs += chunk.logprobs or []
            final = last if last is not None else final
        assert final is not None, "the core ends every request with a final chunk"
        choice: dict[str, Any] = {"index": 0, "finish_reason": FINISH_NAMES[final.finish_reason]}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
            choice["logprobs"] = self._chat_logprobs(logprobs) if self.fields.logprobs else None
        else:
            choice["text"] = "".join(text)
            choice["logprobs"] = self._completion_logprobs(logprobs) if self.fields.logprobs else None
        if self.body.return_token_ids:
            choice["token_ids"] = token_ids
        if final.stop_string is not None:
            choice["stop_reason"] = final.stop_string  # vLLM's field: which stop matched
        elif final.stop_token_id is not None:
            choice["stop_reason"] = final.stop_token_id
        return {**self._envelope(chunk=False), "choices": [choice], "usage": usage_json(final.usage)}

    # -- streamed ----------------------------------------------------------------------------------

    async def sse(
        self,
        first: tuple[str, Chunk, Final | None] | None,
        parts: AsyncGenerator[tuple[str, Chunk, Final | None], None],
        call: HttpCall,
        grant: Grant,
        waiting: asyncio.Future[Any] | None = None,
    ) -> AsyncGenerator[str, None]:
        """SSE events; Starlette cancels this generator when the client disconnects, which ends the request.
        `waiting`: the first chunk, still to come: a comment now and every keep-alive interval until it does."""
        try:
            try:
                if waiting is not None:
                    yield ": keep-alive\n\n"
                    while not (await asyncio.wait({waiting}, timeout=self.api.sse_keepalive_s))[0]:
                        yield ": keep-alive\n\n"
                    first = waiting.result()  # raises a refusal: the error event below
                    first = None if first is _END else first
                if first is not None:
                    self.id = first[0]
                    if self.chat:  # OpenAI's first chat chunk carries the role
                        yield self._event(self._chat_choice({"role": "assistant", "content": ""}, None, None))
                    async for event in self._chunk_events(*first):
                        yield event
                async for request_id, chunk, final in parts:
                    self.id = request_id
                    async for event in self._chunk_events(request_id, chunk, final):
                        yield event
            except (SpecdecError, VerifierError) as err:  # after the 200 went out: an error event, then the end
                code, message = status_of(err)
                status, kind = http_status_for_grpc_code(code.name)
                yield _data({"error": {"message": message, "type": kind, "param": None, "code": status}})
            yield "data: [DONE]\n\n"
        finally:
            if waiting is not None:
                await _cancel(waiting)
            call.close()
            await parts.aclose()
            grant.release()

    async def _chunk_events(self, request_id: str, chunk: Chunk, final: Final | None) -> AsyncIterator[str]:
        finish = FINISH_NAMES[final.finish_reason] if final is not None else None
        if chunk.token_ids or chunk.text or final is not None:
            logprobs = None
            if self.fields.logprobs:
                entries = chunk.logprobs or []
                logprobs = self._chat_logprobs(entries) if self.chat else self._completion_logprobs(entries)
            if self.chat:
                delta = {"content": chunk.text} if chunk.text or final is None else {}
                choice = self._chat_choice(delta, logprobs, finish)
            else:
                choice = {"index": 0, "text": chunk.text, "logprobs": logprobs, "finish_reason": finish}
            if self.body.return_token_ids:
                choice["token_ids"] = chunk.token_ids
            yield self._event(choice)
        if final is not None and self.body.include_usage:
            yield _data({**self._envelope(chunk=True), "choices": [], "usage": usage_json(final.usage)})

    def _chat_choice(self, delta: dict[str, Any], logprobs: Any, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def _event(self, choice: dict[str, Any]) -> str:
        payload = {**self._envelope(chunk=True), "choices": [choice]}
        if self.body.include_usage:
            payload["usage"] = None  # OpenAI: null on every chunk but the last one
        return _data(payload)

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        if self.chat:
            obj, prefix = ("chat.completion.chunk" if chunk else "chat.completion"), "chatcmpl-"
        else:
            obj, prefix = "text_completion", "cmpl-"
        return {"id": prefix + self.id, "object": obj, "created": self.created, "model": self.api.model_name}

    # -- logprobs ----------------------------------------------------------------------------------

    def _chat_logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        tokens = self.api.tokens
        return {
            "content": [
                {
                    "token": tokens.text(e.token_id),
                    "logprob": e.logprob,
                    "bytes": tokens.bytes(e.token_id),
                    "top_logprobs": [
                        {"token": tokens.text(t), "logprob": v, "bytes": tokens.bytes(t)}
                        for t, v in zip(e.top_ids, e.top_logprobs, strict=True)
                    ],
                }
                for e in entries
            ]
        }

    def _completion_logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        text = self.api.tokens.text
        tokens, offsets, tops = [], [], []
        for e in entries:
            token = text(e.token_id)
            tokens.append(token)
            offsets.append(self.text_offset)
            self.text_offset += len(token)
            tops.append({text(t): v for t, v in zip(e.top_ids, e.top_logprobs, strict=True)})
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def usage_json(usage: common_pb2.Usage) -> dict[str, Any]:
    """OpenAI's usage plus our speculative counters (drafted, accepted) as extra fields."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
        "drafted_tokens": usage.drafted_tokens,
        "accepted_tokens": usage.accepted_tokens,
    }


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
