"""verify() over a batch: every rule reads only its own row's positions, whatever sits beside it, and the
blocked argmax it reads for greedy rows is torch's argmax, index for index."""

from __future__ import annotations

import copy

import pytest
import torch

from shared.drafting import Draft, SparseProbs
from shared.sampling import ARGMAX_BLOCK, SamplingParams, first_argmax
from verifier_service.sequence import Sequence
from verifier_service.verify import ScoredRow, verify

VOCAB = 3 * ARGMAX_BLOCK + 37  # whole blocks and a tail


def _argmax_cases(vocab: int) -> torch.Tensor:  # [rows, vocab]
    gen = torch.Generator().manual_seed(vocab)
    rows = [torch.randn(vocab, generator=gen) for _ in range(12)]
    tie_across = torch.randn(vocab, generator=gen)  # the same maximum in two blocks: the first block's wins
    tie_across[ARGMAX_BLOCK + 3] = tie_across[5] = 50.0
    tie_inside = torch.randn(vocab, generator=gen)  # two equal maxima in one block, behind a lower one
    tie_inside[2 * ARGMAX_BLOCK + 9] = tie_inside[2 * ARGMAX_BLOCK + 4] = 40.0
    tie_tail = torch.randn(vocab, generator=gen)  # the tail equals the blocks' maximum: the earlier index wins
    tie_tail[vocab - 1] = tie_tail[ARGMAX_BLOCK + 1] = 30.0
    tail_wins = torch.randn(vocab, generator=gen)
    tail_wins[vocab - 2] = 30.0
    nan_late = torch.randn(vocab, generator=gen)  # argmax ranks NaN above everything: the first NaN
    nan_late[vocab - 3] = nan_late[2 * ARGMAX_BLOCK + 1] = float("nan")
    nan_tail = torch.randn(vocab, generator=gen)
    nan_tail[vocab - 1] = float("nan")
    masked = torch.full((vocab,), float("-inf"))  # a grammar that allows nothing: index 0
    some_inf = torch.randn(vocab, generator=gen)
    some_inf[[7, ARGMAX_BLOCK + 7]] = float("inf")
    return torch.stack([*rows, tie_across, tie_inside, tie_tail, tail_wins, nan_late, nan_tail, masked, some_inf])


@pytest.mark.parametrize("vocab", [3 * ARGMAX_BLOCK, VOCAB, 4 * ARGMAX_BLOCK + 1, 49152, 40])
def test_first_argmax_is_torch_argmax(vocab):
    # Under two blocks first_argmax is torch's own argmax.
    logits = torch.randn(6, vocab) if vocab < 2 * ARGMAX_BLOCK else _argmax_cases(vocab)
    assert torch.equal(first_argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(first_argmax(logits[:1]), logits[:1].argmax(dim=-1))


def _row(i: int, params: SamplingParams, k: int, gen: torch.Generator, tree: bool = False, sparse: bool = False):
    seq = Sequence(f"s{i}", [1, 2, 3], params, i)
    seq.generator.manual_seed(100 + i)
    logits = torch.randn(k + 1, VOCAB, generator=gen) * 2
    draft = None
    if k:
        # Drafts that the target often agrees with, so rows accept a varying number of tokens.
        guesses = torch.randint(VOCAB, (k,), generator=gen).tolist()
        tokens = [int(logits[j].argmax()) if j % 2 == 0 else guesses[j] for j in range(k)]
        probs = None
        if sparse:
            ids = torch.stack([torch.tensor([t, (t + 1) % VOCAB, (t + 2) % VOCAB]) for t in tokens])
            probs = SparseProbs(ids, torch.tensor([[0.6, 0.3, 0.1]] * k))
        parents = [-1] + [0] * (k - 1) if tree else None
        draft = Draft(seq.seq_id, 3, tokens, probs, parents=parents)
    return ScoredRow(seq, draft, logits)


def _batch(seed: int) -> list[ScoredRow]:
    gen = torch.Generator().manual_seed(seed)
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.8)
    seeded = SamplingParams(temperature=0.8, seed=7)
    topk = SamplingParams(temperature=1.0, top_k=20)
    return [
        _row(0, greedy, 0, gen),
        _row(1, sampled, 3, gen, sparse=True),
        _row(2, greedy, 4, gen),
        _row(3, seeded, 2, gen),
        _row(4, greedy, 3, gen, tree=True),
        _row(5, topk, 0, gen),
        _row(6, sampled, 4, gen),
        _row(7, greedy, 1, gen),
        _row(8, sampled, 2, gen, tree=True, sparse=True),
    ]


