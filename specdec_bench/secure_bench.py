"""What TLS, mutual TLS and API keys cost per token: the gateway stack secured beside plaintext, same run.

    python -m specdec_bench.secure_bench [--quick] [--runs N] [--max-tokens N] [--draft] [--out docs/BENCHMARKS.md]

Two stacks of real processes on 127.0.0.1, started by gateway_bench's helpers, default target, target only
(verifier without --proposer, k = 0: the least work per token, so the largest relative overhead):

    (a) plaintext          no TLS, no API keys
    (b) TLS + mTLS + key   TLS on every port; gateway -> verifier mutual TLS; certificates from trustme in a
                           temporary folder; --api-keys-file with one key. The client verifies the gateway
                           against the CA (server-only TLS, as a public client) and sends `authorization: Bearer`

--draft adds the same pair with the draft model (proposer, k = 4 fixed; verifier <-> proposer mutual TLS too).
Work: the general chat prompts with the chat template, greedy, EOS ignored, --max-tokens each; 1 client
(prompts one after another, a different pair every run) and 8 concurrent clients. (a) and (b) alternate: at
1 client request by request, at 8 clients run by run, the first of the pair swapping each time, so load
changes on the shared machine hit both alike. Ratios (b)/(a) are taken within a run; medians over runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import trustme

from shared.malloc_tuning import tune_malloc
from shared.proto_gen.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from shared.settings import default_draft_model, default_target_model
from shared.tls import ClientTLS, aio_channel
from specdec_bench.engine_bench import NUM_THREADS, chat_ids
from specdec_bench.gateway_bench import (
    CLIENTS,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    STARTUP_TIMEOUT_S,
    Measurement,
    Progress,
    Stack,
    _fmt,
    build_stacks,
    run_gateway,
)
from specdec_bench.prompts import GENERAL_PROMPTS
from specdec_bench.report import load_average, run_meta, write_report
from specdec_bench.step_phases import cpu_seconds as process_cpu_seconds

MARK_START = "<!-- secure-bench:start -->"
MARK_END = "<!-- secure-bench:end -->"
OVERHEAD_TARGET = 0.03
SERVER_NAME = "localhost"  # every leaf carries localhost and 127.0.0.1
CONFIGS = {"a": "(a) plaintext", "b": "(b) TLS + mTLS + API key"}
STACK_LABELS = {"target": "target only (k=0)", "draft": "draft model, k=4"}
HIGH_LOAD = 2.5  # 1-minute load average above which the section says the machine was busy


# ---- certificates, key, stacks ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Secrets:
    ca: str
    files: dict[str, tuple[str, str]]  # role -> (certificate, key)
    keys_file: str
    key: str

    def flags(self, role: str) -> list[str]:
        cert, key = self.files[role]
        out = ["--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-file", self.ca]
        if role in ("gateway", "verifier"):  # they dial an upstream
            out += ["--tls-server-name", SERVER_NAME]
        return out + (["--api-keys-file", self.keys_file] if role == "gateway" else [])

    def internal_client(self) -> ClientTLS:
        """This script's health checks: the internal ports refuse clients without a cluster certificate."""
        cert, key = self.files["bench"]
        return ClientTLS(self.ca, cert, key, SERVER_NAME)

    def public_client(self) -> ClientTLS:
        return ClientTLS(self.ca, server_name=SERVER_NAME)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.key}"),)


def make_secrets(folder: Path) -> Secrets:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(folder / "ca.crt"))
    files = {}
    for role in ("gateway", "verifier", "proposer", "bench"):
        leaf = ca.issue_cert(SERVER_NAME, "127.0.0.1", common_name=f"specdec-{role}")
        cert_path, key_path = folder / f"{role}.crt", folder / f"{role}.key"
        cert_path.write_bytes(b"".join(p.bytes() for p in leaf.cert_chain_pems))
        leaf.private_key_pem.write_to_path(str(key_path))
        files[role] = (str(cert_path), str(key_path))
    key = "sk-bench-" + secrets.token_hex(16)
    keys_file = folder / "api-keys.txt"
    keys_file.write_text(f"{key} bench\n")
    return Secrets(str(folder / "ca.crt"), files, str(keys_file), key)


