"""`python -m specdec_bench.compile_bench`: the target's forward eager against compiled (`--compile`), in one process.

The same weights loaded twice (a bf16 forward that makes its own products in the graph lays its layers' weights
out again, so the eager one keeps its own), the forward compiled once; the two ways alternate in blocks on the
same cache, so a machine whose speed drifts (this one's moves by 10-20% from one minute to the next) slows both
alike. Two tables: the forward alone (a one-token step and a scoring step of k + 1 = 5 tokens, batch 1 and 8,
~200 tokens of context), and target-only greedy decoding through the engine (the bench's general chat prompts,
batch 1 one prompt after another, and all at once), with the tokens of both ways compared. Ratios are compiled /
eager per pair of neighbouring blocks, medians over pairs.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from shared.malloc_tuning import tune_malloc
from shared.model.build import CacheConfig, load_paged_model
from shared.model.loader import load_model, load_tokenizer
from shared.model.runner import ForwardItem
from shared.sampling import SamplingParams
from shared.settings import default_target_model
from specdec_bench.engine_bench import chat_ids
from specdec_bench.prompts import GENERAL_PROMPTS
from verifier_service.builder import engine_on
from verifier_service.engine import EngineConfig

CONTEXT = 200
FORWARD_CASES = ((1, 1), (1, 5), (8, 1), (8, 5))  # (sequences, tokens each)


def alternate(run, pairs: int, toggle) -> tuple[list[float], list[float]]:
    """Seconds of `run()` eager and compiled, alternating (eager first in even pairs, compiled in odd ones)."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for pair in range(pairs):
        for compiled in (False, True) if pair % 2 == 0 else (True, False):
            toggle(compiled)
            start = time.perf_counter()
            run()
            times[compiled].append(time.perf_counter() - start)
    return times[False], times[True]


def ratio_line(name: str, eager: list[float], compiled: list[float], scale: float, unit: str) -> str:
    ratios = [c / e for e, c in zip(eager, compiled, strict=True)]
    return (
        f"| {name} | {scale * statistics.median(eager):.1f} | {scale * statistics.median(compiled):.1f} | "
        f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f}) | {unit} |"
    )


def forward_table(paged, toggle, pairs: int, steps: int) -> list[str]:
    runner = paged.runner
    tables = [list(range(b * 20, b * 20 + 20)) for b in range(8)]
    for b, table in enumerate(tables):
        runner.forward([ForwardItem(table, 0, [(7 * b + i) % 1000 + 100 for i in range(CONTEXT)], 1)])
    lines = []
    for batch, tokens in FORWARD_CASES:
        items = [ForwardItem(tables[b], CONTEXT, [5] * tokens, tokens) for b in range(batch)]

        def run(items=items) -> None:
            for _ in range(steps):
                runner.forward(items)

        for compiled in (False, True):  # the first call of each way out of the timing
            toggle(compiled)
            runner.forward(items)
        eager, compiled = alternate(run, pairs, toggle)
        lines.append(ratio_line(f"forward, batch {batch}, {tokens} token(s) a sequence", eager, compiled,
                                1e3 / steps, "ms a step"))  # fmt: skip
    return lines


def engine_table(paged, toggle, prompts: list[list[int]], pairs: int, max_tokens: int, which=None) -> list[str]:
    return [engine_row(paged, toggle, prompts, batch, pairs, max_tokens, which) for batch in (1, 8)]


def engine_row(paged, toggle, prompts: list[list[int]], batch: int, pairs: int, max_tokens: int, which=None) -> str:
    """Target-only greedy decoding of every prompt, `batch` at a time, each way; tokens/s and outputs compared.
    `which()`: the way now toggled on (default: whether the runner's model is the compiled one)."""
    which = which or (lambda: paged.runner.model.compiled is not None)
    engine = engine_on(paged, None, EngineConfig(num_speculative_tokens=0, max_num_seqs=8, max_model_len=1024))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outputs: dict[bool, list[list[int]]] = {}
    runs = itertools.count()

    def run() -> None:
        out: dict[str, list[int]] = {}
        names = [f"p{i}-run{next(runs)}" for i in range(len(prompts))]  # request ids are unique per engine
        for start in range(0, len(prompts), batch):
            for name, ids in zip(names[start : start + batch], prompts[start : start + batch], strict=True):
                engine.add_request(name, ids, params)
            while engine.has_unfinished():
                for step_out in engine.step():
                    out.setdefault(step_out.request_id, []).extend(step_out.new_token_ids)
        outputs[which()] = [out[name] for name in names]

    eager, compiled = alternate(run, pairs, toggle)
    tokens = len(prompts) * max_tokens
    same = sum(a == b for a, b in zip(outputs[False], outputs[True], strict=True))
    name = f"engine, target only, batch {batch} ({same}/{len(prompts)} outputs equal)"
    return ratio_line(name, [tokens / e for e in eager], [tokens / c for c in compiled], 1.0, "tokens/s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec_bench.compile_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None)
    parser.add_argument("--pairs", type=int, default=6, help="eager/compiled pairs of blocks per row")
    parser.add_argument("--steps", type=int, default=8, help="forward steps per block")
    parser.add_argument("--max-tokens", type=int, default=48, help="new tokens per prompt in the engine rows")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    tune_malloc()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, dtype = args.target or default_target_model(), getattr(torch, args.dtype)
    eager_model, _ = load_model(target, dtype)
    paged = load_paged_model(target, 8, 2048, 4, CacheConfig(enable_prefix_caching=False), dtype, compile=True)
    compiled_model = paged.runner.model
    eager_model.backend = compiled_model.backend  # the attention the runner picked (the cpu kernel), both ways
    in_graph = compiled_model.compiled is not None and compiled_model.compiled.templates
    print(f"{args.dtype}; products {'in the graph' if in_graph else 'opaque, packed'}")

    def toggle(compiled: bool) -> None:
        paged.runner.model = compiled_model if compiled else eager_model

    started = time.monotonic()
    toggle(True)
    paged.runner.forward([ForwardItem([0], 0, [1, 2], 1)])
    seconds = time.monotonic() - started
    print(f"compiled in {seconds:.0f} s (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    tokenizer = load_tokenizer(target)
    prompts = [chat_ids(tokenizer, p) for p in GENERAL_PROMPTS]
    print("| row | eager | compiled | compiled / eager (range) | unit |")
    print("| --- | ---: | ---: | ---: | --- |")
    for line in forward_table(paged, toggle, args.pairs, args.steps):
        print(line, flush=True)
    for line in engine_table(paged, toggle, prompts, max(2, args.pairs // 2), args.max_tokens):
        print(line, flush=True)


if __name__ == "__main__":
    main()
