"""Incremental, UTF-8 safe detokenization and stop-string matching. Pure Python, no grpc.

`IncrementalDetokenizer` turns token ids, one at a time, into text deltas. A byte-level BPE token can
hold part of a multi-byte character (an emoji is often 2-4 tokens), and SentencePiece tokenizers
decode a token differently depending on what precedes it (the leading-space marker). So, like the
serving engines do, we decode a short window of ids twice: `[prefix, read)` (text already emitted)
and `[prefix, end)`; the delta is the difference, and it is held back while it ends in U+FFFD (an
incomplete UTF-8 sequence). The window starts with the last few prompt tokens, so the first
generated token decodes with its real left context. Each step costs O(window), not O(output).

`StopStringMatcher` holds back text that could still become a stop string and cuts the text before
the first match.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as left context of the first generated token (enough for any tokenizer's
# leading-space / byte-merging rules; vLLM uses the same number).
PROMPT_CONTEXT_TOKENS = 5
# Tokens held back while the text ends in U+FFFD: a UTF-8 character is at most 4 bytes, so a partial one spans at
# most 3 byte-level tokens. Past this the text holds real U+FFFD characters (a format can ask for them): it is
# emitted, so that the window, decoded twice for every token, stays short. Held without bound, a run of them was
# decoded whole at every token: 4000 tokens took 1.1 s of the gateway's event loop, growing with the square.
MAX_HELD_TOKENS = 8


class Tokenizer(Protocol):
    def decode(self, token_ids: Any, **kwargs: Any) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        # Skipped special tokens add no text, and decoding drops them wherever they stand: left out of the window,
        # a run of them (EOS under ignore_eos) does not grow it.
        special = getattr(tokenizer, "all_special_ids", ()) or ()
        self._skipped = frozenset(special) if skip_special_tokens else frozenset()
        self._ids: list[int] = context
        self._prefix = 0  # start of the decode window
        self._read = len(context)  # ids before this are already turned into emitted text

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Adds one token; returns the text it completes ('' while it ends in a partial character)."""
        if token_id in self._skipped:
            return ""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        partial = full_text.endswith(REPLACEMENT_CHAR) and len(self._ids) - self._read < MAX_HELD_TOKENS
        if len(full_text) > len(prefix_text) and not partial:
            delta = full_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end becomes U+FFFD). Call once, at the end."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""


@dataclass(frozen=True)
class StopMatch:
    text: str  # text to emit before the stop string (the output ends there)
    stop_string: str


class StopStringMatcher:
    """Feeds text deltas; emits text that can no longer be part of a stop string.

    Invariant: the text held back is shorter than the longest stop string and is a suffix that is a
    proper prefix of some stop string, so every match is found in `held + delta`.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = tuple(stop)
        self._held = ""

    def feed(self, delta: str) -> tuple[str, StopMatch | None]:
        """(text safe to emit now, the match if a stop string completed)."""
        if not self._stop:
            return delta, None
        text = self._held + delta
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = text.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self._held = ""
            return "", StopMatch(text[: best[0]], best[1])
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
