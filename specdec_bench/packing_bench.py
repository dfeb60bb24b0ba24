"""Packed against plain linear weights (shared/model/parallel.py: pack_weight): the real target's forward
with q new tokens per sequence, batch 1 and 8, both models loaded from the same tensors and timed in
alternation, medians of --rounds rounds of --reps forwards. Prints a Markdown table (docs/BENCHMARKS.md,
"Packed weights"). --dtypes adds half-precision models (plain: torch's own bf16 / fp16 products; packed: oneDNN's
half kernels where the CPU has them, else fp32 copies of the weights, shared/model/parallel.py) to the same
alternation; on an Intel CPU, whose fp32 weights are packed for MKL's sgemm (shared/model/mkl_product.py), the
same weights packed for oneDNN beside them; on a CPU whose bf16 oneDNN emulates (AVX-512 without BF16), bf16
packed in bf16 too, the layout the packing does not choose there; on one with bf16 instructions, the bf16-packed
weights in one product call of any size beside the blocks of 16 rows that `linear` runs with AMX
(parallel.HALF_BLOCK_ROWS, bf16_in_blocks).

    python -m specdec_bench.packing_bench [--rounds 5] [--reps 5] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext
from unittest import mock

import torch

from shared.malloc_tuning import tune_malloc
from shared.model import mkl_product, parallel
from shared.model.config import ModelArch
from shared.model.loader import ModelSource, build_model, load_hf_config, load_state_dict, load_tokenizer
from shared.settings import default_target_model
from specdec_bench.engine_bench import chat_ids, time_forward
from specdec_bench.prompts import GENERAL_PROMPTS
from specdec_bench.report import load_average, run_meta

QUERY_LENS = (1, 2, 3, 5, 7)


def emulated_bf16() -> bool:
    """oneDNN takes bf16 weights on this CPU, but without bf16 instructions (parallel.bf16_instructions): the row
    the packing then leaves out (fp32 copies instead) is timed beside the others, to show why."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and not parallel.bf16_instructions()


# With AMX `linear` runs bf16 products in blocks of a fixed row count (parallel.HALF_BLOCK_ROWS, bf16_in_blocks); this
# row times the same weights in one call of any size, the layout that change left, to show what the blocks cost.
ONE_CALL = "bf16 packed, one call of any size (not taken)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="float32", help="comma-separated: float32, bfloat16, float16")
    args = parser.parse_args(argv)
    started, load_start = time.monotonic(), load_average()
    tune_malloc()
    torch.set_num_threads(args.threads)
    name = default_target_model()
    source = ModelSource.resolve(name)
    arch = ModelArch.from_hf_config(load_hf_config(source))
    state = load_state_dict(source)
    models = {}
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        short = {"float32": "", "bfloat16": "bf16 ", "float16": "fp16 "}[dtype_name]
        models[f"{short}plain"] = build_model(arch, state, dtype, pack=False)
        models[f"{short}packed"] = build_model(arch, state, dtype)
        if mkl_product.available() and (dtype == torch.float32 or not parallel.half_kernels(dtype)):
            with mock.patch.object(mkl_product, "available", lambda: False):  # the layout MKL's products replaced
                models[f"{short}packed for oneDNN (not taken on this CPU)"] = build_model(arch, state, dtype)
        if dtype == torch.bfloat16 and emulated_bf16():
            with mock.patch.object(parallel, "half_kernels", lambda d: d == torch.bfloat16):
                models["bf16 packed in bf16 (oneDNN emulated)"] = build_model(arch, state, dtype)
        if dtype == torch.bfloat16 and parallel.half_kernels(dtype) and parallel.bf16_in_blocks():
            models[ONE_CALL] = models["bf16 packed"]
    tokenizer = load_tokenizer(name)
    prompts = [chat_ids(tokenizer, p) for p in GENERAL_PROMPTS[:8]]
    times: dict[tuple[str, int, int], list[float]] = {}
    for _ in range(args.rounds):
        for batch in (1, 8):
            for label, model in models.items():
                one_call = mock.patch.object(parallel, "_bf16_in_blocks", parallel.onednn_product)
                with one_call if label == ONE_CALL else nullcontext():
                    for q, seconds in time_forward(model, arch, prompts[:batch], QUERY_LENS, args.reps).items():
                        times.setdefault((label, batch, q), []).append(seconds)
    ms = {key: statistics.median(v) * 1000 for key, v in times.items()}
    meta = run_meta("packing_bench", argv, time.monotonic() - started, True, load_start)
    print(f"- Date: {meta['date']}; command: `{meta['command']}`; wall time {meta['runtime_s'] / 60:.1f} min")
    m = meta["machine"]
    print(
        f"- Machine: {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}, torch {m['torch']}; "
        f"load average at start / end: {meta['load_start']} / {meta['load_end']}\n"
    )
    print("| batch | weights | " + " | ".join(f"q={q} ms" for q in QUERY_LENS) + " | v_2 | v_4 | v_6 |")
    print("| ---: | --- | " + " | ".join("---:" for _ in QUERY_LENS) + " | ---: | ---: | ---: |")
    for batch in (1, 8):
        for label in models:
            row = [ms[(label, batch, q)] for q in QUERY_LENS]
            ratios = [ms[(label, batch, q)] / ms[(label, batch, 1)] for q in (3, 5, 7)]
            print(
                f"| {batch} | {label} | "
                + " | ".join(f"{t:.1f}" for t in row)
                + " | "
                + " | ".join(f"{r:.2f}" for r in ratios)
                + " |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
