"""`python -m specdec_bench.step_phases`: where a verifier's steps go, stack beside stack, through the gateway.

Starts the stacks as `gateway_bench` does (one at a time, the same processes and flags), then alternates groups
of `--clients` concurrent requests (the general prompts, greedy unless `--temperature`), reading each verifier's
Prometheus histograms before and after every group: steps, milliseconds a step, and its phases (propose on the
critical path, score, verify, network), drafted tokens, each service process's CPU seconds from /proc, and the
verifier's per thread (its event loop apart from the step thread and its OpenMP workers) and its page faults.
`--max-draft-tokens 0` makes a speculative stack decode every request plainly, which separates what its plain
steps cost from what drafting costs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

from shared.settings import default_draft_model, default_eagle_head, default_target_model
from specdec_bench import gateway_bench as gb
from specdec_bench.engine_bench import chat_ids
from specdec_bench.prompts import GENERAL_PROMPTS
from specdec_local.run_figures import scrape

PHASES = ("propose", "score", "verify", "network")
STEP = "specdec_step_duration_seconds"
PHASE = "specdec_step_phase_duration_seconds"


def totals(metrics: dict) -> dict[str, float]:
    """Sums and counts of the step histograms, by phase, and the drafted tokens, from one scrape."""
    out: dict[str, float] = {}
    for (name, labels), value in metrics.items():
        for base, key in ((STEP, "step"), (PHASE, dict(labels).get("phase", ""))):
            for suffix in ("_sum", "_count"):
                if name == base + suffix:
                    out[key + suffix] = value
        if name == "specdec_drafted_tokens_total":
            out["drafted"] = value
    return out


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (which may hold spaces): field 3 (state) first."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()


def cpu_seconds(pid: int) -> float:
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_seconds(pid: int) -> dict[int, float]:
    """Each thread's CPU seconds (schedstat: nanoseconds, not clock ticks)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError):
            continue
    return out


def minor_faults(pid: int) -> int:  # pages the process faulted in: a step that allocates fresh memory shows here
    return int(_stat(pid)[7])


def measure(stack: gb.Stack, prompts: list[list[int]], args: argparse.Namespace) -> str:
    address = f"{gb.HOST}:{stack.metrics_ports['verifier']}"
    verifier = next(p.proc.pid for p in stack.procs if p.proc and p.name.endswith("verifier"))
    threads = thread_seconds(verifier)
    faults = minor_faults(verifier)
    before, cpu = totals(scrape(address)), {p.name: cpu_seconds(p.proc.pid) for p in stack.procs if p.proc}
    m = asyncio.run(
        gb.run_gateway(
            stack.gateway.address, prompts, args.clients, args.max_tokens, args.temperature,
            max_draft_tokens=args.max_draft_tokens,
        )
    )  # fmt: skip
    after = totals(scrape(address))
    threads_after = thread_seconds(verifier)
    faults = minor_faults(verifier) - faults
    used_by = {t: s - threads.get(t, 0.0) for t, s in threads_after.items()}
    main_ms = 1e3 * used_by.get(verifier, 0.0)
    busiest = sorted((v for t, v in used_by.items() if t != verifier), reverse=True)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    steps = delta.get("step_count", 0.0) or 1.0
    phases = " ".join(f"{p} {1e3 * delta.get(p + '_sum', 0.0) / steps:.1f}" for p in PHASES)
    used = " ".join(
        f"{p.name.rsplit('-', 1)[-1]} {cpu_seconds(p.proc.pid) - cpu[p.name]:.1f}" for p in stack.procs if p.proc
    )
    return (
        f"{stack.name}: {m.tokens_per_s:.1f} tok/s, {steps:.0f} steps, {1e3 * delta.get('step_sum', 0.0) / steps:.1f} "
        f"ms a step ({phases}), drafted {delta.get('drafted', 0.0):.0f}; CPU s: {used}; verifier CPU ms a step: "
        f"event loop {main_ms / steps:.2f}, busiest other threads "
        + " ".join(f"{1e3 * v / steps:.2f}" for v in busiest[:3])
        + f"; page faults a step {faults / steps:.0f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec_bench.step_phases", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--stacks",
        default="target,eagle-adaptive-tree",
        help=f"from {', '.join(gb.STACK_KINDS)}, each with a dtype suffix (-bf16) and then -4k (its services on "
        "the pages the kernel gives them, SPECDEC_HUGEPAGES=0) if wanted",
    )
    parser.add_argument("--runs", type=int, default=4, help="groups per stack, alternating the order")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-draft-tokens", type=int, default=None, help="each request's cap on k")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.stacks.split(",") if n.strip()]
    unknown = [n for n in names if gb._stack_dtype(n)[0] not in gb.STACK_KINDS]  # a dtype suffix: e.g. target-bf16
    if unknown:
        raise SystemExit(f"--stacks: unknown {unknown}; choose from {', '.join(gb.STACK_KINDS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    log_dir = Path(tempfile.mkdtemp(prefix="specdec-step-phases-"))
    head = str(Path(default_eagle_head()).resolve())
    stacks = gb.build_stacks(log_dir, default_target_model(), default_draft_model(), head, names)
    try:
        for stack in stacks.values():
            for p in stack.procs:
                p.start()
            stack.wait_ready(time.monotonic() + gb.STARTUP_TIMEOUT_S)
        from shared.model.loader import load_tokenizer

        tok = load_tokenizer(default_target_model())
        prompts = [chat_ids(tok, p) for p in GENERAL_PROMPTS][: args.clients]
        for stack in stacks.values():  # warm-up
            asyncio.run(gb.run_gateway(stack.gateway.address, prompts[:1], 1, 8))
        for run in range(args.runs):
            order = list(stacks.values())
            for stack in order if run % 2 == 0 else order[::-1]:
                print(f"run {run + 1}/{args.runs} {measure(stack, prompts, args)}", flush=True)
    finally:
        for stack in stacks.values():
            for p in reversed(stack.procs):
                p.stop()
        print(f"logs in {log_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
