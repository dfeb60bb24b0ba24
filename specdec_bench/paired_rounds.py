"""Paired rounds through the gateway: target-only against one speculating stack, in alternating rounds.

    python -m specdec_bench.paired_rounds --clients 8 --rounds 20 --temperature 0.8

Both stacks are started as `gateway_bench` starts them (the environment `make run` gives its services); then
each round runs the same requests (`--clients` at once, `--max-tokens` each) on one stack and then the other,
the order swapped every round. Each round's tokens/s over its neighbour's is one paired sample: a shared
machine's slow minute moves both alike. Reported: the ratios' median and mean, the TTFT medians, and the CPU
seconds each service process used during the rounds (from /proc), which says whether a proposer's work beside
its verifier competes for the cores. For a small effect (a few percent) take many short rounds rather than
`gateway_bench`'s few long runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from specdec_bench import gateway_bench as gb
from specdec_bench.step_phases import cpu_seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stack", default="eagle-adaptive-tree", choices=[k for k in gb.STACK_KINDS if k != "target"])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=None, help="requests a round (default: --clients, at most 8)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--json", default="", help="write the samples here")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gb.tune_malloc()  # as in the services it starts
    import torch

    from shared.model.loader import load_tokenizer
    from shared.settings import default_draft_model, default_eagle_head, default_target_model

    torch.set_num_threads(gb.NUM_THREADS)
    target = default_target_model()
    names = ["target", args.stack]
    logs = Path(tempfile.mkdtemp(prefix="specdec-paired-"))
    stacks = gb.build_stacks(logs, target, default_draft_model(), str(default_eagle_head()), names)
    procs = [p for s in stacks.values() for p in s.procs]
    try:
        deadline = time.monotonic() + gb.STARTUP_TIMEOUT_S * len(stacks)
        for s in stacks.values():  # one at a time: a verifier's warm-up times its target
            for p in s.procs:
                p.start()
            s.wait_ready(deadline)
        tok = load_tokenizer(target)
        prompts = [gb.chat_ids(tok, p) for p in gb.GENERAL_PROMPTS][: args.prompts or min(args.clients, 8)]
        for s in stacks.values():
            asyncio.run(gb.run_gateway(s.gateway.address, prompts[:1], 1, 8, args.temperature))  # warm-up
        pids = {p.name: p.proc.pid for p in procs if p.proc is not None}
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        started = time.perf_counter()
        samples: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                m = gb.run_gateway(
                    stacks[name].gateway.address, prompts, args.clients, args.max_tokens, args.temperature
                )
                samples[name].append(asyncio.run(m).summary())
        wall = time.perf_counter() - started
        cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
    finally:
        for p in reversed(procs):
            p.stop()
    ratios = [
        b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(samples["target"], samples[args.stack], strict=True)
    ]
    print(f"{args.stack} / target-only, {args.clients} clients, T = {args.temperature}, {args.rounds} paired rounds:")
    print(f"  ratio median {statistics.median(ratios):.3f}, mean {statistics.mean(ratios):.3f}")
    print(f"  per round {[round(r, 2) for r in ratios]}")
    for name in names:
        tps = [s["tokens_per_s"] for s in samples[name]]
        ttft = statistics.median(s["ttft_p50_ms"] for s in samples[name])
        print(f"  {name}: tokens/s median {statistics.median(tps):.1f}, TTFT p50 median {ttft:.0f} ms")
    for name, seconds in cpu.items():
        print(f"  CPU {name}: {seconds:.2f} s in {wall:.1f} s of rounds")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "ratios": ratios, "samples": samples, "cpu": cpu}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
