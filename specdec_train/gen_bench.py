"""`python -m specdec_train.gen_bench`: the data generator's throughput (generated tokens/s) by engine batch
size, measured in alternation (each round runs every size once, the order rotating) so that a shared
machine's load falls on all sizes alike; the median over rounds is reported."""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from shared.malloc_tuning import tune_malloc
from shared.model.build import CacheConfig
from shared.model.loader import load_model, load_tokenizer
from shared.sampling import SamplingParams
from shared.settings import default_target_model
from specdec_local.builder import build_engine
from specdec_train.conversations import conversation_set
from specdec_train.data import generation_dtype, prompt_ids
from verifier_service.engine import EngineConfig


def run_once(model, prompts: list[list[int]], batch: int, new_tokens: int) -> float:
    engine = build_engine(
        model,
        None,
        EngineConfig(num_speculative_tokens=0, max_num_seqs=batch, max_model_len=1024, max_waiting=1 << 20),
        CacheConfig(num_blocks=batch * ((max(map(len, prompts)) + new_tokens) // 16 + 2)),
    )
    for i, ids in enumerate(prompts[:batch]):
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    started, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    return tokens / (time.perf_counter() - started)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m specdec_train.gen_bench", description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="16,32,64,96,128")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="float32", help="as the generator's")
    args = p.parse_args()
    tune_malloc()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = default_target_model()
    dtype = generation_dtype(args.dtype)
    model, tokenizer = load_model(target, getattr(torch, dtype)), load_tokenizer(target)
    sizes = [int(b) for b in args.batches.split(",")]
    convs = conversation_set(12345, max(sizes))  # not the training seed's first conversations
    prompts = [prompt_ids(tokenizer, c.turns[0], c.chat, c.system) for c in convs]
    rates: dict[int, list[float]] = {b: [] for b in sizes}
    print(f"load average at start: {os.getloadavg()}, torch threads {torch.get_num_threads()}, {dtype}", flush=True)
    for r in range(args.rounds):
        order = sizes[r % len(sizes) :] + sizes[: r % len(sizes)]
        for batch in order:
            rates[batch].append(run_once(model, prompts, batch, args.new_tokens))
            print(f"round {r} batch {batch}: {rates[batch][-1]:.1f} tok/s", flush=True)
    print(f"load average at end: {os.getloadavg()}")
    print("| batch | generated tokens/s (median) | runs |\n| ---: | ---: | --- |")
    for batch in sizes:
        runs = ", ".join(f"{x:.1f}" for x in rates[batch])
        print(f"| {batch} | {statistics.median(rates[batch]):.1f} | {runs} |")


if __name__ == "__main__":
    main()
