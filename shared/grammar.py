"""Structured output: a JSON schema, any JSON object, a regex or a grammar, enforced token by token.

The grammar engine is llguidance (docs/notes/grammar-engines.md says why: compiles a per-request schema in
milliseconds, rejects schema keywords it cannot enforce, rolls back in a microsecond, no heavy dependencies).
Both the verifier (on the target's distribution) and the proposer (on its drafts) use the same three calls:

    matcher = compiler.matcher(constraint)    # per request: a copy of the cached compiled matcher
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
CACHE_SIZE = 64  # compiled matchers kept per tokenizer
# ... and at most this many characters of their specs: a compiled 250 kB schema holds 3-10 MB, so distinct
# large schemas sent one after another cannot grow the cache past ~100 MB.
CACHE_SPEC_CHARS = 4 * 1024 * 1024
MAX_SPEC_CHARS = 256 * 1024
# Deeper than any schema a person writes; Python's json module would raise RecursionError near 1,000, and the
# grammar engine stops near 200 on its own ("recursion limit exceeded"): refuse clearly before either.
MAX_SCHEMA_DEPTH = 64


def _limits() -> Any:
    """llguidance's own bounds on compile work and grammar size (its defaults: ~20 ms of lexer fuel, 500,000
    grammar symbols), without its verbose errors, which quote the parser's state and the grammar back."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


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
        except RecursionError:
            raise InvalidRequestError(f"invalid json_schema: nested deeper than {MAX_SCHEMA_DEPTH} levels") from None
        check_depth(schema)
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


def _one_line(error: str, limit: int = 300) -> str:
    """The compiler's message as one printable line (it may quote the grammar over several, with a caret)."""
    text = " ".join("".join(c if c.isprintable() else " " for c in error).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_depth(document: Any) -> None:
    """InvalidRequestError when a parsed JSON document nests deeper than MAX_SCHEMA_DEPTH (walked without
    recursion, so any depth is measured safely)."""
    stack = [(document, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidRequestError(f"invalid json_schema: nested deeper than {MAX_SCHEMA_DEPTH} levels")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe, with an LRU cache of compiled matchers (a request
    gets a copy: 0.1 ms, where compiling a large schema takes from a fraction of a second to seconds)."""

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
        # A compiled matcher at its start, or the error a constraint compiled to (a client sending the same bad
        # schema again is refused at once too).
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._cache_chars = 0  # characters of the cached constraints' specs
        self.compilations = 0  # constraints compiled (cache misses)

    def compile(self, constraint: StructuredOutput) -> Any:
        """The compiled matcher at its start (llguidance.LLMatcher; do not advance it: `matcher` copies it), or
        InvalidRequestError. Blocks for as long as the compile takes: call it off the event loop."""
        import llguidance

        with self._lock:
            cached = self._cache.get(constraint)
            if cached is not None:
                self._cache.move_to_end(constraint)
        if cached is None:
            try:
                grammar = grammar_for(constraint)
                compiled = llguidance.LLMatcher(self.ll_tokenizer, grammar, limits=_limits())
                cached = (
                    InvalidRequestError(f"invalid {constraint.kind}: {_one_line(compiled.get_error())}")
                    if compiled.is_error()
                    else compiled
                )
            except InvalidRequestError as err:
                cached = err
            except ValueError as err:  # llguidance's own refusals of grammar text (e.g. a bad Lark rule)
                cached = InvalidRequestError(f"invalid {constraint.kind}: {_one_line(str(err))}")
            with self._lock:
                self.compilations += 1
                if constraint not in self._cache:
                    self._cache_chars += len(constraint.spec)
                self._cache[constraint] = cached
                while len(self._cache) > CACHE_SIZE or self._cache_chars > CACHE_SPEC_CHARS:
                    self._cache_chars -= len(self._cache.popitem(last=False)[0].spec)
        if isinstance(cached, InvalidRequestError):
            raise InvalidRequestError(str(cached))
        return cached

    def matcher(self, constraint: StructuredOutput) -> GrammarMatcher:
        return GrammarMatcher(self, self.compile(constraint).deep_copy())

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

    def __init__(self, compiler: GrammarCompiler, matcher: Any) -> None:
        """`matcher`: a fresh llguidance.LLMatcher of its own (GrammarCompiler.matcher copies the cached one)."""
        self.compiler = compiler
        self._matcher = matcher
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

    def fill_masks(self, draft_ids: list[int], bitmask: torch.Tensor, row: int = 0, eos_ends: bool = True) -> int:
        """Rows row .. row + len(draft_ids) of `bitmask` ([rows, words] int32) get the tokens allowed at each
        scored position along the draft: the position before draft token j is row + j, the bonus position
        last. Rows after the first forbidden draft token (or after an EOS that ends the request) are left
        all-allowed: verification rejects that token, or the request ends there, so nothing after it is ever
        emitted. `eos_ends` False (a request that ignores EOS): a drafted EOS the format allows where it stands
        does not end the walk; it is skipped, as `consume` skips it, so the row after it allows what the row
        before it did, as plain decoding's next mask would. The matcher's state is unchanged. Returns the
        number of rows filled with a real mask."""
        bitmask[row : row + len(draft_ids) + 1] = -1
        consumed = 0
        try:
            for j, token in enumerate(draft_ids):
                self._fill_row(bitmask, row + j)
                if not self._allowed(token, bitmask[row + j], eos_ends):
                    return j + 1
                if token not in self.compiler.eos_token_ids:
                    self._matcher.consume_token(token)
                    consumed += 1
            self._fill_row(bitmask, row + len(draft_ids))  # the bonus position
            return len(draft_ids) + 1
        finally:
            if consumed:
                self._matcher.rollback(consumed)

    def fill_tree_masks(
        self, token_ids: list[int], parents: list[int], bitmask: torch.Tensor, row: int = 0, eos_ends: bool = True
    ) -> int:
        """A token tree's scored positions: row `row` gets the tokens allowed at the root, row + 1 + i those
        allowed after the path to node i. A row whose path holds a forbidden token or an EOS that ends the
        request is left all-allowed: verification never accepts that node (the forbidden token has no target
        probability under its parent's mask; the EOS ends the request), so nothing is emitted from it. An EOS
        that does not end it (`eos_ends` False) is skipped along the path, as in `fill_masks`. State unchanged;
        returns rows filled."""
        bitmask[row : row + len(token_ids) + 1] = -1
        self._fill_row(bitmask, row)
        filled = 1
        paths: list[list[int] | None] = []  # each node's path of grammar tokens (EOS skipped); None: not valid
        for node, (token, parent) in enumerate(zip(token_ids, parents, strict=True)):
            above = paths[parent] if parent >= 0 else []
            path = None
            if above is not None and self._allowed(token, bitmask[row + 1 + parent], eos_ends, above):
                path = above if token in self.compiler.eos_token_ids else [*above, token]
            paths.append(path)
            if path is not None:
                with self._after(path):
                    self._fill_row(bitmask, row + 1 + node)
                filled += 1
        return filled

    def _allowed(self, token: int, mask_row: torch.Tensor, eos_ends: bool, path: list[int] | None = None) -> bool:
        """Whether `token` may follow: an EOS where it does not end the request and the row's mask (the tokens
        allowed where it stands) has it; any other token where the grammar accepts it after the matcher's state
        (and `path`, already validated)."""
        if token in self.compiler.eos_token_ids:
            return not eos_ends and bool((int(mask_row[token // 32]) >> (token % 32)) & 1)
        walk = [*(path or ()), token]
        return bool(self._matcher.validate_tokens(walk) == len(walk))

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
