"""OpenAI-compatible request bodies (pydantic) and their translation to the core's RequestFields.

Fields follow OpenAI's API; the sampling extensions are named as vLLM names them (top_k, min_p,
stop_token_ids, ignore_eos), and so are the output formats beside OpenAI's response_format
(structured_outputs, guided_json / guided_regex / guided_grammar: openai_formats.py). Fields we do not
implement are refused with a clear 400 when set to anything but their neutral value (n > 1, penalties, echo,
best_of, logit_bias, tools), never silently ignored; unknown fields are ignored, as OpenAI-compatible
servers do. An explicit null is the field's default, and top_k = -1 (vLLM's "off") is no top-k, as there.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.openai_formats import structured_output_from_http
from gateway.prepare import RequestFields
from shared.errors import InvalidRequestError
from shared.logprobs import MAX_TOP_LOGPROBS


class _Body(BaseModel):
    """A request body's object: unknown fields ignored, and an explicit null taken as the field's default, as
    OpenAI's API and vLLM's take it (`"stream": null` is not streaming, `"n": null` one choice)."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].default is None}


class StreamOptions(_Body):
    include_usage: bool = False


class _Common(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False  # vLLM's: each choice (and streamed chunk) also carries its token ids
    # ours: the upper bound on the draft length (0: no speculation), and session affinity
    max_draft_tokens: int | None = Field(default=None, ge=0)
    session_id: str = ""
    # output formats (openai_formats.py): OpenAI's, vLLM's, vLLM's older ones; typed Any so that a bad shape
    # gets a message naming the field and saying what it should be
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_grammar: Any = None
    guided_choice: Any = None
    guided_whitespace_pattern: Any = None

    def check_unsupported(self) -> None:
        if self.n != 1:
            raise InvalidRequestError(f"n must be 1 (one choice per request), got {self.n}")
        if self.presence_penalty or self.frequency_penalty:
            raise InvalidRequestError("presence_penalty and frequency_penalty are not supported; leave them at 0")
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options needs stream: true")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidRequestError(f"seed must lie in [0, 2**64), got {self.seed}")

    def common_fields(self, max_tokens: int | None) -> dict[str, Any]:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return {
            "session_id": self.session_id,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": 0 if self.top_k == -1 else self.top_k,  # vLLM's -1 (as its 0): no top-k
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": stop,
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
            "max_draft_tokens": self.max_draft_tokens,
            "structured_output": structured_output_from_http(
                self.response_format,
                self.structured_outputs,
                {
                    "guided_json": self.guided_json,
                    "guided_regex": self.guided_regex,
                    "guided_grammar": self.guided_grammar,
                    "guided_choice": self.guided_choice,
                    "guided_whitespace_pattern": self.guided_whitespace_pattern,
                },
            ),
        }

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common):
    """POST /v1/completions. `logprobs` is the number of alternatives per token (OpenAI's legacy field)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def to_fields(self) -> RequestFields:
        self.check_unsupported()
        if self.echo:
            raise InvalidRequestError("echo is not supported")
        if self.best_of not in (None, 1):
            raise InvalidRequestError(f"best_of must be 1, got {self.best_of}")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"logprobs must lie in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        prompt, prompt_ids = _one_prompt(self.prompt)
        return RequestFields(
            prompt=prompt,
            prompt_token_ids=prompt_ids,
            logprobs=self.logprobs is not None,
            top_logprobs=self.logprobs or 0,
            **self.common_fields(self.max_tokens),
        )


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None

    def to_fields(self) -> RequestFields:
        self.check_unsupported()
        if self.tools:
            raise InvalidRequestError("tools are not supported")
        if not self.messages:
            raise InvalidRequestError("messages is empty: send at least one message")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return RequestFields(
            messages=tuple((m.role, _text(m.content, i)) for i, m in enumerate(self.messages)),
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs or 0,
            **self.common_fields(max_tokens),
        )


def _one_prompt(prompt: Any) -> tuple[str, tuple[int, ...]]:
    """(text, ids): one of them set. A list of one prompt is that prompt; more than one: 400 (no batching)."""
    if isinstance(prompt, str):
        return prompt, ()
    if prompt and all(isinstance(t, int) for t in prompt):
        return "", tuple(prompt)
    if isinstance(prompt, list) and len(prompt) == 1:
        return _one_prompt(prompt[0])
    if not prompt:
        raise InvalidRequestError("the prompt is empty")
    raise InvalidRequestError(f"one prompt per request: got a list of {len(prompt)} prompts")


def _text(content: str | list[ContentPart] | None, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type != "text":
            raise InvalidRequestError(f"message {index}: content parts of type {part.type!r} are not supported")
        parts.append(part.text)
    return "".join(parts)


FinishName = Literal["stop", "length", "abort"]