def secure(stack: Stack, s: Secrets) -> Stack:
    for p in stack.procs:
        p.cmd += s.flags(p.name.rsplit("-", 1)[1])  # build_stacks names them STACK-ROLE
    stack.tls = s.internal_client()
    return stack


async def _complete(address: str, tls: ClientTLS | None, metadata: tuple = ()) -> grpc.StatusCode:
    async with aio_channel(address, tls) as channel:
        request = gateway_pb2.CompleteRequest(prompt_token_ids=[1, 2, 3], max_tokens=1)
        try:
            await gateway_pb2_grpc.GatewayStub(channel).Complete(request, timeout=30, metadata=metadata)
        except grpc.aio.AioRpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def check_secured(address: str, s: Secrets) -> list[str]:
    """(b) really is secured: a plaintext client is refused, a TLS client without the key is UNAUTHENTICATED."""
    expect = {
        "plaintext client": (None, (), grpc.StatusCode.UNAVAILABLE),
        "TLS client without the key": (s.public_client(), (), grpc.StatusCode.UNAUTHENTICATED),
        "TLS client with the key": (s.public_client(), s.metadata, grpc.StatusCode.OK),
    }
    lines = []
    for what, (tls, metadata, code) in expect.items():
        got = asyncio.run(_complete(address, tls, metadata))
        if got != code:
            raise RuntimeError(f"stack (b) is not secured as intended: {what} got {got.name}, expected {code.name}")
        lines.append(f"{what}: {got.name}")
    return lines


# ---- the benchmark --------------------------------------------------------------------------------------------


@dataclass
class Timed(Measurement):
    """A measurement with the CPU time its stack's service processes used meanwhile: the work done per token,
    which, unlike wall time, hardly grows when other jobs take the cores."""

    cpu_s: dict[str, float] = field(default_factory=dict)  # role -> user + system seconds, every thread

    def summary(self) -> dict:
        def per_token(*roles: str) -> float | None:
            got = [self.cpu_s[r] for r in roles if r in self.cpu_s]
            return 1e3 * sum(got) / self.tokens if got else None

        return super().summary() | {
            "cpu_ms_per_token": per_token("gateway", "verifier", "proposer"),
            "gateway_cpu_ms_per_token": per_token("gateway"),
            "verifier_cpu_ms_per_token": per_token("verifier", "proposer"),
        }


def cpu_seconds(stack: Stack) -> dict[str, float]:
    """utime + stime of each of the stack's processes (/proc/PID/stat fields 14, 15); {} where there is no /proc."""
    out = {}
    for p in stack.procs:
        try:
            out[p.name.rsplit("-", 1)[1]] = process_cpu_seconds(p.proc.pid)  # type: ignore[union-attr]
        except (OSError, AttributeError):
            return {}
    return out


def combine(ms: list[Timed]) -> Timed:
    cpu = {r: sum(m.cpu_s.get(r, 0.0) for m in ms) for r in ms[0].cpu_s}
    return Timed(sum(m.wall_s for m in ms), [t for m in ms for t in m.traces], cpu)


@dataclass
class Plan:
    runs: int
    max_tokens: int
    batch1_prompts: int


