"""Hot-path section (issue 16): verification cost under production sampling settings, and a mixed
prefill + decode step, each beside the code it replaced ("before", loaded from a git ref: by default the
commit before issue 16).

    python -m specdec_bench.hotpath_bench [--reps 7] [--baseline-ref bd92109]

Verify: batch 8, k = 4, the real target's logits at 5 positions inside each of 8 general prompts' text,
sparse sampled drafts (top 64, as the proposer sends them; one-hot for greedy); target probabilities +
verification, median of --reps.
Mixed step: one 1,024-token prefill chunk + 7 decodes in one forward, against the chunk alone + the decodes
alone; "before" pads every query to the chunk (attention split off)."""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import shared.model.attention as attention
from shared.drafting import Draft, SparseProbs
from shared.model.build import CacheConfig, make_runner
from shared.model.loader import load_model, load_tokenizer
from shared.model.runner import ForwardItem
from shared.sampling import SamplingParams, logits_to_probs, params_to_tensors
from shared.settings import default_target_model
from specdec_bench.prompts import GENERAL_PROMPTS
from verifier_service.rejection_sampler import greedy_verify, rejection_sample

BATCH, K, TOP_N = 8, 4, 64
SETTINGS = {
    "T=0.8": SamplingParams(temperature=0.8),
    "T=0.8 top_p=0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "T=0.8 top_p=0.95 top_k=50": SamplingParams(temperature=0.8, top_p=0.95, top_k=50),
    "greedy": SamplingParams(),
}


