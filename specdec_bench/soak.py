"""Load and chaos soak: gateway + 2 verifiers + proposer as real processes on 127.0.0.1, N concurrent clients
for a fixed duration, while a verifier and the proposer are SIGKILLed and restarted; then it checks that nothing
was lost (`make soak`; docs/RELIABILITY.md).

    python -m specdec_bench.soak [--duration-s 600] [--clients 64] [--out DIR]

1. References, undisturbed, before any chaos: every deterministic request of the workload (greedy, seeded
   sampled, greedy with a stop string) is run once through the stack.
2. Load: each client sends requests back to back until the duration is over: greedy, seeded sampled (T = 0.8
   with top-p / top-k / min-p), stop strings, streams it cancels after a few tokens, requests with a short
   deadline, and deliberately invalid requests.
3. Chaos, at fixed fractions of the duration: SIGKILL verifier a, restart it (same port); SIGKILL the proposer,
   restart it; again for runs of 5 minutes and more. A kill waits until the stack is whole again.
4. Checks (exit status 1 if one fails): every request completed, except the deliberately invalid ones (which must
   fail with INVALID_ARGUMENT) and those cancelled or past their deadline on purpose (counted as such); every
   completed deterministic output equal to its reference, and every cut-short one a prefix of it; all KV blocks
   free and no request left on every verifier, none in flight at the gateway; resident memory growth of each
   process after its warm-up under 5%. Reported too: p50/p99 time to first token and inter-token latency, and a
   plot of throughput and latency over time with the kill moments (soak.png), beside soak.md and soak.json.

Bounded and self-stopping: clients stop sending at the end of the duration, requests still running get
`--drain-s` to finish (then they are cancelled and counted as failed), and every process is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from shared.proto_gen.specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specdec_bench.soak_report import Record, SoakReport, build_report
from specdec_local.processes import Service, Stack, StackError, build_stack

FINISH_UNSPECIFIED = common_pb2.FINISH_REASON_UNSPECIFIED
DETERMINISTIC = ("greedy", "seeded", "stop")
# Kinds of request and how often each is sent.
MIX: dict[str, float] = {
    "greedy": 0.28,
    "seeded": 0.28,
    "stop": 0.1,
    "cancel": 0.14,
    "deadline": 0.1,
    "invalid": 0.1,
}
PLAIN_PROMPTS = (
    "Once upon a time, there was a little girl named Lily. She",
    "Machine learning is a field of computer science that",
    "def fibonacci(n):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Dear Sir or Madam,\n\nI am writing to",
    "The three laws of thermodynamics are",
)
SEEDED_FIELDS = (
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=0.8, top_k=40),
    dict(temperature=0.8, top_p=0.95, min_p=0.02),
    dict(temperature=1.0),
)


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 600.0
    clients: int = 64
    out: Path = Path(".cache/soak")
    max_tokens: int = 32  # per deterministic request; cancelled ones ask for more
    num_specs: int = 24  # distinct deterministic requests (prompt x kind x seed)
    drain_s: float = 180.0  # after the duration: how long running requests may take to finish
    recover_s: float = 300.0  # how long a killed service may take to be back (model load on a busy machine)
    warmup_fraction: float = 0.3  # of each process's life, before its resident memory baseline is taken
    rss_growth_limit: float = 0.05
    rss_interval_s: float = 2.0
    seed: int = 0


@dataclass
class Spec:
    """One deterministic request of the workload and its undisturbed output."""

    kind: str  # greedy, seeded or stop
    fields: dict[str, Any]
    ref_ids: list[int] = field(default_factory=list)
    ref_finish: int = FINISH_UNSPECIFIED


@dataclass
class ChaosEvent:
    at_s: float  # since the start of the load
    what: str  # "kill" or "restart" (or "skipped")
    service: str


# ---- references ------------------------------------------------------------------------------------------


def build_specs(tokenizer, config: SoakConfig) -> list[Spec]:
    """Greedy and seeded requests over chat and plain prompts; the stop-string ones are added after the greedy
    references exist (their stop strings come from those texts)."""
    from specdec_bench.engine_bench import chat_ids
    from specdec_bench.prompts import GENERAL_PROMPTS

    prompts = [chat_ids(tokenizer, p) for p in GENERAL_PROMPTS] + [list(tokenizer(p).input_ids) for p in PLAIN_PROMPTS]
    specs = []
    for i in range(config.num_specs):
        prompt = prompts[i % len(prompts)]
        base = dict(prompt_token_ids=prompt, max_tokens=config.max_tokens)
        if i % 2 == 0:
            specs.append(Spec("greedy", base))
        else:
            extra = SEEDED_FIELDS[(i // 2) % len(SEEDED_FIELDS)]
            specs.append(Spec("seeded", {**base, **extra, "seed": 1000 + config.seed * 100 + i}))
    return specs


def stop_specs(specs: list[Spec], tokenizer) -> list[Spec]:
    """Greedy requests with a stop string taken from a few tokens into their reference's text."""
    out = []
    for spec in specs:
        if spec.kind != "greedy" or len(spec.ref_ids) < 12:
            continue
        text = tokenizer.decode(spec.ref_ids, skip_special_tokens=True)
        start = len(tokenizer.decode(spec.ref_ids[:6], skip_special_tokens=True))
        stop = text[start : start + 3]
        if len(stop) == 3 and stop.strip():
            out.append(Spec("stop", {**spec.fields, "stop": [stop], "max_tokens": spec.fields["max_tokens"] + 8}))
    return out


