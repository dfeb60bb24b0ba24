"""`python -m specdec_bench.tiles_bench --dtype bfloat16|float32`: products through our tiled kernel
(shared/model/tiles.py) against oneDNN's, in one process.

Three tables, the two ways alternating in blocks (a machine whose speed drifts slows both alike), ratios per pair
of neighbouring blocks, medians over pairs: a step's products alone (the target's 121 weights, each read from
memory as in a real step, at 1-40 rows and at prefill chunks of 128 and 512), the eager forward (a one-token step
and a scoring step of 5 tokens, batch 1 and 8, ~200 tokens of context: compile_bench's rows), and target-only
greedy decoding through the engine. The target is loaded twice, once with each packing; the runner's model is
swapped between blocks, on one cache. It runs where pack_weight tiles the dtype's weights (parallel.takes_tiles).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from shared.malloc_tuning import tune_malloc
from shared.model import tiles
from shared.model.build import CacheConfig, load_paged_model
from shared.model.loader import load_model, load_tokenizer
from shared.model.parallel import ColumnParallelLinear, RowParallelLinear, linear
from shared.settings import default_target_model
from specdec_bench.compile_bench import alternate, engine_table, forward_table
from specdec_bench.engine_bench import chat_ids
from specdec_bench.prompts import GENERAL_PROMPTS

ROWS = (1, 4, 8, 16, 40, 128, 512)  # decoding and scoring steps, then prefill chunks


def load(target: str, dtype: torch.dtype, tiled: bool):
    """(model, arch): the target in `dtype`, its weights tiled for our kernel or packed for oneDNN."""
    switch = tiles.SWITCHES[dtype]
    os.environ[switch] = "1" if tiled else "0"
    tiles.enabled.cache_clear()
    try:
        return load_model(target, dtype)
    finally:
        os.environ.pop(switch)
        tiles.enabled.cache_clear()


def weights(model) -> list[torch.Tensor]:
    linears = [m.weight for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    return linears + [model.packed_lm_head if model.packed_lm_head is not None else model.lm_head_weight]


def products_table(models: dict[bool, torch.nn.Module], dtype: torch.dtype, pairs: int) -> list[str]:
    by_way = {tiled: weights(model) for tiled, model in models.items()}
    widths = [in_width(w) for w in by_way[False]]
    gen = torch.Generator().manual_seed(0)
    way = {"tiles": False}

    def toggle(tiled: bool) -> None:
        way["tiles"] = tiled

    lines = []
    for rows in ROWS:
        inputs = {w: torch.randn(rows, w, generator=gen).to(dtype) for w in set(widths)}

        def step(inputs=inputs) -> None:
            for weight, width in zip(by_way[way["tiles"]], widths, strict=True):
                linear(inputs[width], weight)

        for tiled in (False, True):  # the first call of each way out of the timing
            toggle(tiled)
            step()
        onednn, tiled = alternate(step, pairs, toggle)
        ratios = [t / o for o, t in zip(onednn, tiled, strict=True)]
        lines.append(
            f"| a step's {len(widths)} products, {rows} row(s) | {1e3 * statistics.median(onednn):.2f} | "
            f"{1e3 * statistics.median(tiled):.2f} | {statistics.median(ratios):.3f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}) | ms |"
        )
    return lines


def in_width(weight: torch.Tensor) -> int:
    """A packed weight's input width: tiled, for oneDNN (dense size kept) or plain."""
    if tiles.is_packed(weight):
        return tiles.in_features(weight)
    return int(weight.to_dense().shape[1]) if weight.is_mkldnn else int(weight.shape[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec_bench.tiles_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--pairs", type=int, default=6, help="oneDNN/tiles pairs of blocks per row")
    parser.add_argument("--steps", type=int, default=8, help="forward steps per block")
    parser.add_argument("--max-tokens", type=int, default=48, help="new tokens per prompt in the engine rows")
    args = parser.parse_args(argv)
    tune_malloc()
    dtype = getattr(torch, args.dtype)
    if tiles.load_kernel() is None:
        raise SystemExit("the product kernel could not be built here (no C++ compiler?)")
    target = args.target or default_target_model()
    loaded = {tiled: load(target, dtype, tiled) for tiled in (False, True)}
    models = {tiled: model for tiled, (model, _) in loaded.items()}
    if not tiles.is_packed(weights(models[True])[0]):
        raise SystemExit(f"pack_weight does not tile {args.dtype} weights on this CPU (parallel.takes_tiles)")
    print(f"{args.dtype}, {torch.get_num_threads()} threads")
    paged = load_paged_model(loaded[False], 8, 2048, 4, CacheConfig(enable_prefix_caching=False), dtype)
    models[True].backend = models[False].backend  # the attention the runner picked, for both ways
    current = {"tiles": False}

    def toggle(tiled: bool) -> None:
        current["tiles"] = tiled
        paged.runner.model = models[tiled]

    print("| row | oneDNN | tiles | tiles / oneDNN (range) | unit |")
    print("| --- | ---: | ---: | ---: | --- |")
    started = time.monotonic()
    for line in products_table(models, dtype, args.pairs):
        print(line, flush=True)
    for line in forward_table(paged, toggle, args.pairs, args.steps):
        print(line, flush=True)
    prompts = [chat_ids(load_tokenizer(target), p) for p in GENERAL_PROMPTS]
    for line in engine_table(
        paged, toggle, prompts, max(2, args.pairs // 2), args.max_tokens, lambda: current["tiles"]
    ):
        print(line, flush=True)
    print(f"({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
