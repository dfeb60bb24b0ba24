"""`python -m specdec_bench.eagle_cost_bench`: what one draft position costs, EAGLE-3 head vs EAGLE-1 head.

One draft position of the committed (EAGLE-1) head and of an EAGLE-3 head of the same shape reading layers
1, 14, 26 and -1 (random weights: the cost does not depend on them), beside the target's one-token step,
timed in alternation (target, EAGLE-1, EAGLE-3, ...) with `engine_bench`'s timers; medians of the rounds, ratios
within the run. The EAGLE-3 head's extra work at catch-up (`fuse`, per committed token) is timed apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from shared.malloc_tuning import tune_malloc
from shared.model.dtype import resolve_head_dtype
from shared.model.eagle import (
    EagleHead,
    arch_from_config,
    build_head,
    eagle3_layers,
    head_config,
    init_head_state,
    load_head_state,
    save_head,
)
from shared.model.loader import load_embeddings, load_model, load_tokenizer
from shared.settings import default_eagle_head, default_target_model
from specdec_bench.engine_bench import time_forward, time_head_forward
from specdec_bench.prompts import GENERAL_PROMPTS
from specdec_train.data import prompt_ids


def eagle3_twin(
    eagle1_dir: str, embedding: torch.Tensor, lm_head: torch.Tensor, target_arch, dtype: torch.dtype = torch.float32
) -> EagleHead:
    """An EAGLE-3 head shaped like the EAGLE-1 one (same subset size), random weights."""
    layers = (*eagle3_layers(target_arch.num_layers), -1)
    subset = load_head_state(eagle1_dir)["vocab_subset"]
    config = head_config(target_arch, 1, len(subset), layers)
    folder = tempfile.mkdtemp()
    save_head(folder, config, init_head_state(arch_from_config(config), subset, 0, layers))
    return build_head(folder, embedding, lm_head, dtype=dtype)[0]


def time_fuse(head: EagleHead, rows: int, reps: int) -> float:
    """Median seconds of fusing `rows` positions' raw layers (catch-up's extra work per committed token)."""
    raw = torch.randn(rows, head.feature_width)
    samples = []
    for rep in range(reps + 1):
        start = time.perf_counter()
        head.fuse_features(raw)
        if rep:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m specdec_bench.eagle_cost_bench", description=__doc__.splitlines()[0])
    p.add_argument("--head", default=None, help="the EAGLE-1 head (default: the repo's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=10, help="timed forwards per measurement (median)")
    p.add_argument("--dtype", default="auto", help="the heads' dtype, as an EAGLE proposer's --dtype (auto: its rule)")
    args = p.parse_args(argv)
    tune_malloc()
    torch.set_num_threads(args.threads)
    target = default_target_model()
    model, arch = load_model(target)
    embedding, lm_head, target_arch = load_embeddings(target)
    eagle1_dir = args.head or str(default_eagle_head())
    dtype = resolve_head_dtype(args.dtype, "cpu", target)
    eagle1 = build_head(eagle1_dir, embedding, lm_head, dtype=dtype)[0]
    eagle3 = eagle3_twin(eagle1_dir, embedding, lm_head, target_arch, dtype)
    tokenizer = load_tokenizer(target)
    prompts = [prompt_ids(tokenizer, text, True) for text in GENERAL_PROMPTS]
    print(f"load at start {os.getloadavg()}, {args.threads} thread(s), heads in {dtype}")
    for batch in (1, 8):
        group = prompts[:batch]
        step, one, three, fuse = [], [], [], []
        for _ in range(args.rounds):
            step.append(time_forward(model, arch, group, [1], args.reps)[1])
            one.append(time_head_forward(eagle1, group, args.reps))
            three.append(time_head_forward(eagle3, group, args.reps))
            fuse.append(time_fuse(eagle3, batch, args.reps))
        s, e1, e3, f = map(statistics.median, (step, one, three, fuse))
        print(
            f"batch {batch}: target step {s * 1e3:.1f} ms; draft position: EAGLE-1 {e1 * 1e3:.2f} ms "
            f"({e1 / s:.3f} of a step), EAGLE-3 {e3 * 1e3:.2f} ms ({e3 / s:.3f}), EAGLE-3 / EAGLE-1 = {e3 / e1:.2f}; "
            f"EAGLE-3 fuse at catch-up {f * 1e3:.2f} ms per {batch} token(s) ({f / s:.3f} of a step)"
        )
    print(f"load at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
