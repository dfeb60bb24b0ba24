"""Domain errors, and the one place that maps them to gRPC status codes.

Service cores raise these (they never import grpc); servicers call `grpc_status_for`.
"""

from __future__ import annotations

from typing import Any


class SpecdecError(Exception):
    """Base class; the message is shown to the client as is, so write it for a person."""


class InvalidRequestError(SpecdecError, ValueError):
    """Bad parameters or prompt: INVALID_ARGUMENT."""


class QueueFullError(SpecdecError):
    """Too many requests are waiting: RESOURCE_EXHAUSTED."""


class OverloadedError(QueueFullError):
    """Every backend's queue is full: RESOURCE_EXHAUSTED at once, with a `retry-after` trailer."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnavailableError(SpecdecError):
    """No healthy backend: UNAVAILABLE."""


class ReaderStalledError(SpecdecError):
    """The caller stopped reading a stream past the server's buffer: RESOURCE_EXHAUSTED, the request ended."""


class NumericalError(SpecdecError):
    """The model's numbers for one request went bad (NaN or inf logits): that request ends, INTERNAL; the
    others in its batch are unaffected."""


class InternalError(SpecdecError):
    """A bug or an unexpected failure: INTERNAL. Its message is what the client sees: generic, with the request
    id to quote; the exception itself goes to the log, never to the client."""


class NotFoundError(SpecdecError):
    """The named thing (e.g. a model) is not served here: NOT_FOUND (HTTP 404)."""


class UnauthenticatedError(SpecdecError):
    """No valid credentials: UNAUTHENTICATED. `reason` labels metrics and logs, not the client's message."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class RateLimitedError(SpecdecError):
    """A client over its own limit: RESOURCE_EXHAUSTED, with a `retry-after` trailer in whole seconds."""

    def __init__(self, message: str, retry_after_s: int, client: str = "", limit: str = "") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.client = client
        self.limit = limit


def grpc_status_for(err: BaseException) -> tuple[Any, str]:
    """(grpc.StatusCode, message) for an exception raised by a service core."""
    import grpc

    if isinstance(err, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(err)
    if isinstance(err, UnauthenticatedError):
        return grpc.StatusCode.UNAUTHENTICATED, str(err)
    if isinstance(err, (QueueFullError, RateLimitedError, ReaderStalledError)):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(err)
    if isinstance(err, UnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(err)
    if isinstance(err, NotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(err)
    if isinstance(err, (NumericalError, InternalError)):
        return grpc.StatusCode.INTERNAL, str(err)
    if isinstance(err, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(err) or "deadline exceeded"
    # Anything else is a bug: its type and text may name files, addresses or internals, so they go to the log
    # (the caller logs the exception) and the client gets a generic message.
    return grpc.StatusCode.INTERNAL, "internal error; the server's log has the details"


def grpc_trailing_metadata_for(err: BaseException) -> tuple[tuple[str, str], ...]:
    """Trailing metadata that goes with the status: `retry-after` (seconds) when the client should wait."""
    if isinstance(err, (RateLimitedError, OverloadedError)):
        return (("retry-after", str(err.retry_after_s)),)
    return ()


# HTTP status and OpenAI error `type` per gRPC status code name: the HTTP front end maps a domain error
# through grpc_status_for first, so the two front ends can never disagree on what an error is.
_HTTP_BY_GRPC_CODE: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "cancelled"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "DEADLINE_EXCEEDED": (504, "timeout_error"),
}


def http_status_for_grpc_code(code_name: str) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) for a gRPC status code's name; anything else is 500 server_error."""
    return _HTTP_BY_GRPC_CODE.get(code_name, (500, "server_error"))
