"""Verification: from one scoring pass's logits and the drafts to each row's emitted tokens, exactly.

Per row, by its sampling parameters:
- greedy: accept while the draft equals the target's argmax, then emit the argmax (`greedy_verify`);
- seeded: the token at each output position is fixed by (seed, position, target_probs) (shared/seeded.py), so
  a draft is accepted exactly when it equals that token (`seeded_verify`); no draft probabilities are read;
- sampled: lossless rejection sampling over the drafts' sparse (or one-hot) distributions
  (`rejection_sampler.rejection_sample`).
A token tree is walked from the root by the same three rules (`tree_verify.verify_tree`).
A row whose numbers went bad (NaN or +inf logits, probabilities that are not a distribution) fails alone.
Tensors stay on the model's device; the host reads the bad-row flags and the emitted ids.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from shared.drafting import Draft, SparseProbs
from shared.grammar import mask_logits_
from shared.sampling import SamplingParams, first_argmax, logits_to_probs, params_to_tensors
from shared.seeded import seeded_tokens
from verifier_service.rejection_sampler import greedy_verify, rejection_sample
from verifier_service.sequence import Sequence
from verifier_service.tree_verify import TreeVerdict, verify_tree


@dataclass(frozen=True)
class ScoredRow:
    """One sampling sequence of a step: its draft (None: none this step) and the raw logits of its scored
    positions, the drafts' then the bonus position's."""

    seq: Sequence
    draft: Draft | None
    logits: torch.Tensor  # [k + 1, vocab]


# Per row: the emitted tokens (accepted drafts, then one recovered or bonus token) and the accepted draft
# positions (a chain's first ones; a tree's path), or why the row failed.
Verdict = TreeVerdict


def verify(rows: list[ScoredRow], masks: dict[str, torch.Tensor], vocab_size: int) -> list[Verdict | str]:
    """Per row: its Verdict, or why the row failed.

    `masks`: the allowed tokens of constrained rows at their scored positions ([k + 1, words] bitmasks, keyed by
    seq id), applied to the logits before temperature and truncation, so every rule samples the plain decoder's
    masked distribution; a drafted token the format forbids has target probability 0 and is rejected.

    Each rule reads only what it needs: greedy rows (chains and trees) the argmax of their logits, seeded rows
    their probabilities, sampled chains their probabilities padded to [rows, k_max + 1, vocab]. At batch 8 with
    drafts, building probabilities and padded copies for every row cost 12-23 ms a step on two CPU cores."""
    if not rows:
        return []
    params = [r.seq.params for r in rows]
    num_drafts = torch.tensor([r.logits.shape[0] - 1 for r in rows], dtype=torch.int64)  # [batch] CPU
    counts = num_drafts + 1
    spans = _spans(counts.tolist())  # each row's scored positions among all rows'
    k_max = int(num_drafts.max())
    draft_ids = torch.zeros(len(rows), k_max, dtype=torch.int64)  # [batch, k_max] CPU
    for i, row in enumerate(rows):
        if row.draft is not None and num_drafts[i]:
            draft_ids[i, : int(num_drafts[i])] = torch.tensor(row.draft.token_ids, dtype=torch.int64)
    flat_logits = _joined([r.logits for r in rows])  # [sum(k_i + 1), vocab]: no padding rows scored
    if masks:  # on a copy: the raw logits stay as they were for logprobs
        flat_logits = flat_logits.clone()
        _apply_masks(flat_logits, spans, rows, masks)
    with_probs = [i for i in range(len(rows)) if not params[i].is_greedy]
    probs_of = _probs_of_rows(flat_logits, spans, params, counts, with_probs)  # row -> [k_i + 1, vocab]
    failures = bad_rows(flat_logits, spans, probs_of)
    emitted: list[list[int] | str] = [failures.get(i, "") for i in range(len(rows))]
    trees = {i for i, row in enumerate(rows) if i not in failures and row.draft is not None and row.draft.is_tree}
    live = [i for i in range(len(rows)) if i not in failures and i not in trees]
    for i in [i for i in live if params[i].is_seeded]:
        seed, k, position = params[i].seed, int(num_drafts[i]), rows[i].seq.output_position
        assert seed is not None
        emitted[i] = seeded_verify(probs_of[i], draft_ids[i, :k].tolist(), seed, position)
    results = []
    greedy = [i for i in live if params[i].is_greedy]
    if greedy:
        index = torch.tensor(greedy)
        argmax = _argmax_rows(flat_logits, [spans[i] for i in greedy], k_max)  # [g, k_max + 1]
        results.append((greedy, greedy_verify(argmax, draft_ids[index], num_drafts[index])))
    sampled = [i for i in live if not params[i].is_greedy and not params[i].is_seeded]
    if sampled:
        index = torch.tensor(sampled)
        target_probs = pad_rows([probs_of[i] for i in sampled], k_max + 1)  # [s, k_max + 1, vocab]
        result = rejection_sample(
            target_probs, draft_ids[index],
            sparse_draft_probs([rows[i].draft for i in sampled], draft_ids[index], vocab_size),
            num_drafts[index], [rows[i].seq.generator for i in sampled], check_mass=False,
        )  # fmt: skip
        results.append((sampled, result))
    if results:  # one read of every emitted id
        tokens = torch.cat([r.output_token_ids for _, r in results]).tolist()
        for i, row_tokens in zip([i for group, _ in results for i in group], tokens, strict=True):
            emitted[i] = row_tokens[: row_tokens.index(-1)] if -1 in row_tokens else row_tokens
    verdicts: list[Verdict | str] = [
        tokens if isinstance(tokens, str) else Verdict(tokens, list(range(len(tokens) - 1))) for tokens in emitted
    ]
    for i in sorted(trees):
        row, logits = rows[i], flat_logits[spans[i]]
        assert row.draft is not None
        probs = probs_of.get(i, logits)  # a greedy tree reads only its logits' argmax
        verdicts[i] = verify_tree(logits, probs, row.draft, params[i], row.seq.generator, row.seq.output_position)
    return verdicts


def _spans(lengths: list[int]) -> list[slice]:
    """Consecutive slices of these lengths from 0."""
    ends = list(itertools.accumulate(lengths))
    return [slice(end - n, end) for end, n in zip(ends, lengths, strict=True)]


def _joined(pieces: list[torch.Tensor]) -> torch.Tensor:  # [[n_i, vocab]] -> [sum(n_i), vocab]
    """torch.cat, without its copy where the pieces are consecutive parts of one tensor, as the scoring forward's
    logits split per sequence are (read only here)."""
    first, vocab = pieces[0], pieces[0].shape[-1]
    offset = first.storage_offset()
    for piece in pieces:
        if not piece.is_contiguous() or piece.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return torch.cat(pieces)
        if piece.storage_offset() != offset:
            return torch.cat(pieces)
        offset += piece.numel()
    return first.as_strided((sum(p.shape[0] for p in pieces), vocab), (vocab, 1))


def _probs_of_rows(
    flat_logits: torch.Tensor,  # [sum(counts), vocab]
    spans: list[slice],
    params: list[SamplingParams],
    counts: torch.Tensor,  # [rows]
    wanted: list[int],
) -> dict[int, torch.Tensor]:  # row -> [k_i + 1, vocab]
    """The plain decoder's distribution at the scored positions of the `wanted` rows, one call for them all."""
    if not wanted:
        return {}
    if len(wanted) == len(spans):
        logits = flat_logits
    else:
        positions = torch.cat([torch.arange(spans[i].start, spans[i].stop) for i in wanted])
        logits = flat_logits[positions.to(flat_logits.device)]
    probs = target_probs_of(logits, [params[i] for i in wanted], counts[torch.tensor(wanted)])
    return dict(zip(wanted, probs.split(counts[torch.tensor(wanted)].tolist()), strict=True))


