"""How much drafting from text already seen could speed a request up at best.

The suffix drafter is replayed over the target's greedy output (the output is the same whatever is drafted),
and at every output position p we note how many of its draft tokens the target would accept (`accepted_runs`).
An oracle that drafts exactly that many tokens at every step, never one to be rejected, is the best any
length policy over these drafts can do (`oracle`): what the workload allows, before any policy's guessing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from proposer_service.paged_drafter import common_prefix
from shared.drafting import DraftRequest


def accepted_runs(drafter, seq_id: str, prompt: list[int], output: list[int], k: int, tenant: str = "") -> list[int]:
    """Per output position p: how many of the drafter's tokens (at most k), proposed after prompt + output[:p],
    equal output[p:], with the committed tokens fed one at a time as a verifier would send them. The drafter
    keeps what it learned (a later request can draft from this one's answer); the sequence is released."""
    runs = []
    for p in range(len(output)):
        new = prompt if p == 0 else output[p - 1 : p]
        req = DraftRequest(seq_id, len(prompt) + p, list(new), k, tenant=tenant, draft_position=p)
        (draft,) = drafter.propose([req])
        runs.append(common_prefix(draft.token_ids, output[p:]))
    drafter.release([seq_id])
    return runs


@dataclass(frozen=True)
class Oracle:
    steps: int  # target forwards for the whole output
    tokens_per_step: float
    seconds: float  # the oracle's forwards, by the step times given
    plain_seconds: float  # one forward per token

    @property
    def speedup(self) -> float:
        return self.plain_seconds / self.seconds if self.seconds else 1.0


def oracle(runs: Sequence[int], step_seconds: Callable[[int], float]) -> Oracle:
    """Every step drafts exactly runs[p] tokens at the current position p, all accepted, and emits them and the
    target's next token. step_seconds(q): a forward scoring q tokens of one sequence."""
    p, steps, seconds = 0, 0, 0.0
    while p < len(runs):
        seconds += step_seconds(1 + runs[p])
        p += runs[p] + 1
        steps += 1
    return Oracle(steps, len(runs) / max(steps, 1), seconds, len(runs) * step_seconds(1))


def interpolate(times: dict[int, float]) -> Callable[[int], float]:
    """step_seconds from times measured at some query lengths: linear between them, the last slope beyond."""
    points = sorted(times.items())

    def at(q: int) -> float:
        for (q0, t0), (q1, t1) in zip(points, points[1:], strict=False):
            if q <= q1 or (q1, t1) == points[-1]:
                return t0 + (t1 - t0) * (q - q0) / (q1 - q0)
        return points[0][1]

    return at