async def run_references(stub, specs: list[Spec], concurrency: int = 16) -> list[str]:
    """Each spec run once, undisturbed; returns problems (a reference that did not complete)."""
    gate = asyncio.Semaphore(concurrency)
    problems = []

    async def one(spec: Spec) -> None:
        async with gate:
            try:
                ids, finish = [], FINISH_UNSPECIFIED
                async for msg in stub.Generate(gateway_pb2.GenerateRequest(**spec.fields), timeout=600):
                    ids.extend(msg.token_ids)
                    finish = msg.finish_reason or finish
                spec.ref_ids, spec.ref_finish = ids, finish
            except grpc.aio.AioRpcError as err:
                problems.append(f"reference {spec.kind} {_brief(spec.fields)}: {err.code().name} {err.details()}")

    await asyncio.gather(*(one(s) for s in specs))
    return problems


# ---- the load --------------------------------------------------------------------------------------------


def invalid_request(rng: random.Random, spec: Spec) -> dict[str, Any]:
    prompt = spec.fields["prompt_token_ids"]
    return rng.choice(
        [
            dict(prompt_token_ids=prompt, temperature=-1.0),
            dict(prompt_token_ids=prompt, top_p=0.0),
            dict(prompt_token_ids=[]),
            dict(prompt_token_ids=prompt, max_tokens=0),
            dict(prompt_token_ids=[*prompt, 10_000_000]),
            dict(prompt_token_ids=prompt, stop=[""]),
        ]
    )


async def one_request(stub, kind: str, spec: Spec, rng: random.Random, t0: float) -> Record:
    fields = dict(spec.fields)
    timeout = 600.0
    cancel_after = 0
    if kind == "cancel":
        fields["max_tokens"] = fields["max_tokens"] * 2
        cancel_after = rng.randint(1, 4)  # token messages before the client walks away
    elif kind == "deadline":
        timeout = rng.uniform(0.05, 1.5)
    elif kind == "invalid":
        fields = invalid_request(rng, spec)
    rec = Record(kind=kind, spec_kind=spec.kind, start_s=time.monotonic() - t0)
    call = stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=timeout)
    try:
        async for msg in call:
            if msg.token_ids:
                now = time.monotonic() - t0
                rec.ids.extend(msg.token_ids)
                rec.token_times.append((now, len(msg.token_ids)))
            if msg.finish_reason != FINISH_UNSPECIFIED:
                rec.finish = msg.finish_reason
            if cancel_after and len(rec.token_times) >= cancel_after:
                call.cancel()
                rec.outcome = "cancelled"
                break
        else:
            rec.outcome = "completed" if rec.finish != FINISH_UNSPECIFIED else "failed"
            if rec.outcome == "failed":
                rec.detail = "the stream ended without a finish reason"
    except grpc.aio.AioRpcError as err:
        rec.code = err.code().name
        rec.detail = err.details() or ""
        if kind == "invalid" and err.code() == grpc.StatusCode.INVALID_ARGUMENT:
            rec.outcome = "rejected"
        elif kind == "deadline" and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            rec.outcome = "deadline"
        else:
            rec.outcome = "failed"
    rec.end_s = time.monotonic() - t0
    if kind == "invalid" and rec.outcome != "rejected":
        rec.outcome, rec.detail = "failed", f"an invalid request was not refused: {rec.code or 'completed'}"
    elif kind in DETERMINISTIC or kind in ("cancel", "deadline"):
        _check_output(rec, spec)
    return rec


