"""Structured output: a JSON schema, any JSON object, a regex or a grammar, enforced token by token.

The grammar engine is llguidance (docs/notes/grammar-engines.md says why: compiles a per-request schema in
milliseconds, rejects schema keywords it cannot enforce, rolls back in a microsecond, no heavy dependencies).
Both the verifier (on the target's distribution) and the proposer (on its drafts) use the same three calls:

    matcher = compiler.matcher(constraint)    # per request; compiled grammars are cached
    matcher.fill_masks(draft_ids, bitmask)    # allowed tokens at every scored position along a draft
    matcher.consume(emitted_ids)              # advance by what was emitted

End-of-sequence tokens are never grammar input: the mask allows them exactly where the grammar accepts (every
EOS id of the model, not only the tokenizer's), and a sequence ends on one, so the matcher need not consume it
(which sidesteps llguidance's miscounted rollback of an EOS consumed after the grammar stopped).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shared.errors import InvalidRequestError

log = logging.getLogger("specdec.grammar")
KINDS = ("json_schema", "json_object", "regex", "grammar")
# Compact JSON: with flexible whitespace a small model can emit blanks forever inside a valid document.
JSON_OVERRIDES: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled grammars kept per tokenizer
MAX_SPEC_CHARS = 256 * 1024


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. `spec`: the JSON Schema document (JSON text), the regex, or the grammar
    (Lark syntax, or GBNF with `::=` rules); empty for json_object."""

    kind: str
    spec: str = ""

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind != "json_object" and not self.spec.strip():
            raise InvalidRequestError(f"structured output {self.kind} is empty")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"structured output {self.kind} is longer than {MAX_SPEC_CHARS} characters")


def grammar_for(constraint: StructuredOutput) -> str:
    """llguidance's grammar text for a constraint (not yet checked against a tokenizer)."""
    import llguidance

    constraint.validate()
    if constraint.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OVERRIDES)
    if constraint.kind == "json_schema":
        try:
            schema = json.loads(constraint.spec)
        except json.JSONDecodeError as err:
            raise InvalidRequestError(f"invalid json_schema: not JSON: {err}") from err
        if schema is False:
            raise InvalidRequestError("invalid json_schema: the schema false allows no output")
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError("invalid json_schema: a schema is a JSON object (or true)")
        schema_doc: Any = {} if schema is True else schema
        return llguidance.LLMatcher.grammar_from_json_schema(schema_doc, overrides=JSON_OVERRIDES)
    if constraint.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.spec)
    text = constraint.spec
    if "::=" in text:  # GBNF (llama.cpp, xgrammar's EBNF): llguidance reads Lark
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as err:  # the converter raises plain exceptions with a readable message
            raise InvalidRequestError(f"invalid grammar: {err}") from err
    return llguidance.LLMatcher.grammar_from_lark(text)


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe, with an LRU cache of checked grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        """`tokenizer`: a transformers tokenizer, or an llguidance.LLTokenizer made by hand (tests)."""
        import llguidance
        import llguidance.hf

        if isinstance(tokenizer, llguidance.LLTokenizer):
            self.ll_tokenizer = tokenizer
        else:
            self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words per bitmask row
        self.grammar_eos = self.ll_tokenizer.eos_token
        self.eos_token_ids = frozenset(eos_token_ids) | {self.grammar_eos}
        self._cache: OrderedDict[StructuredOutput, str] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, constraint: StructuredOutput) -> str:
        import llguidance

        with self._lock:
            if constraint in self._cache:
                self._cache.move_to_end(constraint)
                return self._cache[constraint]
        grammar = grammar_for(constraint)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise InvalidRequestError(f"invalid {constraint.kind}: {error}")
        with self._lock:
            self._cache[constraint] = grammar
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, constraint: StructuredOutput) -> GrammarMatcher:
        return GrammarMatcher(self, self.compile(constraint), constraint.kind)

    def new_bitmask(self, rows: int) -> torch.Tensor:  # [rows, words] int32, every token allowed
        return torch.full((rows, self.words), -1, dtype=torch.int32)