def _argmax_rows(flat_logits: torch.Tensor, spans: list[slice], k_max: int) -> torch.Tensor:  # [rows, k_max + 1]
    """Each row's argmax per scored position (the first maximal index, as transformers' greedy search picks),
    padded with 0 past its positions: no padded copy of the logits."""
    ids = first_argmax(flat_logits)  # [sum over all rows]: cheaper than gathering the greedy rows' logits
    out = torch.zeros(len(spans), k_max + 1, dtype=torch.int64, device=ids.device)
    for row, s in enumerate(spans):
        out[row, : s.stop - s.start] = ids[s]
    return out


def _apply_masks(
    flat_logits: torch.Tensor, spans: list[slice], rows: list[ScoredRow], masks: dict[str, torch.Tensor]
) -> None:
    for span, row in zip(spans, rows, strict=True):
        bitmask = masks.get(row.seq.seq_id)
        if bitmask is not None:
            mask_logits_(flat_logits[span.start : span.start + bitmask.shape[0]], bitmask)


def target_probs_of(
    flat_logits: torch.Tensor,  # [sum(counts), vocab]
    params: list[SamplingParams],
    counts: torch.Tensor,  # [rows]: scored positions per row
) -> torch.Tensor:  # [sum(counts), vocab]
    """The plain decoder's distribution at every scored position."""
    per_row = params_to_tensors(params)
    return logits_to_probs(flat_logits, **{name: t.repeat_interleave(counts) for name, t in per_row.items()})


