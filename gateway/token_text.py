"""One token's text and bytes, for the logprobs of the HTTP API (OpenAI's `token` and `bytes` fields).

`text` is `tokenizer.decode([id])`: a token that holds part of a UTF-8 character decodes to U+FFFD there.
`bytes` are the token's own bytes, so that a client can join the bytes of consecutive tokens into the exact
text (OpenAI's purpose for the field): for byte-level BPE tokenizers (GPT-2's byte-to-character table, used
by Llama 3, Qwen2, SmolLM2, ...) they come from the token's vocabulary string; for other tokenizers they are
the UTF-8 of `text`.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's table from the printable characters byte-level BPE vocabularies use back to bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenText:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ())

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one per gateway, lives as long as the process
    def text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    @functools.lru_cache(maxsize=65536)  # noqa: B019
    def bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        decoder = _byte_decoder()
        if token_id not in self._special and isinstance(piece, str) and piece and all(c in decoder for c in piece):
            return [decoder[c] for c in piece]
        return list(self.text(token_id).encode())
