"""`python -m specdec_bench.kernel_bench --baseline OLD.cpp`: two builds of the cpu attention kernel, call by call.

The kernel as it is now (shared/model/paged_kernel.cpp) against another version of its source (for instance
`git show HEAD~1:shared/model/paged_kernel.cpp > /tmp/old.cpp`), both built as the service builds it. Each shape
(sequences, context tokens, new rows a sequence) runs a step's worth of calls: one per layer, each on its own
cache, so the keys and values come from memory as in a real step (30 layers of a batch's cache outgrow the
last-level cache) rather than from a cache the previous call warmed. The builds alternate in blocks; ratios are
new / baseline per pair of neighbouring blocks (under 1: faster), medians over pairs. `bit-equal` says whether the
two builds' outputs agree in every bit on the shape's calls: a change that only moves time must keep it so.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from shared.model.attention import SeqSpan, build_metadata
from shared.model.cpu_attention import CpuPagedAttention, load_kernel
from specdec_bench.compile_bench import alternate

# (sequences, context tokens, new rows a sequence): decode and k + 1 = 5 scoring rows at batch 1 and 8, a prefill
SHAPES = ((1, 170, 1), (8, 170, 1), (1, 170, 5), (8, 170, 5), (1, 0, 200))
BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM = 16, 9, 3, 64  # the default target's attention (SmolLM2-135M)


def step_inputs(shape: tuple[int, int, int], dtype: torch.dtype, layers: int):
    """A step's queries, metadata and one cache per layer for `shape`, from a fixed seed: both builds read them."""
    batch, context, rows = shape
    generator = torch.Generator().manual_seed(0)
    per_seq = -(-(context + rows) // BLOCK_SIZE)
    cache_shape = (batch * per_seq + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=generator).to(dtype)

    caches = [(randn(*cache_shape), randn(*cache_shape)) for _ in range(layers)]
    spans = [SeqSpan(list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)), context, rows) for b in range(batch)]
    q = randn(batch * rows, HEADS, HEAD_DIM)  # [T, heads, D]
    return q, caches, build_metadata(spans, BLOCK_SIZE, kernel=True)


def shape_row(old: CpuPagedAttention, new: CpuPagedAttention, shape, dtype: torch.dtype, args) -> str:
    """The table's row for one shape: the two builds on the same inputs, alternating in blocks."""
    q, caches, meta = step_inputs(shape, dtype, args.layers)
    scale = HEAD_DIM**-0.5
    equal = all(torch.equal(old(q, *kv, meta, scale), new(q, *kv, meta, scale)) for kv in caches[:3])
    kernel = [old]

    def toggle(use_new: bool) -> None:
        kernel[0] = new if use_new else old

    def block() -> None:
        for _ in range(args.steps):
            for k_cache, v_cache in caches:
                kernel[0](q, k_cache, v_cache, meta, scale)

    for use_new in (False, True):  # warm both
        toggle(use_new)
        block()
    old_times, new_times = alternate(block, args.pairs, toggle)
    per_call = 1e6 / (args.steps * args.layers)
    ratios = [n / o for o, n in zip(old_times, new_times, strict=True)]
    return (
        f"| {str(dtype).removeprefix('torch.')} | {shape[0]} | {shape[1]} | {shape[2]} | "
        f"{per_call * statistics.median(old_times):.1f} | {per_call * statistics.median(new_times):.1f} | "
        f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | {equal} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec_bench.kernel_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="another version of paged_kernel.cpp to build and time")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--layers", type=int, default=30, help="calls (each on its own cache) per timed step")
    parser.add_argument("--pairs", type=int, default=8, help="baseline/new pairs of blocks per shape")
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    new_lib, old_lib = load_kernel(), load_kernel(Path(args.baseline).resolve())
    if new_lib is None or old_lib is None:
        raise SystemExit("a kernel could not be built (no C++ compiler, or a build error: see the log above)")
    new, old = CpuPagedAttention(new_lib), CpuPagedAttention(old_lib)
    print(f"{torch.get_num_threads()} threads, {args.layers} layers' caches a step, {args.pairs} pairs")
    print("| dtype | sequences | context | rows a sequence | baseline us a call | new us a call | new / baseline "
          "(range) | bit-equal |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        for shape in SHAPES:
            print(shape_row(old, new, shape, dtype, args), flush=True)


if __name__ == "__main__":
    main()
