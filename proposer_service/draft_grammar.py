"""Drafts under the request's format (structured output, shared/grammar.py).

A drafted token the grammar forbids is rejected by the verifier anyway, so drafting one only wastes a draft
position: the drafters propose only grammar-valid tokens instead. Per constrained sequence a `GrammarMatcher`
stands at the end of the committed output, advanced by the output tokens committed since the last request
and rebuilt when the history was rewritten (a resend, a rollback of committed tokens) or the format changed.
The model drafters walk it along their draft (`DraftWalk`), masking their distribution at every position and
rolling the walk back afterwards; the n-gram drafter cuts its run at the first forbidden token and appends
what the format forces next.

Anything wrong with the format (it does not compile, the committed output does not match it, no tokenizer to
compile it with) means no draft for that sequence, never a failed batch: the verifier enforces the format.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from shared.drafting import DraftRequest
from shared.errors import InvalidRequestError
from shared.grammar import GrammarCompiler, GrammarMatcher, StructuredOutput, allowed_tokens

log = logging.getLogger("specdec.proposer")


@dataclass
class _Tracked:
    constraint: StructuredOutput
    output_start: int  # index of the first output token in the committed tokens
    matcher: GrammarMatcher | None  # None: nothing drafted (format not compiled, or output it forbids)
    num_fed: int = 0  # output tokens the matcher has been fed: committed[output_start : output_start + num_fed]


class DraftGrammar:
    """Per-sequence matchers at the end of the committed output. Not thread-safe (one drafter owns it)."""

    def __init__(self, compiler: GrammarCompiler | None) -> None:
        self.compiler = compiler
        self._tracked: dict[str, _Tracked] = {}
        self._warned_no_compiler = False

    def update(self, req: DraftRequest, tokens: list[int]) -> tuple[bool, GrammarMatcher | None]:
        """Follow `req` (its committed tokens are `tokens`, already applied): (may draft, the matcher at the end of
        the committed output, or None when there is nothing to mask: unconstrained, or k = 0). Called for every
        request, so that a rewrite of the history is never missed; a k = 0 request (a prompt chunk being
        ingested, whose output position is not yet meaningful) only drops a matcher the rewrite invalidates,
        and the matcher catches up in the next request that drafts."""
        constraint = req.params.structured_output
        tracked = self._tracked.get(req.seq_id)
        if tracked is not None and (
            constraint != tracked.constraint
            or req.committed_len - len(req.new_token_ids) < tracked.output_start + tracked.num_fed
        ):
            del self._tracked[req.seq_id]  # the format changed, or committed tokens it has read were rewritten
            tracked = None
        if constraint is None or req.k <= 0:
            return True, None
        if self.compiler is None:
            if not self._warned_no_compiler:
                self._warned_no_compiler = True
                log.warning("no tokenizer to compile formats with: sequences with a format are not drafted")
            return False, None
        output_start = req.committed_len - req.draft_position
        if output_start < 0:  # more output than committed tokens: a broken request
            return False, None
        if tracked is None or tracked.output_start != output_start:
            tracked = self._tracked[req.seq_id] = self._start(req.seq_id, constraint, output_start)
        new_output = tokens[output_start + tracked.num_fed :]
        tracked.num_fed += len(new_output)  # read, even where refused: a rewrite of it rebuilds the matcher
        if tracked.matcher is not None:
            try:
                tracked.matcher.consume(new_output)
            except InvalidRequestError:
                log.warning("sequence %s: its committed output does not match its format: not drafted", req.seq_id)
                tracked.matcher = None
        return tracked.matcher is not None, tracked.matcher

    def _start(self, seq_id: str, constraint: StructuredOutput, output_start: int) -> _Tracked:
        assert self.compiler is not None
        try:
            matcher = self.compiler.matcher(constraint)
        except InvalidRequestError as err:  # the verifier refuses the request; here it is only not drafted
            log.warning("sequence %s: format not compiled, not drafted: %s", seq_id, err)
            matcher = None
        return _Tracked(constraint, output_start, matcher)

    def release(self, seq_id: str) -> None:
        self._tracked.pop(seq_id, None)


class DraftWalk:
    """One round of model drafting for a batch: each constrained row's matcher walks along its draft, masking
    the drafter's logits at every position (before any sampling rule: greedy, seeded and sampled drafts all
    come from the masked distribution); leaving the `with` block rolls every matcher back to the committed
    output. A batch with no constrained sequence walks nothing: `mask` and `advance` pass everything through.

    Rows are the batch's sequences (0..len(matchers) - 1); a step passes the logits of some of them."""

    def __init__(self, compiler: GrammarCompiler | None, matchers: list[GrammarMatcher | None]) -> None:
        self.compiler = compiler
        self.matchers = matchers  # all None without a compiler (DraftGrammar.update gives no matcher then)
        self.num_walked = [0] * len(matchers)  # draft tokens each matcher consumed this round
        self.bitmask: torch.Tensor | None = None  # [rows, words] int32, made on the first constrained mask

    def __enter__(self) -> DraftWalk:
        return self

    def __exit__(self, *exc: object) -> None:
        for matcher, num_walked in zip(self.matchers, self.num_walked, strict=True):
            if matcher is not None:
                matcher.rollback(num_walked)
        self.num_walked = [0] * len(self.matchers)

    def mask(
        self, logits: torch.Tensor, rows: list[int], ended: list[bool], subset: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """`logits` [len(rows), width] (line j: row rows[j]; column c: token c, or token subset[c] with a
        vocabulary subset) -> (the logits with what each row's format forbids at -inf, their rows), less the
        lines left with no token at all: those rows' drafts end here (`ended`). Unconstrained lines are passed
        through untouched."""
        lines = [j for j, row in enumerate(rows) if self.matchers[row] is not None]
        if not lines:
            return logits, rows
        assert self.compiler is not None
        if self.bitmask is None:
            self.bitmask = self.compiler.new_bitmask(len(self.matchers))
        constrained = [rows[j] for j in lines]
        for row in constrained:
            matcher = self.matchers[row]
            assert matcher is not None
            matcher.fill_masks([], self.bitmask, row)
        allowed = allowed_tokens(self.bitmask[constrained].to(logits.device), self.compiler.vocab_size)
        allowed = self._columns(allowed, logits.shape[-1], subset)  # [len(lines), width] bool
        index = torch.tensor(lines, dtype=torch.int64, device=logits.device)
        # Out of place: the logits may be inference tensors.
        logits = logits.index_copy(0, index, logits[index].masked_fill(~allowed, float("-inf")))
        alive = [True] * len(rows)
        for j, left in zip(lines, allowed.any(dim=-1).tolist(), strict=True):
            alive[j] = bool(left)
        if all(alive):
            return logits, rows
        for row, left in zip(rows, alive, strict=True):
            ended[row] = ended[row] or not left
        keep = [j for j, left in enumerate(alive) if left]
        return logits[torch.tensor(keep, dtype=torch.int64, device=logits.device)], [rows[j] for j in keep]

    @staticmethod
    def _columns(allowed: torch.Tensor, width: int, subset: torch.Tensor | None) -> torch.Tensor:
        if subset is not None:
            return allowed[:, subset.to(allowed.device)]
        if width <= allowed.shape[-1]:
            return allowed[:, :width]
        # Logits wider than the tokenizer's vocabulary (padded rows): tokens it cannot name are never allowed.
        return torch.nn.functional.pad(allowed, (0, width - allowed.shape[-1]), value=False)

    def advance(self, row: int, token: int) -> tuple[bool, bool]:
        """Walk row's matcher past its drafted token: (keep the token, draft on after it). An end-of-sequence
        is kept and ends the draft; a forbidden token (it was sampled from the masked distribution: only a
        broken mask gets here) is dropped and ends the draft."""
        matcher = self.matchers[row]
        if matcher is None:
            return True, True
        if token in matcher.compiler.eos_token_ids:
            return True, False
        try:
            matcher.consume([token])
        except InvalidRequestError:
            log.error("a drafted token the format forbids was dropped: token %d", token)
            return False, False
        self.num_walked[row] += 1
        return True, True


def draft_walk(grammar: DraftGrammar, matchers: list[GrammarMatcher | None]) -> DraftWalk:
    """This round's walk over the batch's matchers (see DraftWalk); use it as a context manager."""
    return DraftWalk(grammar.compiler, matchers)