def _check_output(rec: Record, spec: Spec) -> None:
    """A completed output must equal the reference exactly. A cut-short one (cancelled, past its deadline, failed)
    and a cancel-kind stream (it asks for more tokens than the reference) must agree with it on their common part:
    a seeded token depends only on (seed, position, the target's distribution), so longer runs extend shorter."""
    if rec.outcome == "completed" and rec.kind != "cancel":
        if rec.ids != spec.ref_ids or rec.finish != spec.ref_finish:
            rec.outcome, rec.detail = "mismatch", _diff(rec.ids, spec.ref_ids)
    else:
        n = min(len(rec.ids), len(spec.ref_ids))
        if rec.ids[:n] != spec.ref_ids[:n]:
            rec.outcome, rec.detail = "mismatch", f"({rec.outcome}) common part: " + _diff(rec.ids, spec.ref_ids)
    rec.checked = bool(rec.ids) or rec.outcome == "completed"


def _diff(got: list[int], want: list[int]) -> str:
    i = next((n for n, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    return f"{len(got)} tokens vs {len(want)}; first difference at {i}: {got[i : i + 4]} vs {want[i : i + 4]}"


def _brief(fields: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in fields.items() if k != "prompt_token_ids"})


async def client(stub, specs: list[Spec], config: SoakConfig, index: int, t0: float, records: list[Record]) -> None:
    rng = random.Random(config.seed * 100_003 + index)
    kinds, weights = list(MIX), list(MIX.values())
    by_kind = {k: [s for s in specs if s.kind == k] for k in DETERMINISTIC}
    while time.monotonic() - t0 < config.duration_s:
        kind = rng.choices(kinds, weights)[0]
        pool = by_kind[kind] if kind in DETERMINISTIC and by_kind[kind] else by_kind["greedy"] + by_kind["seeded"]
        records.append(await one_request(stub, kind, rng.choice(pool), rng, t0))


# ---- chaos and sampling ----------------------------------------------------------------------------------


def chaos_plan(stack: Stack, duration_s: float) -> list[tuple[float, Service]]:
    """(seconds since the load started, service to SIGKILL); verifier b is never killed, so one verifier always
    serves and one lives through the whole run (its memory growth is measured over all of it)."""
    va, proposer = stack.verifiers[0], stack.proposer
    fractions = (
        [(0.15, va), (0.35, proposer), (0.55, va), (0.75, proposer)]
        if duration_s >= 300
        else [
            (0.2, va),
            (0.5, proposer),
        ]
    )
    return [(f * duration_s, s) for f, s in fractions]


async def chaos(stack: Stack, config: SoakConfig, t0: float, events: list[ChaosEvent], problems: list[str]) -> None:
    for at_s, service in chaos_plan(stack, config.duration_s):
        await asyncio.sleep(max(0.0, at_s - (time.monotonic() - t0)))
        try:  # the previous kill's service must be back first: never two down at once
            await asyncio.to_thread(stack.wait_healthy, config.recover_s)
        except StackError as err:
            problems.append(f"the stack did not recover before the kill of {service.name}: {str(err)[:2000]}")
            events.append(ChaosEvent(time.monotonic() - t0, "skipped", service.name))
            return
        await asyncio.to_thread(service.kill)
        events.append(ChaosEvent(time.monotonic() - t0, "kill", service.name))
        await asyncio.sleep(2.0)  # the gateway and the verifiers notice the death before it is back
        service.restart()
        events.append(ChaosEvent(time.monotonic() - t0, "restart", service.name))
        try:
            await asyncio.to_thread(stack.wait_healthy, config.recover_s)
        except StackError as err:
            problems.append(f"{service.name} was not back within {config.recover_s:.0f} s: {str(err)[:2000]}")
            return
        events.append(ChaosEvent(time.monotonic() - t0, "ready", service.name))


async def sample_rss(
    stack: Stack, config: SoakConfig, t0: float, samples: dict[str, list], stop: asyncio.Event
) -> None:
    """Resident memory of every process: {service: [(seconds, pid, bytes)]}."""
    while not stop.is_set():
        for s in stack.services:
            rss = s.rss_bytes()
            if rss is not None and s.proc is not None:
                samples.setdefault(s.name, []).append((time.monotonic() - t0, s.proc.pid, rss))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), config.rss_interval_s)


