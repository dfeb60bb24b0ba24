"""The next step's drafts, asked for as soon as a step's tokens were committed (engine.py, `_ask_early`).

The request goes out with the plans the next schedule keeps; a scheduled sequence takes its early draft when
nothing it was asked on changed: the same committed tokens, the same tree size, a chain at least as long as
the step scores (a chain's first positions are a chain draft of their own: cut, as every draft is, to the
scheduled length). Anything else (a k lowered to a tree's, memory pressure that dropped drafting, a
preemption) is asked again in the propose phase, as without early asks: the proposer already holds the
committed tokens, so that request carries none. Early drafts no sequence takes are dropped unread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.drafting import Draft, DraftRequest
from verifier_service.scheduler import ScheduledSeq


@dataclass
class EarlyAskStats:
    asked: int = 0  # sequences asked for early
    used: int = 0  # of which the next step took the early draft


@dataclass
class EarlyAsk:
    requests: dict[str, DraftRequest]  # by sequence id
    pending: Any  # the drafter's handle of the sent request (RemoteProposer.send)

    def answers(self, s: ScheduledSeq) -> bool:
        req = self.requests.get(s.seq.seq_id)
        if req is None or not s.samples or s.k <= 0 or req.committed_len != len(s.seq.tokens):
            return False
        if req.max_tree_nodes or s.tree_nodes:
            return (req.k, req.max_tree_nodes) == (s.k, s.tree_nodes)
        return req.k >= s.k

    def drafts_for(
        self, scheduled: list[ScheduledSeq], drafter: Any
    ) -> list[tuple[tuple[ScheduledSeq, DraftRequest], Draft]]:
        """Wait for the early answer; (scheduled sequence, its early request) with its draft, for `scheduled`."""
        by_id = dict(zip(self.requests, drafter.collect(self.pending), strict=True))  # in the order asked
        return [((s, self.requests[s.seq.seq_id]), by_id[s.seq.seq_id]) for s in scheduled]
