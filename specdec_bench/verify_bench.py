"""`python -m specdec_bench.verify_bench`: what verifying one step costs, by batch, draft depth and temperature.

`verifier_service.verify.verify` over random logits shaped as the scoring forward hands them over (one
`[sum(k_i + 1), vocabulary]` tensor split per sequence), the target's vocabulary, drafts that agree with the
argmax at every other position; medians of `--reps` calls after a warm-up, with the services' allocator
settings (`tune_malloc`). The A/B of a change to verification: run it on both sides (a worktree with
`PYTHONPATH` at it for the old side).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from shared.drafting import Draft
from shared.malloc_tuning import tune_malloc
from shared.sampling import SamplingParams
from verifier_service.sequence import Sequence
from verifier_service.verify import ScoredRow, verify

VOCAB = 49152  # the target's (SmolLM2)
CASES = (  # (batch, draft depths cycled over the batch)
    (1, (0,)),
    (1, (4,)),
    (8, (0,)),
    (8, (4,)),
    (8, (0, 1, 2, 4)),
)


def step_rows(batch: int, depths: tuple[int, ...], temperature: float, seed: int = 0) -> list[ScoredRow]:
    gen = torch.Generator().manual_seed(seed)
    ks = [depths[i % len(depths)] for i in range(batch)]
    scored = torch.randn(sum(k + 1 for k in ks), VOCAB, generator=gen) * 3  # the scoring forward's logits
    rows = []
    for i, (k, logits) in enumerate(zip(ks, scored.split([k + 1 for k in ks]), strict=True)):
        seq = Sequence(f"s{i}", [1, 2, 3], SamplingParams(temperature=temperature), i)
        guesses = torch.randint(VOCAB, (k,), generator=gen).tolist()
        tokens = [int(logits[j].argmax()) if j % 2 == 0 else guesses[j] for j in range(k)]
        rows.append(ScoredRow(seq, Draft(seq.seq_id, 3, tokens) if k else None, logits))
    return rows


def time_verify(rows: list[ScoredRow], reps: int) -> float:
    """Median milliseconds of one verify call."""
    verify(rows, {}, VOCAB)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        verify(rows, {}, VOCAB)
        samples.append(time.perf_counter() - start)
    return 1e3 * statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec_bench.verify_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    tune_malloc()
    torch.set_num_threads(args.threads)
    print("| batch | draft depths | ms, greedy | ms, T = 0.8 |\n| ---: | --- | ---: | ---: |")
    for batch, depths in CASES:
        greedy, sampled = (time_verify(step_rows(batch, depths, t), args.reps) for t in (0.0, 0.8))
        print(f"| {batch} | {', '.join(map(str, depths))} | {greedy:.2f} | {sampled:.2f} |")


if __name__ == "__main__":
    main()