def load_compiler(
    tokenizer_source: str, vocab_size: int, eos_token_ids: tuple[int, ...], without: str
) -> GrammarCompiler | None:
    """The compiler over the tokenizer at `tokenizer_source` (a model folder or hub id), or None with a warning
    that says what happens `without` it: a service serves on with formats refused or not drafted."""
    from shared.model.loader import load_tokenizer

    started = time.monotonic()
    try:
        compiler = GrammarCompiler(load_tokenizer(tokenizer_source), vocab_size, eos_token_ids)
    except Exception as err:  # any loader or grammar-engine failure (a test model's own small vocabulary)
        log.warning("no format compiler from %s (%s): %s", tokenizer_source, err, without)
        return None
    log.info("format compiler ready tokenizer=%s seconds=%.1f", tokenizer_source, time.monotonic() - started)
    return compiler


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe: one owner at a time."""

    def __init__(self, compiler: GrammarCompiler, grammar: str, kind: str) -> None:
        import llguidance

        self.compiler = compiler
        self._matcher = llguidance.LLMatcher(compiler.ll_tokenizer, grammar)
        if self._matcher.is_error():
            raise InvalidRequestError(f"invalid {kind}: {self._matcher.get_error()}")
        self.num_consumed = 0  # grammar tokens consumed (EOS excluded)

    def consume(self, token_ids: list[int]) -> None:
        """Advance by emitted tokens (EOS skipped). A token the grammar forbids raises InvalidRequestError and
        leaves the matcher as it was."""
        tokens = [t for t in token_ids if t not in self.compiler.eos_token_ids]
        if not tokens:
            return
        if self._matcher.validate_tokens(tokens) != len(tokens):
            raise InvalidRequestError("the output so far does not match the requested format")
        if not self._matcher.consume_tokens(tokens):  # validated: only an internal error lands here
            raise InvalidRequestError(f"grammar matcher failed: {self._matcher.get_error()}")
        self.num_consumed += len(tokens)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` consumed (a drafter walking its own draft); EOS was never consumed."""
        if num_tokens > self.num_consumed:
            raise ValueError(f"cannot roll back {num_tokens} tokens: only {self.num_consumed} consumed")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_consumed -= num_tokens

    def forced_after(self, prefix: list[int]) -> list[int]:
        """The tokens the format forces after `prefix` (valid, no EOS), e.g. a JSON key and its quotes: the only
        ones the mask will allow there, so a drafter may propose them for free. State unchanged."""
        walk, num_valid = self._valid_walk(prefix)
        if num_valid != len(prefix):  # a forbidden token, or an EOS: nothing follows
            return []
        with self._after(walk):
            return list(self._matcher.compute_ff_tokens())

    def num_valid(self, draft_ids: list[int]) -> int:
        """How many leading draft tokens the grammar allows (state unchanged); an EOS counts where the grammar
        may end, and nothing after it does."""
        walk, num_valid = self._valid_walk(draft_ids)
        if num_valid == len(walk) < len(draft_ids):  # all valid up to an EOS
            with self._after(walk):
                num_valid += int(self._matcher.is_accepting())
        return num_valid

    def _valid_walk(self, draft_ids: list[int]) -> tuple[list[int], int]:
        """(the draft up to its first EOS, how many of those tokens the grammar allows); state unchanged."""
        cut = next((j for j, t in enumerate(draft_ids) if t in self.compiler.eos_token_ids), len(draft_ids))
        walk = draft_ids[:cut]
        return walk, self._matcher.validate_tokens(walk) if walk else 0

    @contextlib.contextmanager
    def _after(self, valid_tokens: list[int]) -> Iterator[None]:
        """The matcher moved past `valid_tokens` (validated, no EOS) for the block, then back."""
        if valid_tokens:
            self._matcher.consume_tokens(valid_tokens)
        try:
            yield
        finally:
            if valid_tokens:
                self._matcher.rollback(len(valid_tokens))

    def fill_masks(self, draft_ids: list[int], bitmask: torch.Tensor, row: int = 0) -> int:
        """Rows row .. row + len(draft_ids) of `bitmask` ([rows, words] int32) get the tokens allowed at each
        scored position along the draft: the position before draft token j is row + j, the bonus position
        last. Rows after the first forbidden draft token (or after an EOS) are left all-allowed: verification
        rejects that token, so nothing after it is ever emitted. The matcher's state is unchanged.
        Returns the number of rows filled with a real mask."""
        bitmask[row : row + len(draft_ids) + 1] = -1
        walk, num_valid = self._valid_walk(draft_ids)
        for j in range(num_valid + 1):
            self._fill_row(bitmask, row + j)
            if j < num_valid:
                self._matcher.consume_token(walk[j])
        if num_valid:
            self._matcher.rollback(num_valid)
        return num_valid + 1

    def fill_tree_masks(self, token_ids: list[int], parents: list[int], bitmask: torch.Tensor, row: int = 0) -> int:
        """A token tree's scored positions: row `row` gets the tokens allowed at the root, row + 1 + i those
        allowed after the path to node i. A row whose path holds a forbidden token or an EOS is left all-allowed:
        verification never accepts that node (the forbidden token has no target probability under its parent's
        mask; an EOS ends the request), so nothing is emitted from it. State unchanged; returns rows filled."""
        bitmask[row : row + len(token_ids) + 1] = -1
        self._fill_row(bitmask, row)
        filled = 1
        paths: list[list[int]] = []
        for node, parent in enumerate(parents):
            paths.append([*(paths[parent] if parent >= 0 else []), token_ids[node]])
            walk, num_valid = self._valid_walk(paths[-1])
            if num_valid == len(walk) == len(paths[-1]):
                with self._after(walk):
                    self._fill_row(bitmask, row + 1 + node)
                filled += 1
        return filled

    def _fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)
        grammar_eos = self.compiler.grammar_eos
        eos_allowed = bool((int(target[grammar_eos // 32]) >> (grammar_eos % 32)) & 1)
        for eos in self.compiler.eos_token_ids:  # every EOS of the model ends where the grammar accepts
            if eos != grammar_eos and eos < self.compiler.vocab_size:
                word = int(target[eos // 32])
                bit = 1 << (eos % 32)
                word = word | bit if eos_allowed else word & ~bit
                target[eos // 32] = word - (1 << 32) if word >= 1 << 31 else word


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [rows, vocab] bool
    """Unpack llguidance's bitmask (bit j % 32 of word j // 32 is token j, least significant bit first)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def mask_logits_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Forbidden tokens' logits to -inf, in place; `logits` [rows, vocab], `bitmask` [rows, words]."""
    allowed = allowed_tokens(bitmask.to(logits.device), logits.shape[-1])
    return logits.masked_fill_(~allowed, float("-inf"))


class GrammarLogitsProcessor:
    """transformers' LogitsProcessor over the same matcher: the plain (non-speculative) decoder with a format,
    which the engine's constrained output must equal. One instance per `generate()` call."""

    def __init__(self, compiler: GrammarCompiler, constraints: list[StructuredOutput | None], prompt_len: int):
        self.matchers = [compiler.matcher(c) if c is not None else None for c in constraints]
        self.bitmask = compiler.new_bitmask(len(constraints))
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        rows = [i for i, m in enumerate(self.matchers) if m is not None]
        for i in rows:
            matcher = self.matchers[i]
            assert matcher is not None
            if input_ids.shape[1] > self.prompt_len:
                matcher.consume([int(input_ids[i, -1])])
            matcher.fill_masks([], self.bitmask, i)
        if rows:
            index = torch.tensor(rows)
            scores[index] = mask_logits_(scores[index], self.bitmask[index])
        return scores