def run_benchmark(
    pairs: dict[str, dict[str, Stack]], s: Secrets, prompts: list[list[int]], plan: Plan, log: Progress
) -> dict:
    def measure(key: str, stack: Stack, ps: list[list[int]], clients: int, max_tokens: int) -> Timed:
        tls, metadata = (s.public_client(), s.metadata) if key == "b" else (None, ())
        before = cpu_seconds(stack)
        m = asyncio.run(run_gateway(stack.gateway.address, ps, clients, max_tokens, 0.0, tls, metadata))
        after = cpu_seconds(stack)
        return Timed(m.wall_s, m.traces, {r: after[r] - before[r] for r in before if r in after})

    log("warm-up (8 tokens per stack)")
    for pair in pairs.values():
        for key, stack in pair.items():
            measure(key, stack, prompts[:1], 1, 8)

    results: dict[tuple[str, int, str], list[Measurement]] = {}
    for run in range(plan.runs):
        for kind, pair in pairs.items():
            for clients in CLIENTS:
                if clients == 1:  # a different pair of prompts every run, (a) and (b) request by request
                    ps = [prompts[(run * plan.batch1_prompts + j) % len(prompts)] for j in range(plan.batch1_prompts)]
                    parts: dict[str, list[Timed]] = {"a": [], "b": []}
                    for j, p in enumerate(ps):
                        for key in ("a", "b") if (run + j) % 2 == 0 else ("b", "a"):
                            parts[key].append(measure(key, pair[key], [p], 1, plan.max_tokens))
                    got = {k: combine(ms) for k, ms in parts.items()}
                else:
                    order = ("a", "b") if run % 2 == 0 else ("b", "a")
                    got = {k: measure(k, pair[k], prompts[:clients], clients, plan.max_tokens) for k in order}
                for key, m in got.items():
                    results.setdefault((kind, clients, key), []).append(m)
                    x = m.summary()
                    log(
                        f"run {run + 1}/{plan.runs} {kind} clients {clients} {CONFIGS[key]}: {x['tokens']} tokens, "
                        f"{x['tokens_per_s']:.1f} tok/s, TPOT {_fmt(x['tpot_ms'], '.1f')} ms, "
                        f"service CPU {_fmt(x['cpu_ms_per_token'], '.1f')} ms/token"
                    )
    return summarise(results)


NAMES = ("tokens_per_s", "tpot_ms", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "cpu_ms_per_token")
CPU_NAMES = ("cpu_ms_per_token", "gateway_cpu_ms_per_token", "verifier_cpu_ms_per_token")


def summarise(results: dict[tuple[str, int, str], list[Measurement]]) -> dict:
    rows: list[dict[str, Any]] = []
    overhead: list[dict[str, Any]] = []
    checks: list[str] = []
    for kind, clients, key in sorted(results, key=lambda k: (list(STACK_LABELS).index(k[0]), k[1], k[2])):
        sums = [m.summary() for m in results[(kind, clients, key)]]
        rows.append(
            {"stack": kind, "clients": clients, "key": key}
            | {n: _median([x.get(n) for x in sums]) for n in NAMES + CPU_NAMES}
        )
        if key != "b":
            continue
        a_runs, b_runs = results[(kind, clients, "a")], results[(kind, clients, "b")]
        ratios: dict[str, list[float]] = {n: [] for n in NAMES}
        same = total = 0
        for a, b in zip(a_runs, b_runs, strict=True):
            sa, sb = a.summary(), b.summary()
            for n in NAMES:
                if sa.get(n) and sb.get(n) is not None:
                    ratios[n].append(sb[n] / sa[n])
            for ta, tb in zip(a.traces, b.traces, strict=True):
                same += ta.ids == tb.ids
                total += 1
        tpot, tps = _median(ratios["tpot_ms"]), _median(ratios["tokens_per_s"])
        ok = tpot is not None and tps is not None and tpot <= 1 + OVERHEAD_TARGET and tps >= 1 - OVERHEAD_TARGET
        o: dict[str, Any] = {"stack": kind, "clients": clients, "runs": ratios, "pass": ok}
        overhead.append(o | {n: _median(ratios[n]) for n in NAMES})
        checks.append(
            f"{STACK_LABELS[kind]}, {clients} client(s): (b) == (a) token for token in {same}/{total} requests"
        )
    return {"rows": rows, "overhead": overhead, "checks": checks}


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# ---- the report ---------------------------------------------------------------------------------------------


def _one_minute(load: str) -> float:
    try:
        return float(load.split()[0])
    except (IndexError, ValueError):  # "n/a"
        return 0.0


