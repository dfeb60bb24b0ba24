"""Checks a request's output format (JSON schema, regex, grammar) before it is routed.

A schema, regex or grammar that does not compile is refused at once, with the compiler's message, instead of
after a hop to a verifier and a wait in its queue (the verifier compiles it again and would refuse it too).
The compiler is llguidance over the gateway's tokenizer (shared/grammar.py), the same one the verifiers build
over theirs; it keeps the last compiled grammars, so a client sending the same schema again pays nothing.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from shared.grammar import GrammarCompiler, StructuredOutput

log = logging.getLogger(__name__)


class FormatChecker:
    """One GrammarCompiler for the gateway's tokenizer, built on the first request that asks for a format
    (building it reads the whole vocabulary: about 0.4 s for 49k tokens, which requests without a format and
    gateways that never see one should not pay). Thread-safe: `check` blocks, call it in a worker thread."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._compiler: GrammarCompiler | None = None
        self._unavailable = False  # llguidance cannot read this tokenizer: the verifiers check alone
        self._lock = threading.Lock()

    def check(self, constraint: StructuredOutput) -> None:
        """Raises InvalidRequestError with the compiler's message when `constraint` does not compile."""
        compiler = self._get_compiler()
        if compiler is not None:
            compiler.compile(constraint)

    def _get_compiler(self) -> GrammarCompiler | None:
        with self._lock:
            if self._compiler is None and not self._unavailable:
                tokenizer = self._tokenizer
                eos = getattr(tokenizer, "eos_token_id", None)
                try:
                    self._compiler = GrammarCompiler(tokenizer, len(tokenizer), (eos,) if isinstance(eos, int) else ())
                except Exception as err:  # a tokenizer llguidance cannot read (not a transformers fast tokenizer)
                    self._unavailable = True
                    log.warning(
                        "event=format_check_off reason=%r: output formats are checked by the verifiers only", str(err)
                    )
            return self._compiler
