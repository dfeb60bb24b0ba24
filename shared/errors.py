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
    if isinstance(err, NumericalError):
        return grpc.StatusCode.INTERNAL, str(err)
    if isinstance(err, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(err) or "deadline exceeded"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}: {err}"


def grpc_trailing_metadata_for(err: BaseException) -> tuple[tuple[str, str], ...]:
    """Trailing metadata that goes with the status: `retry-after` (seconds) when the client should wait."""
    if isinstance(err, (RateLimitedError, OverloadedError)):
        return (("retry-after", str(err.retry_after_s)),)
    return ()