def load_ref(ref: str, path: str, name: str):
    """A module as it is at git `ref` (the 'before' side), imported under `name`."""
    source = subprocess.run(["git", "show", f"{ref}:{path}"], capture_output=True, text=True, check=True).stdout
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def median_ms(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def target_logits(runner, tokenizer) -> torch.Tensor:  # [BATCH, K + 1, vocab]
    """The target's logits at 5 consecutive positions inside each general prompt's text: natural-language
    next-token distributions, as a decode step meets them."""
    rows = []
    for i, prompt in enumerate(GENERAL_PROMPTS[:BATCH]):
        tokens = list(tokenizer(prompt).input_ids)
        table = list(range(i * 4, (i + 1) * 4))
        logits = runner.forward([ForwardItem(table, 0, tokens, len(tokens))])[0]  # [len, vocab]
        start = max(0, len(tokens) // 2 - 2)
        rows.append(logits[start : start + K + 1])
    return torch.stack(rows)


def sparse_drafts(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, list[Draft]]:
    gen = torch.Generator().manual_seed(1)
    probs = logits_to_probs(logits[:, :K].reshape(-1, logits.shape[-1]), **params_to_tensors([params] * BATCH * K))
    top = probs.topk(TOP_N, dim=-1)
    top_probs = (top.values / top.values.sum(-1, keepdim=True)).view(BATCH, K, TOP_N)
    top_ids = top.indices.view(BATCH, K, TOP_N)
    picks = torch.multinomial(top_probs.view(-1, TOP_N), 1, generator=gen).view(BATCH, K)
    ids = top_ids.gather(-1, picks.unsqueeze(-1)).squeeze(-1)
    drafts = [Draft(str(i), 0, ids[i].tolist(), SparseProbs(top_ids[i], top_probs[i])) for i in range(BATCH)]
    return ids, drafts


def verify_times(logits: torch.Tensor, reps: int, before_sampling, before_rejection) -> dict[str, tuple[float, float]]:
    out = {}
    for label, params in SETTINGS.items():
        before, after = verify_calls(logits, params, before_sampling, before_rejection)
        out[label] = (median_ms(before, reps), median_ms(after, reps))
    return out


def verify_calls(logits: torch.Tensor, params: SamplingParams, before_sampling, before_rejection):
    """(before, after): the target probabilities + verification of one step, main's code and this code."""
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)  # [BATCH * (K + 1), vocab]
    num = torch.full((BATCH,), K)
    tensors = params_to_tensors([params] * BATCH * (K + 1))
    # Greedy requests get greedy (one-hot) drafts in the engine; sampled ones the draft's top-64 support.
    ids, drafts = sparse_drafts(logits, params if not params.is_greedy else SamplingParams(temperature=1.0))
    token_ids = torch.stack([d.probs.token_ids for d in drafts if d.probs is not None])
    sparse = SparseProbs(token_ids, torch.stack([d.probs.probs for d in drafts if d.probs is not None]))

    def after() -> None:
        probs = logits_to_probs(flat, **tensors).view(BATCH, K + 1, vocab)
        gens = [torch.Generator().manual_seed(i) for i in range(BATCH)]
        if params.is_greedy:
            greedy_verify(flat.view(BATCH, K + 1, vocab).argmax(-1), ids, num).output_token_ids.tolist()
        else:
            rejection_sample(probs, ids, sparse, num, gens, check_mass=False).output_token_ids.tolist()

    def before() -> None:  # main: full-sort truncation, dense draft tensors, the dense rejection sampler
        probs = before_sampling.logits_to_probs(flat, **tensors).view(BATCH, K + 1, vocab)
        if params.is_greedy:
            dense = before_rejection.one_hot_draft_probs(ids, vocab)
        else:
            dense = before_rejection.sparse_to_dense_draft_probs(sparse.token_ids, sparse.probs, vocab)
        gens = [torch.Generator().manual_seed(i) for i in range(BATCH)]
        before_rejection.rejection_sample(probs, ids, dense, num, gens).output_token_ids.tolist()

    return before, after


def mixed_step_times(model_arch, reps: int) -> dict[str, float]:
    model, arch = model_arch
    gen = torch.Generator().manual_seed(2)
    runner = make_runner(model, arch, num_blocks=8 * 72, cache=CacheConfig(block_size=16, attention_backend="torch"))
    tables = [list(range(i * 72, (i + 1) * 72)) for i in range(8)]  # 1,152 tokens each
    histories = [torch.randint(0, arch.vocab_size, (60 + 20 * i,), generator=gen).tolist() for i in range(7)]
    for table, history in zip(tables[1:], histories, strict=True):
        runner.forward([ForwardItem(table, 0, history, 0)])
    chunk = ForwardItem(tables[0], 0, torch.randint(0, arch.vocab_size, (1024,), generator=gen).tolist(), 1)
    decodes = [ForwardItem(t, len(h), [1], 1) for t, h in zip(tables[1:], histories, strict=True)]
    split = attention.SHORT_QUERY
    times = {
        "prefill alone": median_ms(lambda: runner.forward([chunk]), reps),
        "decodes alone": median_ms(lambda: runner.forward(decodes), reps),
        "mixed (after: split)": median_ms(lambda: runner.forward([chunk, *decodes]), reps),
    }
    attention.SHORT_QUERY = 1 << 30  # before: one call, every query padded to the chunk
    try:
        times["mixed (before: padded)"] = median_ms(lambda: runner.forward([chunk, *decodes]), reps)
    finally:
        attention.SHORT_QUERY = split
    return times


# The last commit before issue 16 changed the sampler and the verification: "before" stays that code once
# the change is on main (a default of `main` would compare the new code with itself).
BEFORE_ISSUE_16 = "bd92109"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--baseline-ref", default=BEFORE_ISSUE_16, help="git ref whose sampler is the 'before' side (%(default)s)"
    )
    parser.add_argument("--skip-mixed", action="store_true")
    args = parser.parse_args(argv)
    before_sampling = load_ref(args.baseline_ref, "shared/sampling.py", "before_sampling")
    before_rejection = load_ref(args.baseline_ref, "verifier_service/rejection_sampler.py", "before_rejection")
    model, arch = load_model(default_target_model())
    runner = make_runner(model, arch, num_blocks=64, cache=CacheConfig(block_size=16, attention_backend="torch"))
    logits = target_logits(runner, load_tokenizer(default_target_model()))
    print(f"verify, batch {BATCH}, k = {K}, vocabulary {arch.vocab_size}, torch threads {torch.get_num_threads()}")
    print("| setting | before (ms) | after (ms) |\n|---|---:|---:|")
    for label, (before, after) in verify_times(logits, args.reps, before_sampling, before_rejection).items():
        print(f"| {label} | {before:.1f} | {after:.1f} |")
    if not args.skip_mixed:
        times = mixed_step_times((model, arch), args.reps)
        print("\nmixed step: one 1,024-token prefill chunk + 7 decodes\n| forward | ms |\n|---|---:|")
        for label, ms in times.items():
            print(f"| {label} | {ms:.1f} |")
        alone = times["prefill alone"] + times["decodes alone"]
        print(f"| ratio after / (prefill + decodes alone) | {times['mixed (after: split)'] / alone:.2f}x |")
        print(f"| ratio before / (prefill + decodes alone) | {times['mixed (before: padded)'] / alone:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