@pytest.mark.parametrize("seed", range(4))
def test_a_mixed_batch_verifies_each_row_as_alone(seed):
    """Greedy chains and trees, sampled (sparse and one-hot drafts, top-k), seeded, k from 0 to 4 in one call:
    each row's verdict and generator state equal those of the row verified by itself."""
    batch = _batch(seed)
    alone = copy.deepcopy(batch)
    together = verify(batch, {}, VOCAB)
    singles = [verify([row], {}, VOCAB)[0] for row in alone]
    assert together == singles
    for a, b in zip(batch, alone, strict=True):
        assert torch.equal(a.seq.generator.get_state(), b.seq.generator.get_state())
    chains = [i for i, r in enumerate(batch) if r.seq.params.is_greedy and r.draft and not r.draft.is_tree]
    for i in chains:  # and the greedy rule itself: accept while the draft is the argmax, then the argmax
        argmax, drafted = batch[i].logits.argmax(-1).tolist(), batch[i].draft.token_ids  # type: ignore[union-attr]
        n = next((j for j, t in enumerate(drafted) if t != argmax[j]), len(drafted))
        assert together[i].tokens == drafted[:n] + [argmax[n]]  # type: ignore[union-attr]


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("bad", [2, 6])  # a greedy row, a sampled row
def test_a_bad_row_fails_alone_in_a_mixed_batch(poison, bad):
    batch = _batch(0)
    batch[bad].logits[-1, 11] = poison
    reference = verify([r for i, r in enumerate(copy.deepcopy(_batch(0))) if i != bad], {}, VOCAB)
    verdicts = verify(batch, {}, VOCAB)
    assert isinstance(verdicts[bad], str) and "not finite at 1 scored position" in verdicts[bad]
    assert [v for i, v in enumerate(verdicts) if i != bad] == reference


def test_rows_split_from_one_scoring_tensor_verify_as_copies_do():
    """The scoring forward's logits arrive as consecutive views of one tensor: verify reads them in place (no
    copy), with the same verdicts as separate tensors, and leaves them unchanged."""
    batch = _batch(1)
    scored = torch.cat([r.logits for r in batch])
    views = scored.split([r.logits.shape[0] for r in batch])
    in_place = [ScoredRow(r.seq, r.draft, v) for r, v in zip(copy.deepcopy(batch), views, strict=True)]
    before = scored.clone()
    assert verify(in_place, {}, VOCAB) == verify(batch, {}, VOCAB)
    assert torch.equal(scored, before)


def test_the_verify_benchmark_runs(capsys):
    from specdec_bench import verify_bench

    verify_bench.main(["--reps", "1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(lines) == len(verify_bench.CASES)


def test_step_phases_reads_the_verifiers_step_histograms():
    from specdec_bench.step_phases import totals

    scraped = {
        ("specdec_step_duration_seconds_sum", ()): 6.5,
        ("specdec_step_duration_seconds_count", ()): 65.0,
        ("specdec_step_duration_seconds_bucket", (("le", "0.1"),)): 40.0,
        ("specdec_step_phase_duration_seconds_sum", (("phase", "score"),)): 6.0,
        ("specdec_step_phase_duration_seconds_count", (("phase", "score"),)): 65.0,
        ("specdec_step_phase_duration_seconds_sum", (("phase", "propose"),)): 0.1,
        ("specdec_drafted_tokens_total", ()): 12.0,
        ("specdec_accepted_tokens_total", ()): 5.0,
    }
    assert totals(scraped) == {
        "step_sum": 6.5, "step_count": 65.0, "score_sum": 6.0, "score_count": 65.0, "propose_sum": 0.1, "drafted": 12.0,
    }  # fmt: skip
