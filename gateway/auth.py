"""API keys at the gateway: the key file, whose key a request carries, and the per-key limits.

Pure Python, no grpc: the servicer hands in the `authorization` metadata values; the errors
(shared.errors) become UNAUTHENTICATED and RESOURCE_EXHAUSTED in the one mapping there.

Key file (`--api-keys-file`), one key a line, `#` starts a comment, blank lines are ignored:

    KEY_OR_SHA256 [NAME] [max_streams=N] [tpm=N]

- `KEY_OR_SHA256`: the key itself, or `sha256:<64 hex digits>` of it (so the file need not hold the key).
- `NAME` (letters, digits, `._@-`): what logs, spans and metric labels show; keys are never logged. Without
  a name the key is shown as `sha256:` plus the first 8 hex digits of its digest, and it is its own client
  (limits, cached prompts) by the whole digest: two unnamed keys whose shown digits collide stay apart. Keys
  sharing a name (a rotation: old and new key of one client) share its limits and cached prompts.
- `max_streams=N`, `tpm=N`: this name's limits instead of `--api-key-max-concurrent-streams` and
  `--api-key-max-tokens-per-minute` (0: unlimited).

The file is re-read when its mtime, size, inode or ctime changes (checked on each request, one stat), so
removing a line revokes that key for new requests. A file that cannot be read or parsed at a reload
keeps the keys of the last good one (logged as an error once per change); at start-up it is fatal.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from shared.errors import RateLimitedError, UnauthenticatedError

log = logging.getLogger(__name__)

WINDOW_S = 60  # tokens per minute: a sliding window of 1-second buckets
STREAM_RETRY_S = 1  # a stream's end cannot be foreseen: the hint for the concurrency limit
_NAME = re.compile(r"[A-Za-z0-9._@-]{1,64}")
_HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}")
_OPTIONS = {"max_streams": "max_streams", "tpm": "tokens_per_minute"}


class KeyFileError(ValueError):
    """A key file that cannot be used; the message names the file and line (never the key)."""


@dataclass(frozen=True)
class ApiKey:
    name: str  # what logs and metrics show
    digest: bytes  # SHA-256 of the key
    max_streams: int | None = None  # None: the flag's default
    tokens_per_minute: int | None = None
    client: str = ""  # who shares limits and cached prompts: the name, or for an unnamed key the whole digest

    def __post_init__(self) -> None:
        if not self.client:
            object.__setattr__(self, "client", self.name)


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_key_file(text: str, source: str = "api keys file") -> dict[bytes, ApiKey]:
    """The file's keys by digest; KeyFileError naming the line for a bad one."""
    keys: dict[bytes, ApiKey] = {}
    limits_of: dict[str, tuple[int | None, int | None]] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        tokens = _strip_comment(line.split())
        if not tokens:
            continue
        where = f"{source} line {number}"
        key = _parse_line(tokens, where)
        if key.digest in keys:
            raise KeyFileError(f"{where}: the same key as on an earlier line")
        limits = (key.max_streams, key.tokens_per_minute)
        if limits_of.setdefault(key.client, limits) != limits:
            raise KeyFileError(f"{where}: name {key.name!r} appears earlier with other limits")
        keys[key.digest] = key
    return keys


def _strip_comment(tokens: list[str]) -> list[str]:
    for i, token in enumerate(tokens):
        if token.startswith("#"):
            return tokens[:i]
    return tokens


def _parse_line(tokens: list[str], where: str) -> ApiKey:
    # Messages never quote the first token or an option's value: either may be a key put in the wrong place.
    first, rest = tokens[0], tokens[1:]
    if first.lower().startswith("sha256:"):
        hex_digest = first[len("sha256:") :]
        if not _HEX_DIGEST.fullmatch(hex_digest):
            raise KeyFileError(f"{where}: sha256: must be followed by 64 hex digits")
        digest = bytes.fromhex(hex_digest)
    else:
        digest = key_digest(first)
    name = ""
    options: dict[str, int] = {}
    for token in rest:
        option, eq, value = token.partition("=")
        if not eq:
            if name:
                raise KeyFileError(f"{where}: more than one name (the format: KEY_OR_SHA256 [NAME] [OPTION=N ...])")
            if not _NAME.fullmatch(token):
                raise KeyFileError(f"{where}: a name is 1 to 64 letters, digits or ._@-")
            name = token
            continue
        if option not in _OPTIONS:
            raise KeyFileError(f"{where}: unknown option {option!r} (known: max_streams, tpm)")
        if not value.isdigit():
            raise KeyFileError(f"{where}: {option} must be a whole number >= 0 (0: unlimited)")
        options[_OPTIONS[option]] = int(value)
    client = name or f"sha256:{digest.hex()}"
    return ApiKey(name or f"sha256:{digest.hex()[:8]}", digest, client=client, **options)


