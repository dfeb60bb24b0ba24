"""Log-probabilities of emitted tokens: computed by the verifier, carried by the gateway, shown by both APIs.

What they are: the log-softmax of the target model's raw logits at the position where each token was
decided (an accepted draft, the recovered token after a rejection, or the bonus token), before the
request's temperature / top-k / top-p / min-p. That is the raw model distribution vLLM reports by
default (`logprobs_mode="raw_logprobs"`), and it is the same number plain decoding of the target gives:
drafting decides which positions are scored in one pass, never the logits there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit; the completions API's own (5) is lifted as vLLM does


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability and the `num_top` most likely tokens at its position."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()  # most likely first
    top_logprobs: tuple[float, ...] = ()


def token_logprobs(
    logits: torch.Tensor,  # [n, vocab]: the raw logits of the positions that decided `token_ids`
    token_ids: Sequence[int],  # n emitted tokens
    num_top: int,
) -> list[TokenLogprob]:
    n = len(token_ids)
    logprobs = torch.log_softmax(logits[:n].float(), dim=-1)  # [n, vocab]
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=logprobs.device)
    chosen = logprobs.gather(-1, ids.unsqueeze(-1)).squeeze(-1).tolist()  # [n]
    if num_top > 0:
        top_values, top_indices = logprobs.topk(num_top, dim=-1)  # [n, num_top], sorted descending
        top_v, top_i = top_values.tolist(), top_indices.tolist()
    else:
        top_v, top_i = [[] for _ in range(n)], [[] for _ in range(n)]
    return [
        TokenLogprob(int(t), float(lp), tuple(i), tuple(v))
        for t, lp, i, v in zip(token_ids, chosen, top_i, top_v, strict=True)
    ]


def check_top_logprobs(logprobs: bool, top_logprobs: int) -> str | None:
    """Why the pair is invalid, for a person; None when it is fine."""
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        return f"top_logprobs must lie in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}"
    if top_logprobs and not logprobs:
        return "top_logprobs needs logprobs: set logprobs to true"
    return None


def to_proto(entries: Sequence[TokenLogprob], num_top: int, msg: Any) -> None:
    """Fills a specdec.v1.Logprobs message (packed arrays) from `entries`."""
    msg.num_top = num_top
    msg.token_logprobs.extend(e.logprob for e in entries)
    for e in entries:
        msg.top_token_ids.extend(e.top_ids)
        msg.top_logprobs.extend(e.top_logprobs)


def from_proto(msg: Any, token_ids: Sequence[int]) -> list[TokenLogprob]:
    """specdec.v1.Logprobs -> entries; raises ValueError when the arrays do not fit `token_ids`."""
    n, k = len(token_ids), msg.num_top
    if len(msg.token_logprobs) != n or len(msg.top_token_ids) != n * k or len(msg.top_logprobs) != n * k:
        raise ValueError(
            f"logprobs for {len(msg.token_logprobs)} tokens (num_top {k}) do not match the {n} tokens sent"
        )
    values, top_ids, top_values = list(msg.token_logprobs), list(msg.top_token_ids), list(msg.top_logprobs)
    return [
        TokenLogprob(int(t), values[i], tuple(top_ids[i * k : (i + 1) * k]), tuple(top_values[i * k : (i + 1) * k]))
        for i, t in enumerate(token_ids)
    ]