async def final_state(stack: Stack, timeout_s: float = 60.0) -> tuple[dict[str, Any], list[str]]:
    """Every verifier idle with all KV blocks free, no request in flight at the gateway (waits up to timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state: dict[str, Any] = {}
        problems = []
        for v in stack.verifiers:
            async with grpc.aio.insecure_channel(v.address) as ch:
                s = (
                    await verifier_pb2_grpc.VerifierStub(ch).GetStats(
                        verifier_pb2.VerifierGetStatsRequest(), timeout=30
                    )
                ).stats
            state[v.name] = dict(
                running=s.running_requests,
                waiting=s.waiting_requests,
                kv_free=s.kv_blocks_free,
                kv_total=s.kv_blocks_total,
            )
            if s.running_requests or s.waiting_requests or s.kv_blocks_free != s.kv_blocks_total:
                problems.append(f"{v.name}: {state[v.name]}")
        async with grpc.aio.insecure_channel(stack.gateway.address) as ch:
            g = await gateway_pb2_grpc.GatewayStub(ch).GetStats(gateway_pb2.GetStatsRequest(), timeout=30)
        state[stack.gateway.name] = dict(active=g.active_requests, total=g.total_requests, resumed=g.resumed_requests)
        if g.active_requests:
            problems.append(f"{stack.gateway.name}: {g.active_requests} requests still in flight")
        if not problems or time.monotonic() > deadline:
            return state, problems
        await asyncio.sleep(0.5)


# ---- the whole run ---------------------------------------------------------------------------------------


async def soak(stack: Stack, tokenizer, config: SoakConfig) -> SoakReport:
    """Run the soak on a ready stack (proposer, two verifiers, gateway); every killed service is back at the end."""
    problems: list[str] = []
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        specs = build_specs(tokenizer, config)
        t_ref = time.monotonic()
        problems += await run_references(stub, specs)
        more = stop_specs(specs, tokenizer)
        problems += await run_references(stub, more)
        specs += more
        reference_s = time.monotonic() - t_ref

        records: list[Record] = []
        events: list[ChaosEvent] = []
        rss: dict[str, list] = {}
        stop_sampling = asyncio.Event()
        t0 = time.monotonic()
        sampler = asyncio.create_task(sample_rss(stack, config, t0, rss, stop_sampling))
        chaos_task = asyncio.create_task(chaos(stack, config, t0, events, problems))
        clients = [asyncio.create_task(client(stub, specs, config, i, t0, records)) for i in range(config.clients)]
        done, pending = await asyncio.wait(clients, timeout=config.duration_s + config.drain_s)
        for task in pending:
            task.cancel()
        if pending:
            problems.append(f"{len(pending)} clients still had a request running {config.drain_s:.0f} s after the end")
        for task in done:
            if task.exception() is not None:
                problems.append(f"a client crashed: {task.exception()!r}")
        await asyncio.gather(*pending, return_exceptions=True)
        load_s = time.monotonic() - t0
        await chaos_task
        try:
            await asyncio.to_thread(stack.wait_healthy, config.recover_s)
        except StackError as err:
            problems.append(f"the stack was not whole again at the end: {str(err)[:2000]}")
        state, idle_problems = await final_state(stack)
        problems += [f"not idle at the end: {p}" for p in idle_problems]
        stop_sampling.set()
        await sampler
    return build_report(
        config=asdict(config) | {"out": str(config.out)},
        records=records,
        events=[asdict(e) for e in events],
        rss=rss,
        final_state=state,
        problems=problems,
        reference_s=reference_s,
        load_s=load_s,
        num_specs=len(specs),
        warmup_fraction=config.warmup_fraction,
        rss_growth_limit=config.rss_growth_limit,
        duration_s=config.duration_s,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specdec_bench.soak",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--duration-s", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    parser.add_argument(
        "--out", type=Path, default=Path(".cache/soak"), help="folder for soak.md, soak.json, soak.png and the logs"
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of the deterministic requests")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload (request mix, seeds)")
    args = parser.parse_args(argv)
    config = SoakConfig(
        duration_s=args.duration_s, clients=args.clients, out=args.out, max_tokens=args.max_tokens, seed=args.seed
    )
    from shared.model.loader import load_tokenizer
    from shared.settings import default_target_model

    logs = config.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    stack = build_stack("soak", logs, num_verifiers=2, verifier_args=("--warm-up",))  # as deployed
    print(f"soak: starting {len(stack.services)} processes (logs in {logs})", flush=True)
    stack.start()
    report = None
    try:
        stack.wait_ready()
        print(f"soak: stack ready; {config.clients} clients for {config.duration_s:.0f} s", flush=True)
        report = asyncio.run(soak(stack, load_tokenizer(default_target_model()), config))
    finally:
        stop_problems = stack.stop()
    if report is None:
        return 1
    report.problems += [f"shutdown: {p}" for p in stop_problems]
    report.write(config.out)
    print(report.markdown())
    print(f"soak: {'PASSED' if report.passed else 'FAILED'}; report in {config.out}", flush=True)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