class KeyFile:
    """The keys of one file, re-read when the file changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.keys: dict[bytes, ApiKey] = {}
        self.revoked: set[bytes] = set()  # digests removed by a reload (only to label the metric)
        self._stamp: tuple[int, ...] = self._stat()
        self.keys = self._read()  # errors here are fatal: the service does not start with a bad file
        log.info("event=api_keys_loaded file=%s keys=%d", path, len(self.keys))

    def current(self) -> dict[bytes, ApiKey]:
        try:
            stamp = self._stat()
        except OSError as err:
            stamp = ()
            error: Exception | None = err
        else:
            error = None
        if stamp == self._stamp:
            return self.keys
        self._stamp = stamp  # a failed reload is logged once, then retried when the file changes again
        try:
            if error is not None:
                raise error
            keys = self._read()
        except (OSError, ValueError) as err:  # ValueError: KeyFileError, or not UTF-8
            log.error("event=api_keys_reload_failed file=%s error=%s kept_keys=%d", self.path, err, len(self.keys))
            return self.keys
        removed = self.keys.keys() - keys.keys()
        self.revoked = (self.revoked | removed) - keys.keys()
        log.info("event=api_keys_reloaded file=%s keys=%d removed=%d", self.path, len(keys), len(removed))
        self.keys = keys
        return keys

    def _stat(self) -> tuple[int, ...]:
        st = os.stat(self.path)
        return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_ctime_ns)

    def _read(self) -> dict[bytes, ApiKey]:
        with open(self.path, encoding="utf-8") as f:
            return parse_key_file(f.read(), self.path)


@dataclass
class _Usage:
    """One name's open streams and its tokens in the last minute (1-second buckets, oldest first)."""

    streams: int = 0
    buckets: deque[list[int]] = field(default_factory=deque)  # [second, tokens]
    tokens: int = 0

    def window_tokens(self, now: float) -> int:
        while self.buckets and now - self.buckets[0][0] >= WINDOW_S:
            self.tokens -= self.buckets.popleft()[1]
        return self.tokens

    def charge(self, now: float, n: int) -> None:
        second = int(now)
        if self.buckets and self.buckets[-1][0] == second:
            self.buckets[-1][1] += n
        else:
            self.buckets.append([second, n])
        self.tokens += n

    def seconds_until_below(self, now: float, limit: int) -> int:
        """When the window will hold fewer than `limit` tokens (no new ones counted)."""
        left = self.window_tokens(now)
        for second, n in self.buckets:
            left -= n
            if left < limit:
                return max(1, math.ceil(second + WINDOW_S - now))
        return 1


class Grant:
    """An admitted request: its key's name, the stream slot it holds (a context manager releases it) and
    its token charges. `Grant()` is the grant of a gateway without keys. `tenant`: whose cached prompts it may
    reuse (ApiKey.client; '' = anonymous)."""

    def __init__(
        self,
        name: str = "",
        usage: _Usage | None = None,
        clock: Callable[[], float] = time.monotonic,
        tenant: str | None = None,
    ):
        self.name = name
        self.tenant = name if tenant is None else tenant
        self._usage = usage
        self._clock = clock
        self._on_release: list[Callable[[], object]] = []  # other slots it holds (the core's generation cap)

    def hold(self, release: Callable[[], object]) -> None:
        """`release` runs once, when this grant is released."""
        self._on_release.append(release)

    def charge(self, tokens: int) -> None:
        if self._usage is not None and tokens:
            self._usage.charge(self._clock(), tokens)

    def release(self) -> None:
        if self._usage is not None:
            self._usage.streams -= 1
            self._usage = None
        while self._on_release:
            self._on_release.pop()()

    def __enter__(self) -> Grant:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> Grant:  # so that one `async with` holds it and the request's generator
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class ApiKeyAuth:
    """Who a request is (its bearer key) and whether its key's limits let it in."""

    def __init__(
        self,
        keys: KeyFile,
        max_streams: int = 0,
        tokens_per_minute: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keys = keys
        self.max_streams = max_streams
        self.tokens_per_minute = tokens_per_minute
        self._clock = clock
        self._usage: dict[str, _Usage] = {}

    def identify(self, authorization: Iterable[str]) -> ApiKey:
        """The key of an `authorization: Bearer <key>` value; UnauthenticatedError (with a reason) if none."""
        values = list(authorization)
        if not values:
            raise UnauthenticatedError(
                "an API key is required: send the metadata 'authorization: Bearer <key>'", "missing"
            )
        scheme, _, token = values[0].strip().partition(" ")
        token = token.strip()
        if len(values) > 1 or scheme.lower() != "bearer" or not token or any(c.isspace() for c in token):
            raise UnauthenticatedError("the authorization metadata must be one 'Bearer <key>'", "malformed")
        digest = key_digest(token)
        keys = self.keys.current()
        # The dict finds the candidate by the digest of what was presented (timing there says nothing about
        # any stored key: SHA-256 cannot be run backwards); the final comparison is constant-time anyway.
        key = keys.get(digest)
        if key is None or not hmac.compare_digest(key.digest, digest):
            reason = "revoked" if digest in self.keys.revoked else "unknown"
            raise UnauthenticatedError("the API key is not valid", reason)
        return key

    def admit(self, authorization: Iterable[str], limits: bool = True) -> Grant:
        """identify(), then (with `limits`) take one of the key's stream slots if its limits allow."""
        key = self.identify(authorization)
        if not limits:
            return Grant(key.name, tenant=key.client)
        now = self._clock()
        usage = self._usage.setdefault(key.client, _Usage())
        max_streams = self.max_streams if key.max_streams is None else key.max_streams
        tpm = self.tokens_per_minute if key.tokens_per_minute is None else key.tokens_per_minute
        if max_streams and usage.streams >= max_streams:
            raise RateLimitedError(
                f"API key {key.name!r} has {usage.streams} requests running, its limit is {max_streams}; "
                f"retry after {STREAM_RETRY_S} s or when one has finished",
                STREAM_RETRY_S,
                key.name,
                "streams",
            )
        if tpm and usage.window_tokens(now) >= tpm:
            retry = usage.seconds_until_below(now, tpm)
            raise RateLimitedError(
                f"API key {key.name!r} used {usage.tokens} tokens (prompt and generated) in the last minute, its "
                f"limit is {tpm} per minute; retry after {retry} s",
                retry,
                key.name,
                "tokens_per_minute",
            )
        usage.streams += 1
        return Grant(key.name, usage, self._clock, key.client)
