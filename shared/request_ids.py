"""Callers' request ids: bounded and plain, for the caller's own correlation only.

A service never keys its state by a caller's id (two callers that both send "1" would collide); it makes
its own internal id and keeps the caller's beside it, in responses, logs and spans. The allowed characters
keep a log line's key=value structure intact whatever the caller sends.
"""

from __future__ import annotations

import re
import uuid

from shared.errors import InvalidRequestError

MAX_REQUEST_ID_CHARS = 128
_ALLOWED = re.compile(r"[A-Za-z0-9._:@/+=-]*")


def check_request_id(value: str, name: str = "request_id") -> str:
    """`value` unchanged if it is an acceptable caller id ('' = none given); else InvalidRequestError.
    `name`: the field, for the message (session ids follow the same rule)."""
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(f"{name} has {len(value)} characters; the limit is {MAX_REQUEST_ID_CHARS}")
    if not _ALLOWED.fullmatch(value):
        raise InvalidRequestError(
            f"{name} may contain only letters, digits and . _ : @ / + = - (no spaces or control characters)"
        )
    return value


def checked_or_empty(value: str) -> str:
    """`value` if check_request_id accepts it, else '' (for logs and spans before the request is refused)."""
    try:
        return check_request_id(value)
    except InvalidRequestError:
        return ""


def new_internal_id() -> str:
    return uuid.uuid4().hex
