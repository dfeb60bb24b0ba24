"""Each request's output side: the token history (for resuming elsewhere), incremental UTF-8 safe text, stop
strings and max_tokens, turning each verifier message into one chunk for the client."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher
from shared.logprobs import TokenLogprob


@dataclass
class Chunk:
    """What one verifier message turns into for the client."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    stop_string: str | None = None  # set when a stop string ended the output
    length_reached: bool = False  # max_tokens reached (a misbehaving verifier's extra tokens are cut)
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the request asked


class OutputProcessor:
    """Per request: the token history (for resuming elsewhere), the text, stop strings, max_tokens."""

    def __init__(self, detok: IncrementalDetokenizer, stops: StopStringMatcher, max_tokens: int) -> None:
        self._detok = detok
        self._stops = stops
        self.max_tokens = max_tokens
        self.token_ids: list[int] = []  # everything emitted to the client so far
        self.finished = False

    def add(self, token_ids: Sequence[int]) -> Chunk:
        """Processes tokens one by one; stops at a stop string or at max_tokens."""
        chunk = Chunk()
        for token in token_ids:
            if self.finished:
                break
            self.token_ids.append(token)
            chunk.token_ids.append(token)
            text, match = self._stops.feed(self._detok.add(token))
            if match is not None:
                chunk.text += match.text
                chunk.stop_string = match.stop_string
                self.finished = True
                break
            chunk.text += text
            if len(self.token_ids) >= self.max_tokens:
                chunk.length_reached = True
                break
        return chunk

    def finish(self) -> Chunk:
        """The held-back text at the end of the output (a stop string may still complete in it)."""
        chunk = Chunk()
        if self.finished:
            return chunk
        self.finished = True
        text, match = self._stops.feed(self._detok.flush())
        if match is not None:
            chunk.text, chunk.stop_string = match.text, match.stop_string
            return chunk
        chunk.text = text + self._stops.flush()
        return chunk