def seeded_verify(
    target_probs: torch.Tensor,  # [k + 1, vocab]: the row's scored positions, drafts then bonus
    draft_ids: list[int],  # k drafts
    seed: int,
    first_position: int,  # output position (0 = first generated token) of target_probs[0]
) -> list[int]:  # num_accepted + 1 tokens
    """Walk the drafts, emitting the target's seeded token at each position, and stop after the first position
    where the draft differs (or after the bonus position). The tokens are those plain seeded decoding emits,
    whatever was drafted. Noise is drawn lazily: positions after the first mismatch cost nothing."""
    k = len(draft_ids)
    emitted = []
    for j in range(k + 1):
        token = int(seeded_tokens(target_probs[j : j + 1], seed, [first_position + j])[0])
        emitted.append(token)
        if j == k or draft_ids[j] != token:  # the bonus position, or the first mismatch: stop here
            return emitted
    raise AssertionError("unreachable: the bonus position always returns")


def bad_rows(
    flat_logits: torch.Tensor,  # [sum(k_i + 1), vocab]
    spans: list[slice],  # each row's scored positions in flat_logits
    probs_of: dict[int, torch.Tensor],  # row -> [k_i + 1, vocab], the rows that read probabilities
) -> dict[int, str]:
    """Rows whose scored positions have NaN or +inf logits, or probabilities that are not a distribution.
    Checked on the logits for every row: argmax over NaN still yields a token for a greedy row."""
    # NaN and +inf survive a sum (-inf logits are legitimate masks); reductions only, no [.., vocab] masks.
    logit_sums = flat_logits.sum(dim=-1)  # [sum(k_i + 1)]
    bad = (torch.isnan(logit_sums) | (logit_sums == float("inf"))).cpu()
    # fp32 suffices for the mass: the entries are in [0, 1] (no overflow); a row has mass when one is > 0.
    with_probs = sorted(probs_of)
    masses = torch.cat([probs_of[i].sum(dim=-1) for i in with_probs]).cpu() if with_probs else None
    no_mass = (~torch.isfinite(masses) | ~(masses > 0)) if masses is not None else None
    mass_rows = dict(zip(with_probs, _spans([probs_of[i].shape[0] for i in with_probs]), strict=True))
    failures = {}
    for i, span in enumerate(spans):
        row_bad = bad[span]
        if i in mass_rows:
            assert no_mass is not None
            row_bad = row_bad | no_mass[mass_rows[i]]
        positions = int(row_bad.sum())
        if positions:
            failures[i] = (
                f"the model's probabilities for this request were not finite at {positions} scored "
                "position(s); the request was ended, other requests are unaffected"
            )
    return failures


def pad_rows(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """[[n_i, vocab]] -> [len(rows), width, vocab], each row's positions first, zeros after."""
    if all(r.shape[0] == width for r in rows):
        return _joined(rows).view(len(rows), width, rows[0].shape[-1])  # one probability tensor's rows: no copy
    padded = rows[0].new_empty(len(rows), width, rows[0].shape[-1])
    for i, r in enumerate(rows):
        padded[i, : r.shape[0]] = r
        padded[i, r.shape[0] :] = 0.0
    return padded


def sparse_draft_probs(drafts: list[Draft | None], draft_ids: torch.Tensor, vocab_size: int) -> SparseProbs | None:
    """The rows' draft distributions as one padded sparse batch [batch, k_max, n] (CPU, checked), or None when
    every row's drafts are one-hot. A one-hot row is its drafted id with probability 1."""
    supports = [d.probs for d in drafts if d is not None and d.probs is not None]
    if not supports:
        return None
    batch, k_max = draft_ids.shape
    n = max(p.token_ids.shape[-1] for p in supports)
    ids = torch.zeros(batch, k_max, n, dtype=torch.int64)
    probs = torch.zeros(batch, k_max, n, dtype=torch.float32)
    ids[:, :, 0] = draft_ids
    probs[:, :, 0] = 1.0
    for i, draft in enumerate(drafts):
        if draft is not None and draft.probs is not None:
            k, width = draft.probs.token_ids.shape
            ids[i, :k, :width] = draft.probs.token_ids
            probs[i, :k, :width] = draft.probs.probs
            probs[i, :k, width:] = 0.0
    sparse = SparseProbs(ids, probs)
    sparse.check(vocab_size)
    return sparse


def trim(draft: Draft, k: int) -> Draft:
    """A drafter may propose fewer tokens (tree nodes) than asked, never more: extra ones are cut with their
    probs (a tree's later nodes: the ones kept still have their parents)."""
    if len(draft.token_ids) <= k:
        return draft
    probs = draft.probs
    if probs is not None:
        probs = SparseProbs(probs.token_ids[:k], probs.probs[:k])
    parents = draft.parents[:k] if draft.parents is not None else None
    return Draft(draft.seq_id, draft.committed_len, draft.token_ids[:k], probs, parents=parents)
