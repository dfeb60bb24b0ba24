"""Structured output in the engine's step: each constrained sequence's allowed tokens at every scored position.

The masks are computed in a worker thread while the target scores (`start` after the propose phase, `finish`
before verification), walking each sequence's grammar matcher along its draft and rolling it back; the
matcher then consumes the tokens the step emitted (`advance`). The mask compute time and the time
verification waited for it are reported as `MaskTiming`.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from shared.drafting import Draft
from shared.errors import InvalidRequestError
from shared.grammar import GrammarCompiler
from verifier_service.sequence import Sequence


@dataclass(frozen=True)
class MaskTiming:
    """The grammar masks of one step (time.perf_counter values): computed in a worker thread from `start` to
    `end` while the target scored, and how long verification then `waited` for them."""

    start: float
    end: float
    waited: float
    rows: int  # scored positions masked


class GrammarMasks:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._worker: ThreadPoolExecutor | None = None
        self.last: MaskTiming | None = None  # of the last step that masked, for telemetry

    def start(self, rows: list[tuple[Sequence, Draft | None]]) -> Future | None:
        """Per constrained sequence that samples this step: the tokens its format allows at each scored position
        along its draft ([k + 1, words] bitmask). None when no sequence has a format."""
        rows = [(seq, draft) for seq, draft in rows if seq.grammar is not None]
        if not rows:
            return None
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return self._worker.submit(self._compute, rows)

    def _compute(self, rows: list[tuple[Sequence, Draft | None]]) -> tuple[dict[str, torch.Tensor], float, float]:
        start = time.perf_counter()
        masks = {}
        for seq, draft in rows:
            draft_ids = draft.token_ids if draft is not None else []
            bitmask = self.compiler.new_bitmask(len(draft_ids) + 1)  # [k + 1, words]: a tree's root and nodes
            assert seq.grammar is not None
            eos_ends = not seq.params.ignore_eos  # else a drafted EOS is emitted and decoding goes on past it
            if draft is not None and draft.parents is not None:
                seq.grammar.fill_tree_masks(draft_ids, draft.parents, bitmask, eos_ends=eos_ends)  # along each path
            else:
                seq.grammar.fill_masks(draft_ids, bitmask, eos_ends=eos_ends)
            masks[seq.seq_id] = bitmask
        return masks, start, time.perf_counter()

    def finish(self, job: Future | None) -> dict[str, torch.Tensor]:
        if job is None:
            return {}
        wait_start = time.perf_counter()
        masks, start, end = job.result()
        rows = sum(m.shape[0] for m in masks.values())
        self.last = MaskTiming(start, end, time.perf_counter() - wait_start, rows)
        return masks


def advance(seq: Sequence, emitted: list[int]) -> str | None:
    """Move a constrained sequence's matcher past its emitted tokens; why it failed, or None. The masks allowed
    only such tokens, so a mismatch is an internal fault: the caller ends that request alone."""
    if seq.grammar is None:
        return None
    try:
        seq.grammar.consume(emitted)
    except InvalidRequestError as err:
        return f"structured output: {err}"
    return None