def render(summary: dict, meta: dict) -> str:
    m = meta["machine"]
    busy = max(_one_minute(meta["load_start"]), _one_minute(meta["load_end"]))
    out = [MARK_START, "## TLS + mutual TLS + API key overhead (`specdec_bench.secure_bench`)", ""]
    out += [
        f"- Date: {meta['date']}; wall time of the whole benchmark: {meta['runtime_s'] / 60:.1f} min"
        + (" (**--quick smoke run: not a measurement**)" if meta["quick"] else ""),
        f"- Command: `{meta['command']}`",
        f"- Machine: {m['cpu']}, {m['cores']} cores available, torch {m['torch']}, Python {m['python']}; every "
        f"process on the same cores; load average (1/5/15 min) at start / end: {meta['load_start']} / "
        f"{meta['load_end']}"
        + (
            f" (**above {HIGH_LOAD:g}: busy with other jobs; read the ratios, not the absolute figures**)"
            if busy > HIGH_LOAD
            else " (the machine is shared with other jobs)"
        ),
        f"- Model: target `{meta['target']}`"
        + (f", draft `{meta['draft']}`" if meta["with_draft"] else "")
        + f"; verifier `--max-model-len {MAX_MODEL_LEN} --max-num-seqs {MAX_NUM_SEQS}`, target only = no proposer",
        "- (a) plaintext, no API keys; (b) every port TLS (trustme certificates, ECDSA keys), gateway -> verifier"
        + (" and verifier <-> proposer" if meta["with_draft"] else "")
        + " mutual TLS, the client verifies the gateway (server-only TLS) and sends `authorization: Bearer KEY` "
        "checked against `--api-keys-file` (one key)",
        f"- Work: greedy, {meta['max_tokens']} new tokens per request (EOS ignored), the general chat prompts "
        f"(`specdec_bench.prompts`, chat template); 1 client: {meta['batch1_prompts']} prompt(s) per run one after "
        f"another, (a) and (b) alternating request by request; 8 clients: 8 prompts at once, (a) and (b) "
        f"alternating; {meta['runs']} run(s), the first of each pair swapping from run to run; medians over runs",
        "",
        "| stack | clients | configuration | tokens/s | TPOT ms | ITL p50 ms | ITL p99 ms | TTFT p50 ms "
        "| service CPU ms/token: all | gateway | verifier |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in summary["rows"]:
        out.append(
            f"| {STACK_LABELS[r['stack']]} | {r['clients']} | {CONFIGS[r['key']]} | {_fmt(r['tokens_per_s'], '.1f')} "
            f"| {_fmt(r['tpot_ms'], '.1f')} | {_fmt(r['itl_p50_ms'], '.1f')} | {_fmt(r['itl_p99_ms'], '.1f')} "
            f"| {_fmt(r['ttft_p50_ms'], '.0f')} | " + " | ".join(_fmt(r[n], ".1f") for n in CPU_NAMES) + " |"
        )
    out += [
        "",
        f"### Overhead (b)/(a), medians of the per-run ratios (target: at most {OVERHEAD_TARGET:.0%} per token)",
        "",
        "| stack | clients | TPOT (b)/(a) | tokens/s (b)/(a) | ITL p50 (b)/(a) | ITL p99 (b)/(a) | TTFT (b)/(a) "
        "| service CPU/token (b)/(a) | TPOT ratio per run | result |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for o in summary["overhead"]:
        per_run = ", ".join(f"{x:.3f}" for x in o["runs"]["tpot_ms"])
        out.append(
            f"| {STACK_LABELS[o['stack']]} | {o['clients']} | "
            + " | ".join(
                _fmt(o[n], ".3f")
                for n in ("tpot_ms", "tokens_per_s", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "cpu_ms_per_token")
            )
            + f" | {per_run} | {'PASS' if o['pass'] else 'FAIL'} |"
        )
    out += ["", "### Checks", ""]
    out += [f"- {line}" for line in summary["checks"] + [f"(b) {x}" for x in meta["secured"]]]
    out += ["", "### How to read this", "", HOW_TO_READ, MARK_END, ""]
    return "\n".join(out)


HOW_TO_READ = """\
PASS means TPOT (b)/(a) <= 1.03 and tokens/s (b)/(a) >= 0.97. TPOT is a request's time after its first
streamed message divided by its tokens after the first, averaged over the run's requests; ITL is the gap
between consecutive streamed messages; tokens/s is all tokens over the wall time. What (b) adds per token:
encrypting and decrypting one small streamed message on each hop (verifier -> gateway, gateway -> client),
a few hundred bytes of AES-GCM, against a target forward of tens of milliseconds. Per request: the API key
check (a stat of the key file, a SHA-256, a constant-time compare). Per connection: the TLS handshake; the
gateway's channel to the verifier stays open, but this client opens a new channel for every measurement (each
1-client request, each 8-client batch), so TTFT of (b) includes a handshake and TTFT (b)/(a) is an upper
bound. All processes share the 2 cores with each other and with other jobs: a ratio inside the per-run spread
is not resolved on this machine. Service CPU ms/token is the user + system CPU time of the stack's processes
(gateway; verifier, and proposer with --draft) during the measurement, over its tokens: the work each
configuration does, which grows much less than wall time when other jobs take the cores."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke check: 1 run, 1 prompt at 1 client, 16 tokens")
    parser.add_argument(
        "--runs",
        type=int,
        default=None,
        help="repetitions, median reported (default 8, even: each order equally often; quick 1)",
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (default 64; quick 16)")
    parser.add_argument("--batch1-prompts", type=int, default=None, help="prompts per 1-client run (default 2)")
    parser.add_argument("--draft", action="store_true", help="also the draft-model pair (proposer, k = 4)")
    parser.add_argument("--out", default="docs/BENCHMARKS.md", help="Markdown file to update ('' to skip)")
    args = parser.parse_args(argv)
    plan = Plan(
        runs=args.runs or (1 if args.quick else 8),
        max_tokens=args.max_tokens or (16 if args.quick else 64),
        batch1_prompts=args.batch1_prompts or (1 if args.quick else 2),
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    malloc_tuned = tune_malloc()
    import torch

    torch.set_num_threads(NUM_THREADS)
    log = Progress()
    load_start = load_average()
    target, draft = default_target_model(), default_draft_model()
    work = Path(tempfile.mkdtemp(prefix="specdec-secure-bench-"))
    s = make_secrets(work)
    kinds = ["target", "draft"] if args.draft else ["target"]
    pairs: dict[str, dict[str, Stack]] = {}
    for key in CONFIGS:
        (work / key).mkdir()
        for kind, stack in build_stacks(work / key, target, draft, names=kinds).items():
            pairs.setdefault(kind, {})[key] = secure(stack, s) if key == "b" else stack
    procs = [p for pair in pairs.values() for st in pair.values() for p in st.procs]
    log(f"starting {len(procs)} service processes; certificates, key file and logs in {work}")
    try:
        for p in procs:
            p.start()
        from shared.model.loader import load_tokenizer

        tok = load_tokenizer(target)
        prompts = [chat_ids(tok, p) for p in GENERAL_PROMPTS]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for pair in pairs.values():
            for st in pair.values():
                st.wait_ready(deadline)
        secured = check_secured(pairs["target"]["b"].gateway.address, s)
        log(f"all services ready; (b) checked: {'; '.join(secured)}; plan {plan}")
        summary = run_benchmark(pairs, s, prompts, plan, log)
    except BaseException:
        for p in procs:
            print(f"----- {p.name} (last lines) -----\n{p.tail(15)}", file=sys.stderr)
        raise
    finally:
        codes = {p.name: p.stop() for p in reversed(procs)}
        if any(c != 0 for c in codes.values()):
            print(f"services that did not exit with 0 after SIGTERM: {codes}; logs in {work}", file=sys.stderr)
    runtime = time.perf_counter() - log.start
    meta = {
        **run_meta("secure_bench", argv, runtime, malloc_tuned, load_start),
        "quick": args.quick,
        "target": target,
        "draft": draft,
        "with_draft": args.draft,
        "secured": secured,
        "runs": plan.runs,
        "max_tokens": plan.max_tokens,
        "batch1_prompts": plan.batch1_prompts,
    }
    section = render(summary, meta)
    print(section)
    if args.out:
        write_report(Path(args.out), section, MARK_START, MARK_END)
        log(f"wrote {args.out}")
    log(f"done in {runtime / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
