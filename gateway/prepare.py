"""Preparing requests, for both front ends: field validation, tokenization or the chat template, defaults
resolved into a PreparedRequest (what the verifier is sent), and each request's output processor
(gateway/output.py). Pure Python, no grpc: it works on plain values and raises
`shared.errors.InvalidRequestError` with messages written for a person.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.config import GatewayConfig
from gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher
from gateway.format_check import FormatChecker
from gateway.output import OutputProcessor
from shared.errors import InvalidRequestError
from shared.grammar import StructuredOutput
from shared.logprobs import check_top_logprobs
from shared.proto_convert import structured_output_from_proto
from shared.request_ids import check_request_id, new_internal_id
from shared.sampling import SamplingParams

_DEFAULTS = SamplingParams()
# The wire types of the verifier call (protos/specdec/v1): a value outside them would fail building the proto
# (a 500 after tokenizing and routing), so the edge refuses it first.
_INT32_MAX = 2**31 - 1
MAX_ROLE_CHARS = 64  # 'system', 'user', 'assistant', 'tool', ...: a role is a word, never a document
_UINT32_MAX = 2**32 - 1
_FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class RequestFields:
    """The public request's fields (GenerateRequest / CompleteRequest), unset optionals as None."""

    request_id: str = ""
    session_id: str = ""
    prompt: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    max_draft_tokens: int | None = None
    messages: tuple[tuple[str, str], ...] = ()  # (role, content): a chat, rendered with the chat template
    logprobs: bool = False
    top_logprobs: int = 0
    structured_output: StructuredOutput | None = None  # the format the output must match; None: free text

    @classmethod
    def from_proto(cls, msg: Any) -> RequestFields:
        def opt(name: str) -> Any:
            return getattr(msg, name) if msg.HasField(name) else None

        return cls(
            request_id=msg.request_id,
            session_id=msg.session_id,
            prompt=msg.prompt,
            prompt_token_ids=tuple(msg.prompt_token_ids),
            max_tokens=opt("max_tokens"),
            temperature=opt("temperature"),
            top_p=opt("top_p"),
            top_k=opt("top_k"),
            min_p=opt("min_p"),
            seed=opt("seed"),
            stop=tuple(msg.stop),
            stop_token_ids=tuple(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            max_draft_tokens=opt("max_draft_tokens"),
            messages=tuple((m.role, m.content) for m in msg.messages),
            logprobs=msg.logprobs,
            top_logprobs=msg.top_logprobs,
            structured_output=structured_output_from_proto(msg.structured_output)
            if msg.HasField("structured_output")
            else None,
        )


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request with every default resolved; what the verifier is sent (token ids only)."""

    request_id: str  # the gateway's own id: verifiers key the request by it
    session_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams  # temperature, top_k, top_p, min_p, seed, format (max_tokens/stop ids too)
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    max_draft_tokens: int | None
    max_tokens_explicit: bool = True  # False: the server default (clamped to the context length)
    num_logprobs: int | None = None  # None: no logprobs; else the top alternatives reported per token
    tenant: str = ""  # the API key's name ('' = anonymous): verifier and proposer keep cached text per tenant


class RequestPreparer:
    def __init__(self, tokenizer: Any, config: GatewayConfig) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.tokenizer_vocab = len(tokenizer)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_id: int | None = eos if isinstance(eos, int) else None
        self.formats = FormatChecker(tokenizer)

    # -- request side ------------------------------------------------------------------------------

    def check_fields(self, req: RequestFields, vocab_size: int | None = None) -> None:
        """Everything checkable before tokenizing. `vocab_size`: the verifiers' vocabulary, if known."""
        cfg = self.config
        check_request_id(req.request_id)
        check_request_id(req.session_id, "session_id")
        if len(req.prompt) > cfg.max_prompt_chars:
            raise InvalidRequestError(
                f"the prompt has {len(req.prompt)} characters; the limit is {cfg.max_prompt_chars}"
            )
        if len(req.prompt_token_ids) > cfg.max_prompt_tokens:
            raise InvalidRequestError(
                f"prompt_token_ids has {len(req.prompt_token_ids)} tokens; the limit is {cfg.max_prompt_tokens}"
            )
        given = [name for name, value in self._prompt_kinds(req) if value]
        if len(given) > 1:
            names = ", ".join(given[:-1]) + " and " + given[-1]
            raise InvalidRequestError(f"set exactly one of {names}, not {'both' if len(given) == 2 else 'all'}")
        if not given:
            raise InvalidRequestError("the prompt is empty: set prompt (text), prompt_token_ids or messages (chat)")
        self._check_messages(req.messages)
        self._check_wire_ranges(req)
        why = check_top_logprobs(req.logprobs, req.top_logprobs)
        if why is not None:
            raise InvalidRequestError(why)
        if req.max_tokens is not None:
            if req.max_tokens < 1:
                raise InvalidRequestError(f"max_tokens must be at least 1, got {req.max_tokens}")
            if req.max_tokens > cfg.max_tokens_limit:
                raise InvalidRequestError(f"max_tokens must be at most {cfg.max_tokens_limit}, got {req.max_tokens}")
        try:
            self._sampling(req).validate()
        except ValueError as err:
            raise InvalidRequestError(str(err)) from None
        if len(req.stop) > cfg.max_stop_strings:
            raise InvalidRequestError(f"at most {cfg.max_stop_strings} stop strings are allowed, got {len(req.stop)}")
        for i, s in enumerate(req.stop):
            if not s:
                raise InvalidRequestError(f"stop string {i} is empty; stop strings must be non-empty")
            if len(s) > cfg.max_stop_string_chars:
                raise InvalidRequestError(
                    f"stop string {i} has {len(s)} characters; the limit is {cfg.max_stop_string_chars}"
                )
        if len(req.stop_token_ids) > cfg.max_stop_token_ids:
            raise InvalidRequestError(
                f"at most {cfg.max_stop_token_ids} stop token ids are allowed, got {len(req.stop_token_ids)}"
            )
        vocab = self.vocab_limit(vocab_size)
        bad = [t for t in req.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt_token_ids contains {len(bad)} id(s) outside the vocabulary [0, {vocab}), e.g. {bad[:5]}"
            )

    @staticmethod
    def _check_wire_ranges(req: RequestFields) -> None:
        """Numbers the HTTP front end parsed as Python ints and floats must fit the verifier call's proto types."""
        for name, top in (("top_k", _INT32_MAX), ("max_tokens", _UINT32_MAX), ("max_draft_tokens", _UINT32_MAX)):
            value = getattr(req, name)
            if value is not None and not -_INT32_MAX - 1 <= value <= top:
                raise InvalidRequestError(f"{name} must lie in [0, {top}], got {value}")
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(req, name)
            if value is not None and math.isfinite(value) and abs(value) > _FLOAT32_MAX:
                raise InvalidRequestError(f"{name} must be at most {_FLOAT32_MAX:.7g} in size, got {value}")

    @staticmethod
    def _prompt_kinds(req: RequestFields) -> list[tuple[str, Any]]:
        return [("prompt", req.prompt), ("prompt_token_ids", req.prompt_token_ids), ("messages", req.messages)]

    def _check_messages(self, messages: Sequence[tuple[str, str]]) -> None:
        if not messages:
            return
        if not self.has_chat_template:
            raise InvalidRequestError(
                "this model's tokenizer has no chat template, so messages cannot be used: send prompt (text) or "
                "prompt_token_ids with the model's own prompt format"
            )
        cfg = self.config
        if len(messages) > cfg.max_messages:
            raise InvalidRequestError(f"the chat has {len(messages)} messages; the limit is {cfg.max_messages}")
        chars = sum(len(role) + len(content) for role, content in messages)
        if chars > cfg.max_prompt_chars:
            raise InvalidRequestError(
                f"the messages have {chars} characters (roles and contents); the limit is {cfg.max_prompt_chars}"
            )
        for i, (role, _) in enumerate(messages):
            if not role:
                raise InvalidRequestError(f"message {i} has no role (e.g. 'system', 'user', 'assistant')")
            if len(role) > MAX_ROLE_CHARS:
                raise InvalidRequestError(
                    f"message {i}'s role has {len(role)} characters; the limit is {MAX_ROLE_CHARS}"
                )

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def render_chat(self, messages: Sequence[tuple[str, str]]) -> tuple[int, ...]:
        """The chat's prompt ids: transformers' apply_chat_template with the generation prompt, as is."""
        conversation = [{"role": role, "content": content} for role, content in messages]
        try:
            rendered = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        except Exception as err:  # the template's own checks (e.g. roles must alternate) raise for the caller
            raise InvalidRequestError(f"the chat template refused the messages: {err}") from None
        ids = tuple(int(t) for t in (rendered["input_ids"] if hasattr(rendered, "keys") else rendered))
        if len(ids) > self.config.max_prompt_tokens:
            raise InvalidRequestError(
                f"the chat is {len(ids)} tokens long; the limit is {self.config.max_prompt_tokens}"
            )
        return ids

    def vocab_limit(self, vocab_size: int | None) -> int:
        """Token ids must be below both the tokenizer's and the model's vocabulary size."""
        return min(self.tokenizer_vocab, vocab_size) if vocab_size else self.tokenizer_vocab

    def tokenize(self, prompt: str) -> tuple[int, ...]:
        """Text prompt -> ids, with the tokenizer's default special tokens (e.g. BOS where it adds one)."""
        ids = tuple(self.tokenizer.encode(prompt))
        if not ids:
            raise InvalidRequestError("the prompt is empty after tokenization")
        if len(ids) > self.config.max_prompt_tokens:
            raise InvalidRequestError(
                f"the prompt is {len(ids)} tokens long; the limit is {self.config.max_prompt_tokens}"
            )
        return ids

    def prepare_request(
        self, req: RequestFields, vocab_size: int | None, request_id: str, tenant: str = ""
    ) -> PreparedRequest:
        """Everything a request needs before routing, in one call (the core runs it in a worker thread): the fields
        checked, the output format compiled (a bad one is refused here, before routing; 1-40 ms, cached), the
        prompt tokenized or the chat rendered, the defaults resolved; `tenant`: the API key's name."""
        self.check_fields(req, vocab_size)
        if req.structured_output is not None:
            self.formats.check(req.structured_output)
        if req.messages:
            prompt_ids = self.render_chat(req.messages)
        elif req.prompt:
            prompt_ids = self.tokenize(req.prompt)
        else:
            prompt_ids = tuple(req.prompt_token_ids)
        return dataclasses.replace(self.prepare(req, prompt_ids, request_id), tenant=tenant)

    def prepare(
        self, req: RequestFields, prompt_ids: Sequence[int] | None = None, request_id: str = ""
    ) -> PreparedRequest:
        """A checked request (check_fields first) plus its prompt ids -> PreparedRequest. `request_id`: the
        gateway's internal id (what verifiers see); the client's stays in `req`."""
        ids = tuple(prompt_ids) if prompt_ids is not None else tuple(req.prompt_token_ids)
        sampling = self._sampling(req)
        return PreparedRequest(
            request_id=request_id or new_internal_id(),
            session_id=req.session_id,
            prompt_ids=ids,
            max_tokens=sampling.max_tokens,
            sampling=sampling,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            max_draft_tokens=req.max_draft_tokens,
            max_tokens_explicit=req.max_tokens is not None,
            num_logprobs=req.top_logprobs if req.logprobs else None,
        )

    def check_context(self, prepared: PreparedRequest, max_model_len: int | None) -> PreparedRequest:
        """The prompt must leave room for at least one generated token, and an explicit max_tokens must fit
        the context (prompt + max_tokens beyond it is fine: generation stops there with LENGTH). The default
        max_tokens is clamped to the context length instead.

        Without a known context length (the verifier not polled yet) the verifier's own check decides,
        and its INVALID_ARGUMENT is passed through unchanged.
        """
        if not max_model_len:
            return prepared
        n = len(prepared.prompt_ids)
        if n >= max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens; the context limit is {max_model_len} tokens (prompt plus output), "
                "so the prompt must be shorter: shorten it"
            )
        if prepared.max_tokens > max_model_len:
            if not prepared.max_tokens_explicit:
                return dataclasses.replace(prepared, max_tokens=max_model_len)
            raise InvalidRequestError(
                f"max_tokens must be at most {max_model_len} (the model's context length), got {prepared.max_tokens}"
            )
        return prepared

    def _sampling(self, req: RequestFields) -> SamplingParams:
        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        return SamplingParams(
            temperature=float(pick(req.temperature, _DEFAULTS.temperature)),
            top_k=int(pick(req.top_k, _DEFAULTS.top_k)),
            top_p=float(pick(req.top_p, _DEFAULTS.top_p)),
            min_p=float(pick(req.min_p, _DEFAULTS.min_p)),
            seed=req.seed,
            max_tokens=int(pick(req.max_tokens, self.config.default_max_tokens)),
            stop_token_ids=tuple(req.stop_token_ids),
            ignore_eos=req.ignore_eos,
            structured_output=req.structured_output,
        )

    # -- output side -------------------------------------------------------------------------------

    def output(self, prepared: PreparedRequest) -> OutputProcessor:
        return OutputProcessor(
            IncrementalDetokenizer(self.tokenizer, prepared.prompt_ids, self.config.skip_special_tokens),
            StopStringMatcher(prepared.stop),
            prepared.max_tokens,
        )
