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

from dataclasses import dataclass

import torch

from shared.drafting import Draft, SparseProbs
from shared.grammar import mask_logits_
from shared.sampling import SamplingParams, logits_to_probs, params_to_tensors
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
    masked distribution; a drafted token the format forbids has target probability 0 and is rejected."""
    if not rows:
        return []
    params = [r.seq.params for r in rows]
    num_drafts = torch.tensor([r.logits.shape[0] - 1 for r in rows], dtype=torch.int64)  # [batch] CPU
    k_max = int(num_drafts.max())
    draft_ids = torch.zeros(len(rows), k_max, dtype=torch.int64)  # [batch, k_max] CPU
    for i, row in enumerate(rows):
        if row.draft is not None and num_drafts[i]:
            draft_ids[i, : int(num_drafts[i])] = torch.tensor(row.draft.token_ids, dtype=torch.int64)
    flat_logits = torch.cat([r.logits for r in rows])  # [sum(k_i + 1), vocab]: no padding rows scored
    if masks:  # a copy: the raw logits stay as they were for logprobs
        _apply_masks(flat_logits, rows, num_drafts, masks)
    flat_probs = target_probs_of(flat_logits, params, num_drafts + 1)
    target_logits = pad_rows(flat_logits, num_drafts + 1, k_max + 1)  # [batch, k_max + 1, vocab]
    target_probs = pad_rows(flat_probs, num_drafts + 1, k_max + 1)  # [batch, k_max + 1, vocab]
    failures = bad_rows(target_logits, target_probs, num_drafts)
    emitted: list[list[int] | str] = [failures.get(i, "") for i in range(len(rows))]
    trees = {i for i, row in enumerate(rows) if i not in failures and row.draft is not None and row.draft.is_tree}
    live = [i for i in range(len(rows)) if i not in failures and i not in trees]
    for i in [i for i in live if params[i].is_seeded]:
        seed, k, position = params[i].seed, int(num_drafts[i]), rows[i].seq.output_position
        assert seed is not None
        emitted[i] = seeded_verify(target_probs[i, : k + 1], draft_ids[i, :k].tolist(), seed, position)
    results = []
    greedy = [i for i in live if params[i].is_greedy]
    if greedy:
        index = torch.tensor(greedy)
        argmax = target_logits[index.to(target_logits.device)].argmax(dim=-1)  # [g, k_max + 1]
        results.append((greedy, greedy_verify(argmax, draft_ids[index], num_drafts[index])))
    sampled = [i for i in live if not params[i].is_greedy and not params[i].is_seeded]
    if sampled:
        index = torch.tensor(sampled)
        result = rejection_sample(
            target_probs[index.to(target_probs.device)], draft_ids[index],
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
        row, n = rows[i], int(num_drafts[i]) + 1
        assert row.draft is not None
        verdicts[i] = verify_tree(
            target_logits[i, :n], target_probs[i, :n], row.draft, params[i], row.seq.generator, row.seq.output_position
        )
    return verdicts


def _apply_masks(
    flat_logits: torch.Tensor, rows: list[ScoredRow], num_drafts: torch.Tensor, masks: dict[str, torch.Tensor]
) -> None:
    starts = (torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)).tolist()
    for i, row in enumerate(rows):
        bitmask = masks.get(row.seq.seq_id)
        if bitmask is not None:
            mask_logits_(flat_logits[starts[i] : starts[i] + bitmask.shape[0]], bitmask)


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
    target_logits: torch.Tensor,  # [batch, k_max + 1, vocab]
    target_probs: torch.Tensor,  # [batch, k_max + 1, vocab]
    num_drafts: torch.Tensor,  # [batch]
) -> dict[int, str]:
    """Rows whose scored positions have NaN or +inf logits, or probabilities that are not a distribution.
    Checked on the logits too: argmax over NaN still yields a one-hot 'greedy' row."""
    failures = {}
    # NaN and +inf survive a sum (-inf logits are legitimate masks); two reductions, no [.., vocab] masks.
    logit_sums = target_logits.sum(dim=-1)  # [batch, k_max + 1]
    mass = target_probs.sum(dim=-1, dtype=torch.float64)  # [batch, k_max + 1]
    bad = torch.isnan(logit_sums) | (logit_sums == float("inf")) | ~torch.isfinite(mass) | ~(mass > 0)
    for i in bad.any(dim=-1).nonzero().flatten().tolist():
        positions = bad[i, : int(num_drafts[i]) + 1].nonzero().flatten().tolist()
        if positions:
            failures[i] = (
                f"the model's probabilities for this request were not finite at {len(positions)} scored "
                "position(s); the request was ended, other requests are unaffected"
            )
    return failures


def pad_rows(flat: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """[sum(counts), vocab] -> [len(counts), width, vocab], each row's positions first, zeros after."""
    if bool((counts == width).all()):
        return flat.view(len(counts), width, flat.shape[-1])
    padded = flat.new_zeros(len(counts) * width, flat.shape[-1])
    index = torch.cat([torch.arange(n) + i * width for i, n in enumerate(counts.tolist())])
    padded[index.to(flat.device)] = flat
    return padded.view(len(counts), width, flat.shape[-1])


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
