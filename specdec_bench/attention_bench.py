"""`python -m specdec_bench.attention_bench`: the cpu attention kernel against the torch backend, in one process.

One paged target (eager, or compiled with `--compile`); its attention backend swapped between the cpu kernel
(shared/model/paged_kernel.cpp, what `auto` picks on a CPU) and the torch backend (gather + SDPA), alternating in
blocks on the same cache, so a machine whose speed drifts slows both alike. The forward alone (one-token and
k + 1 = 5 token steps at batch 1 and 8 over ~200 tokens of context, and prefill chunks of 200 and 1,000 tokens),
then target-only greedy decoding through the engine with the tokens of both ways compared. Ratios are cpu / torch
per pair of neighbouring blocks (times: under 1 is faster; tokens/s: over 1 is faster), medians over pairs.
"""

from __future__ import annotations

import argparse
import time

import torch

from shared.malloc_tuning import tune_malloc
from shared.model.attention import TorchPagedAttention
from shared.model.build import CacheConfig, load_paged_model
from shared.model.loader import load_tokenizer
from shared.model.runner import ForwardItem
from shared.settings import default_target_model
from specdec_bench.compile_bench import alternate, engine_table, forward_table, ratio_line
from specdec_bench.engine_bench import chat_ids
from specdec_bench.prompts import GENERAL_PROMPTS

PREFILLS = (200, 1000)


def prefill_rows(paged, toggle, pairs: int) -> list[str]:
    lines = []
    table = list(range(100, 100 + -(-max(PREFILLS) // paged.runner.cache.block_size)))
    for tokens in PREFILLS:
        item = ForwardItem(table, 0, [(7 * i) % 1000 + 100 for i in range(tokens)], 1)

        def run(item=item) -> None:
            paged.runner.forward([item])

        for on in (False, True):
            toggle(on)
            run()
        torch_times, cpu_times = alternate(run, pairs, toggle)
        lines.append(ratio_line(f"prefill, {tokens} tokens", torch_times, cpu_times, 1e3, "ms"))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m specdec_bench.attention_bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--target", default=None)
    parser.add_argument("--pairs", type=int, default=6, help="torch/cpu pairs of blocks per row")
    parser.add_argument("--steps", type=int, default=8, help="forward steps per block")
    parser.add_argument("--max-tokens", type=int, default=48, help="new tokens per prompt in the engine rows")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--compile", action="store_true", help="the compiled forward (specdec-verifier --compile)")
    args = parser.parse_args(argv)
    tune_malloc()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, dtype = args.target or default_target_model(), getattr(torch, args.dtype)
    cache = CacheConfig(enable_prefix_caching=False, attention_backend="cpu")
    paged = load_paged_model(target, 8, 2048, 4, cache, dtype, compile=args.compile)
    model = paged.runner.model
    kernel, gather_sdpa = model.backend, TorchPagedAttention()

    def toggle(on: bool) -> None:
        model.backend = kernel if on else gather_sdpa  # the compiled forward reads it at each call too

    print(f"{args.dtype}, {'compiled' if args.compile else 'eager'} forward, {torch.get_num_threads()} threads")
    started = time.monotonic()
    paged.runner.forward([ForwardItem([0], 0, [1, 2], 1)])
    print(f"first step in {time.monotonic() - started:.0f} s")
    prompts = [chat_ids(load_tokenizer(target), p) for p in GENERAL_PROMPTS]
    print("| row | torch (gather + SDPA) | cpu kernel | cpu / torch (range) | unit |")
    print("| --- | ---: | ---: | ---: | --- |")
    for line in forward_table(paged, toggle, args.pairs, args.steps):
        print(line, flush=True)
    for line in prefill_rows(paged, toggle, args.pairs):
        print(line, flush=True)
    pairs = max(2, args.pairs // 2)
    for line in engine_table(paged, toggle, prompts, pairs, args.max_tokens, lambda: model.backend is kernel):
        print(line, flush=True)


if __name__ == "__main__":
    main()
