"""Paired rounds through the gateway: target-only against speculating stacks, in rotating rounds.

    python -m specdec_bench.paired_rounds --clients 8 --rounds 20 --temperature 0.8
    python -m specdec_bench.paired_rounds --clients 1 --prompts 3 --rounds 16 --stack eagle-adaptive-tree \
        --stack eagle --stack eagle-tree        # the policy against the fixed chain and the fixed tree

The stacks are started as `gateway_bench` starts them (the environment `make run` gives its services); then
each round runs the same requests (`--clients` at once, `--max-tokens` each) on every stack in turn, the order
rotated every round. Each round's tokens/s over target-only's in the same round is one paired sample: a shared
machine's slow minute moves them alike. With several speculating stacks the first is also set against each of
the others round by round, and against the one that is best over the rounds (the highest median ratio to
target-only): issue 23's "the cost model's choice against the best fixed tree or chain". Taking the faster of
the fixed stacks in each round instead (as `gateway_bench`'s policy table does with its few long runs) favours
them: the faster of two equally fast, noisy stacks is faster than either. Reported: the ratios' median (with
the sign test's interval, `median_interval`: where it holds 1.0 the rounds show no difference) and mean,
the TTFT medians, and the CPU seconds each service process used during the rounds (from /proc), which says
whether a proposer's work beside its verifier competes for the cores. For a small effect (a few percent) take
many short rounds rather than `gateway_bench`'s few long runs.

`--twin` adds an A/A control: a second target-only stack, started last, in the same rotation. Its ratio to
target-only is what a ratio reads where nothing differs. At 8 clients, T = 0.8 (2 cores, 2026-12-07) six runs of 12
rounds gave 0.964-1.013 (median 0.973), and three with the twin started first instead 1.011-1.036: a speculating
stack (started after target-only) whose median lies within a few percent of 1.0 shows no measured difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from specdec_bench import gateway_bench as gb
from specdec_bench.step_phases import cpu_seconds

# The median ratio's interval (`median_interval`): a ratio whose interval holds 1.0 shows no measured difference.
# At 8 clients, T = 0.8, the A/A twin's per-round ratios spread 0.78-1.17 in 12 rounds (2 cores, 2026-12-07).
INTERVAL_LEVEL = 0.9
BASE_NAME = "base"  # `--base-code`'s stack


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--stack",
        action="append",
        choices=[k for k in gb.STACK_KINDS if k not in ("target", gb.TWIN)],
        help="a speculating stack (repeat for several; the first is set against the others); "
        "default eagle-adaptive-tree, `make run`'s",
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=None, help="requests a round (default: --clients, at most 8)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--twin", action="store_true", help="add a second target-only stack: the A/A control")
    parser.add_argument(
        "--base-code",
        default="",
        help="also run the first stack from another checkout (a worktree at an older commit; its services import "
        "from there): old code against new, paired, as the stack BASE_NAME",
    )
    parser.add_argument("--json", default="", help="write the samples here")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gb.tune_malloc()  # as in the services it starts
    import torch

    from shared.model.loader import load_tokenizer
    from shared.settings import default_draft_model, default_eagle_head, default_target_model

    torch.set_num_threads(gb.NUM_THREADS)
    target = default_target_model()
    spec = list(dict.fromkeys(args.stack or ["eagle-adaptive-tree"]))
    names = ["target", *spec, *([gb.TWIN] if args.twin else [])]
    logs = Path(tempfile.mkdtemp(prefix="specdec-paired-"))
    draft, head = default_draft_model(), str(default_eagle_head())
    stacks = gb.build_stacks(logs, target, draft, head, names)
    if args.base_code:
        stacks[BASE_NAME] = base_stack(args.base_code, logs, (target, draft, head), spec[0])
        names.append(BASE_NAME)
        spec.append(BASE_NAME)
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
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                m = gb.run_gateway(
                    stacks[name].gateway.address, prompts, args.clients, args.max_tokens, args.temperature
                )
                samples[name].append(asyncio.run(m).summary())
        wall = time.perf_counter() - started
        cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
    finally:
        for p in reversed(procs):
            p.stop()
    report(args, spec, samples, cpu, wall)
    return 0


def base_stack(code: str, logs: Path, models: tuple[str, str, str], name: str):
    """The stack `name` with its services importing from the checkout at `code` (PYTHONPATH: it comes before the
    editable install's finder), logs under logs/BASE_NAME; `models`: (target, draft, EAGLE head), as the others'."""
    root = Path(code).resolve()
    if not (root / "verifier_service").is_dir():
        raise SystemExit(f"--base-code {code}: no verifier_service/ there (a checkout of this repository?)")
    (logs / BASE_NAME).mkdir()
    stack = gb.build_stacks(logs / BASE_NAME, *models, [name])[name]
    stack.name = BASE_NAME
    for proc in stack.procs:
        proc.name = proc.name.replace(name, BASE_NAME, 1)
        proc.env["PYTHONPATH"] = str(root)
    return stack


def per_round(samples: dict[str, list[dict[str, Any]]], name: str, base: str) -> list[float]:
    return [b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(samples[base], samples[name], strict=True)]


def against_the_best(
    samples: dict[str, list[dict[str, Any]]], first: str, others: list[str]
) -> tuple[str, list[float]]:
    """The other stack with the highest median ratio to target-only over the rounds, and the first stack over it,
    round by round."""
    best = max(others, key=lambda name: statistics.median(per_round(samples, name, "target")))
    return best, per_round(samples, first, best)


def median_interval(values: list[float], level: float = INTERVAL_LEVEL) -> tuple[float, float, float]:
    """A distribution-free interval for the median of paired rounds: the j-th smallest and j-th largest values,
    j the largest with P(Binomial(n, 1/2) < j) <= (1 - level) / 2 (the sign test's; rounds need only be
    independent, not normal), and the interval's exact coverage. Fewer than five rounds reach no 90%
    interval: the whole range then, with its coverage (1 - 2^(1-n))."""
    ordered, n = sorted(values), len(values)
    j, tail = 0, 0.0  # tail: P(B < j)
    while j < n // 2 and tail + math.comb(n, j) / 2**n <= (1 - level) / 2:
        tail, j = tail + math.comb(n, j) / 2**n, j + 1
    if j == 0:
        j, tail = 1, 1 / 2**n
    return ordered[j - 1], ordered[n - j], 1 - 2 * tail


def _line(label: str, ratios: list[float]) -> str:
    low, high, coverage = median_interval(ratios)
    return (
        f"  {label}: ratio median {statistics.median(ratios):.3f} ({100 * coverage:.0f}% interval {low:.3f}-"
        f"{high:.3f}), mean {statistics.mean(ratios):.3f}; per round {[round(r, 2) for r in ratios]}"
    )


def report(args, spec: list[str], samples, cpu: dict[str, float], wall: float) -> None:
    print(f"{', '.join(spec)} / target-only, {args.clients} clients, T = {args.temperature}, {args.rounds} rounds:")
    for name in spec:
        print(_line(f"{name} / target", per_round(samples, name, "target")))
    first, others = spec[0], spec[1:]
    for name in others:
        print(_line(f"{first} / {name}", per_round(samples, first, name)))
    if others:
        best, ratios = against_the_best(samples, first, others)
        print(_line(f"{first} / the best of the others over the rounds ({best})", ratios))
    if gb.TWIN in samples:
        print(_line(f"A/A control, {gb.TWIN} / target (no difference)", per_round(samples, gb.TWIN, "target")))
    for name in samples:
        tps = [s["tokens_per_s"] for s in samples[name]]
        ttft = statistics.median(s["ttft_p50_ms"] for s in samples[name])
        steps = [s["tokens_per_step"] for s in samples[name] if s.get("tokens_per_step")]
        per_step = f", tokens a verify step median {statistics.median(steps):.2f}" if steps else ""
        print(f"  {name}: tokens/s median {statistics.median(tps):.1f}, TTFT p50 median {ttft:.0f} ms{per_step}")
    for name, seconds in cpu.items():
        print(f"  CPU {name}: {seconds:.2f} s in {wall:.1f} s of rounds")
    if args.json:
        ratios = {name: per_round(samples, name, "target") for name in samples if name != "target"}
        record = {"args": vars(args), "stacks": spec, "ratios": ratios, "samples": samples, "cpu": cpu}
        Path(args.json).write_text(json.dumps(record))


if __name__ == "__main__":
    raise SystemExit(main())
