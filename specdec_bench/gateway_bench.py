"""Gateway benchmark: the engine benchmark's workloads through the whole gRPC stack, side by side with the
in-process engine.

    python -m specdec_bench.gateway_bench [--quick] [--runs N] [--max-tokens N] [--only t,g4] [--dtype float32,bfloat16]
        [--out docs/BENCHMARKS.md]

Starts real service processes on loopback (as tests/e2e does) and sends the engine benchmark's chat prompts
(specdec_bench.prompts, chat template applied by engine_bench.chat_ids) through the gateway with grpc.aio,
greedy (and T = 0.8 without a seed, i.e. rejection sampling, for the rows marked so), EOS ignored so every
request generates exactly --max-tokens tokens:

    target only       verifier without --proposer (k = 0) + gateway                    general prompts, T 0, 0.8
    draft model, k=4  proposer (draft model) + verifier (--num-speculative-tokens 4 --no-adaptive-k) + gateway
                                                                                       general prompts, T 0, 0.8
    EAGLE head, k=4   proposer (--kind eagle: the head, the target's embedding and LM head) + verifier (k = 4
                      fixed, sends the target's hidden states) + gateway               general prompts, T 0, 0.8
    n-gram, k=4       proposer (--kind ngram) + verifier (k = 4 fixed) + gateway        quoting prompts
    target only [q]   the target-only stack on the quoting prompts (the n-gram row's baseline)

The EAGLE rows are left out, with a message, when the head's folder (--eagle-head) does not exist; --only
runs a subset of the rows (the target-only baseline of each is added). --dtype lists the target dtypes: a half
dtype (bfloat16, float16) runs the target-only, draft-model and EAGLE rows again with the verifier (and the draft
model) at `--dtype` that dtype, in the same run, each against its own target-only row; the EAGLE head runs at
`--head-dtype` (default auto, as `make run`: bf16 on a CPU with bf16 instructions, else fp32) whatever the
target's dtype. A run with a half dtype writes its own section of the report.

each at 1 client (the batch-1 prompts one after another) and 8 concurrent clients (8 prompts at once).
Per configuration: tokens/s (all tokens / wall time), time to first token, inter-token latency p50/p99
(gaps between consecutive streamed messages that carry tokens; a message may carry several tokens), and
TPOT (time per output token after the first, per request). The in-process engine (the same target and
draft, same EngineConfig, k = 4 fixed, no gRPC anywhere) runs the same batch-1 prompts in the same run,
so the network split's per-token overhead is a side-by-side ratio. Every configuration is repeated --runs
times (the order rotates from run to run) and medians are reported; ratios are taken within a run.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from gateway.health_probe import check_once
from proposer_service.config import MODEL_KINDS
from shared.malloc_tuning import tune_malloc
from shared.model.dtype import resolve_head_dtype
from shared.proto_gen.specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from shared.settings import default_draft_model, default_target_model
from shared.tls import ClientTLS, aio_channel, sync_channel
from specdec_bench.engine_bench import NUM_THREADS, chat_ids
from specdec_bench.prompts import GENERAL_PROMPTS, QUOTING_PROMPTS
from specdec_bench.report import load_average, run_meta, write_report
from specdec_local.processes import free_port
from specdec_local.run_figures import figures, scrape

HOST = "127.0.0.1"
K = 4
MAX_MODEL_LEN = 1024  # as the engine benchmark
MAX_NUM_SEQS = 8
CLIENTS = (1, 8)
STARTUP_TIMEOUT_S = 600.0
RPC_TIMEOUT_S = 1200.0
MARK_START = "<!-- gateway-bench:start -->"
MARK_END = "<!-- gateway-bench:end -->"
MARK_START_HALF = "<!-- gateway-bench-half:start -->"  # a run with a half-precision target (--dtype)
MARK_END_HALF = "<!-- gateway-bench-half:end -->"
MARK_START_SPLIT = "<!-- gateway-bench-split:start -->"  # --placement split: each service on its own core
MARK_END_SPLIT = "<!-- gateway-bench-split:end -->"
OVERHEAD_TARGET = 0.10
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class GwConfig:
    key: str
    label: str
    prompt_set: str  # "general" or "quoting"
    stack: str  # "target", "draft", "eagle" or "ngram"
    temperature: float = 0.0
    baseline: str = "t"  # the target-only row of the same prompts and temperature
    front: str = "grpc"  # "grpc", or "http": the OpenAI-compatible API with SSE streaming (httpx)
    logprobs: int | None = None  # ask each token's logprobs with this many alternatives
    dtype: str = "float32"  # the target's (and draft model's) --dtype


SAMPLED_T = 0.8
K_ADAPTIVE = 4  # what `make run` serves: the engine's policy picks k <= 4 per sequence
AHEAD = 3  # --draft-ahead: the proposer's likeliest outcomes drafted while the verifier scores
TREE_NODES = 8  # --max-tree-nodes of the tree rows
CONFIGS: tuple[GwConfig, ...] = (
    GwConfig("t", "target only (k=0)", "general", "target"),
    GwConfig("d4", "draft model, k=4", "general", "draft"),
    GwConfig("g4", "EAGLE head, k=4", "general", "eagle"),
    GwConfig("ts", f"target only (k=0), T={SAMPLED_T:g}", "general", "target", SAMPLED_T, "ts"),
    GwConfig("d4s", f"draft model, k=4, T={SAMPLED_T:g}", "general", "draft", SAMPLED_T, "ts"),
    GwConfig("g4s", f"EAGLE head, k=4, T={SAMPLED_T:g}", "general", "eagle", SAMPLED_T, "ts"),
    GwConfig("g4t", f"EAGLE head, k=4, a tree<={TREE_NODES} nodes every step", "general", "eagle-tree"),
    GwConfig(
        "g4ts",
        f"EAGLE head, k=4, a tree<={TREE_NODES} nodes every step, T={SAMPLED_T:g}",
        "general",
        "eagle-tree",
        SAMPLED_T,
        "ts",
    ),
    GwConfig("ga", f"EAGLE head, adaptive k<={K_ADAPTIVE}, chains", "general", "eagle-adaptive"),
    GwConfig(
        "gas",
        f"EAGLE head, adaptive k<={K_ADAPTIVE}, chains, T={SAMPLED_T:g}",
        "general",
        "eagle-adaptive",
        SAMPLED_T,
        "ts",
    ),
    GwConfig("g4d", f"EAGLE head, k=4, drafting ahead {AHEAD}", "general", "eagle-ahead"),
    GwConfig(
        "g4ds", f"EAGLE head, k=4, drafting ahead {AHEAD}, T={SAMPLED_T:g}", "general", "eagle-ahead", SAMPLED_T, "ts"
    ),
    GwConfig("gad", f"EAGLE head, adaptive k<={K_ADAPTIVE}, drafting ahead {AHEAD}", "general", "eagle-adaptive-ahead"),
    GwConfig(
        "gads",
        f"EAGLE head, adaptive k<={K_ADAPTIVE}, drafting ahead {AHEAD}, T={SAMPLED_T:g}",
        "general",
        "eagle-adaptive-ahead",
        SAMPLED_T,
        "ts",
    ),
    GwConfig(
        "gt",
        f"EAGLE head, adaptive k<={K_ADAPTIVE}, trees<={TREE_NODES} nodes (default)",
        "general",
        "eagle-adaptive-tree",
    ),
    GwConfig(
        "gto",
        f"EAGLE head alone (no request text), adaptive k<={K_ADAPTIVE}, trees<={TREE_NODES} nodes",
        "general",
        "eagle-adaptive-tree-solo",
    ),
    GwConfig(
        "gts",
        f"EAGLE head, adaptive k<={K_ADAPTIVE}, trees<={TREE_NODES} nodes, T={SAMPLED_T:g}",
        "general",
        "eagle-adaptive-tree",
        SAMPLED_T,
        "ts",
    ),
    # the HTTP front end and logprobs, each against the gRPC draft-model row (their "× target" is "× d4")
    GwConfig("d4h", "draft model, k=4, HTTP/SSE (× d4)", "general", "draft", baseline="d4", front="http"),
    GwConfig("d4l", "draft model, k=4, logprobs top 5 (× d4)", "general", "draft", baseline="d4", logprobs=5),
    GwConfig("tq", "target only (k=0) [quoting]", "quoting", "target", baseline="tq"),
    GwConfig("n4", "n-gram, k=4 [quoting]", "quoting", "ngram", baseline="tq"),
)
# Rows run again with a half-precision target when --dtype asks for it (key, label and stack get the suffix).
HALF_DTYPES = {"bfloat16": "bf16", "float16": "fp16"}
HALF_TWINS = ("t", "d4", "g4", "g4t", "ga", "ts", "g4s", "g4ts", "gas", "gt", "gts")
# The policy's rows against the fixed configurations it chooses among (issue 23: at most 5% slower than the best)
POLICY_AGAINST_FIXED = (("gt", ("g4", "g4t")), ("gts", ("g4s", "g4ts")))
POLICY_TARGET = 0.95


def _twin(cfg: GwConfig, dtype: str) -> GwConfig:
    suffix = HALF_DTYPES[dtype]
    return replace(
        cfg,
        key=f"{cfg.key}-{suffix}",
        label=f"{cfg.label}, {suffix} target",
        stack=f"{cfg.stack}-{suffix}",
        baseline=f"{cfg.baseline}-{suffix}",
        dtype=dtype,
    )


CONFIGS += tuple(_twin(c, d) for d in HALF_DTYPES for c in CONFIGS if c.key in HALF_TWINS)
CONFIG_BY_KEY = {c.key: c for c in CONFIGS}
INPROC_LABEL = "in-process engine, draft model, k=4"
DIRECT_LABEL = "verifier directly (no gateway), draft model, k=4"


# ---- the service processes -----------------------------------------------------------------------------


def _command(script: str, module: str) -> list[str]:
    exe = Path(sys.executable).parent / script
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-c", f"import sys; sys.argv[0] = {script!r}; from {module} import main; main()"]


def _service_env() -> dict[str, str]:
    keep = {"SPECDEC_CACHE_DIR", "SPECDEC_MODEL_DIR", "SPECDEC_TARGET_MODEL", "SPECDEC_DRAFT_MODEL"}
    keep.add("SPECDEC_LOG_LEVEL")  # e.g. DEBUG: the speculation policy's reasons, step by step
    keep.add("SPECDEC_MKL_PRODUCTS")  # 0: oneDNN's fp32 products (an A/B of shared/model/mkl_product.py)
    keep.update({"SPECDEC_BF16_TILES", "SPECDEC_FP32_TILES"})  # 0: oneDNN's products (A/Bs of shared/model/tiles.py)
    keep.add("SPECDEC_HUGEPAGES")  # 0: the services' pages as the kernel gives them (an A/B of shared/hugepages.py)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_") or k in keep}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Proc:
    name: str
    cmd: list[str]
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)  # on top of the services' environment (placement)

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**_service_env(), **self.env},
                cwd=ROOT,
            )

    def tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(line.rsplit("\r", 1)[-1] for line in lines[-n:])

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@dataclass
class Stack:
    name: str
    procs: list[Proc] = field(default_factory=list)
    tls: ClientTLS | None = None  # how this script reaches the services (secure_bench: mutual TLS)
    http_port: int = 0  # the gateway's OpenAI-compatible HTTP API (0: off)
    metrics_ports: dict[str, int] = field(default_factory=dict)  # role -> Prometheus port, as `make run` has them

    def figures(self) -> list[str]:
        """The speculation figures `make run` prints, over everything this stack served."""
        if "verifier" not in self.metrics_ports:
            return []
        verifier = scrape(f"{HOST}:{self.metrics_ports['verifier']}")
        proposer = scrape(f"{HOST}:{self.metrics_ports['proposer']}") if "proposer" in self.metrics_ports else {}
        return figures(verifier, proposer)

    @property
    def gateway(self) -> Proc:
        return self.procs[-1]

    @property
    def verifier(self) -> Proc:
        return self.procs[-2]

    def wait_ready(self, deadline: float) -> None:
        for p in self.procs:
            service = "specdec.v1.Gateway" if p is self.gateway else ""
            while not check_once(p.address, service, tls=self.tls)[0]:
                if p.proc is not None and p.proc.poll() is not None:
                    raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n{p.tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{p.name} not healthy after {STARTUP_TIMEOUT_S:.0f} s:\n{p.tail()}")
                time.sleep(0.5)
        if len(self.procs) == 3:  # with a proposer: wait until the verifier has connected to it
            while not self.verifier_stats().stats.proposer_connected:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.verifier.name} never connected to its proposer:\n{self.verifier.tail()}")
                time.sleep(0.5)

    def verifier_stats(self) -> verifier_pb2.VerifierGetStatsResponse:
        with sync_channel(self.verifier.address, self.tls) as ch:
            return verifier_pb2_grpc.VerifierStub(ch).GetStats(verifier_pb2.VerifierGetStatsRequest(), timeout=30)


def select_configs(
    only: str, eagle: bool, eagle_dir: str = "", dtypes: Sequence[str] = ("float32",)
) -> tuple[tuple[str, ...], list[str]]:
    """The keys to run and notes. `only`: comma-separated fp32 keys ('' for all); each row's target-only baseline
    is added. `dtypes`: float32 keeps the rows, a half dtype adds their twins at that dtype (HALF_TWINS), a list
    without float32 runs the twins alone. Without an EAGLE head its rows are left out (an error when asked for
    by name)."""
    notes = []
    for dtype in dtypes:
        if dtype != "float32" and dtype not in HALF_DTYPES:
            raise SystemExit(f"--dtype: unknown dtype {dtype!r}; choose from float32, {', '.join(HALF_DTYPES)}")
    if only:
        wanted = [k.strip() for k in only.split(",") if k.strip()]
        unknown = [k for k in wanted if k not in CONFIG_BY_KEY or CONFIG_BY_KEY[k].dtype != "float32"]
        if unknown:
            raise SystemExit(f"--only: unknown row(s) {unknown}; rows are {', '.join(CONFIG_BY_KEY)}")
        picked = set(wanted)
        for key in wanted:
            base = CONFIG_BY_KEY[key].baseline
            if base not in picked:
                picked.add(base)
                notes.append(f"added {base} (the baseline of {key})")
        if not eagle and any(CONFIG_BY_KEY[k].stack.startswith("eagle") for k in picked):
            raise SystemExit(
                f"--only asks for EAGLE rows but there is no head at {eagle_dir or '?'} (no config.json): "
                "set --eagle-head or SPECDEC_EAGLE_HEAD"
            )
    else:
        picked = {c.key for c in CONFIGS if c.dtype == "float32" and (eagle or not c.stack.startswith("eagle"))}
    twins = {f"{k}-{HALF_DTYPES[d]}" for d in dtypes if d in HALF_DTYPES for k in picked if k in HALF_TWINS}
    if "float32" not in dtypes:
        picked = set()
    picked |= twins
    if not picked:
        raise SystemExit(f"--dtype {','.join(dtypes)}: none of the selected rows has a twin at that dtype")
    return tuple(c.key for c in CONFIGS if c.key in picked), notes


STACK_KINDS = {
    "target": None,
    "draft": "draft-model",
    "eagle": "eagle",
    "eagle-adaptive": "eagle",
    "eagle-ahead": "eagle",
    "eagle-adaptive-ahead": "eagle",
    "eagle-adaptive-tree": "eagle",
    "eagle-tree": "eagle",  # k = 4 and a tree every step: what the adaptive policy is measured against
    # `make run`'s stack with the head's drafts alone (`--no-suffix-branches`): the A/B of the request's own text
    "eagle-adaptive-tree-solo": "eagle",
    "ngram": "ngram",
    "suffix-adaptive": "suffix",  # suffix_bench's stack: adaptive k <= K_SUFFIX
    # A second target-only stack, started after the others: paired rounds' A/A control. Its ratio to target-only
    # is the spread a ratio has where the two stacks do not differ at all (only on request: it is no product row).
    "target-twin": None,
}
TWIN = "target-twin"
K_SUFFIX = 16  # suffix drafts are as long as the match is sure: the repeat of an answer drafts 16 at a time


PLACEMENTS = ("co-located", "split")
VERIFIER_CORE, PROPOSER_CORE = 0, 1  # split: the verifier's device and the proposer's (with gateway and client)


def pinned(cmd: list[str], core: int | None) -> tuple[list[str], dict[str, str]]:
    """`cmd` run on one core with one thread (split placement), or as is (None)."""
    if core is None:
        return cmd, {}
    return ["taskset", "-c", str(core), *cmd], {"OMP_NUM_THREADS": "1"}


def build_stacks(
    log_dir: Path,
    target: str,
    draft: str,
    eagle_head: str | None = None,
    names: Sequence[str] = (),
    placement: str = "co-located",
    compile: bool = False,
    head_dtype: str = "auto",
) -> dict[str, Stack]:
    """One stack per name (default: all but eagle, which needs `eagle_head`): target only, draft model,
    EAGLE head, n-gram; every proposer stack with k = 4 fixed unless its name says otherwise. `split`: the
    verifier alone on core 0, the proposer and the gateway on core 1, one thread each (the deployment the
    product is built for: each service on its own device). `compile`: every verifier, and every proposer that runs
    a model (EAGLE head, draft model), with `--compile`."""
    split = placement == "split"
    core_of = {"verifier": VERIFIER_CORE if split else None, "other": PROPOSER_CORE if split else None}
    stacks = {}
    names = names or [
        n for n in STACK_KINDS if STACK_KINDS[n] != "suffix" and (STACK_KINDS[n] != "eagle" or eagle_head) and n != TWIN
    ]
    for name in names:
        base, dtype = _stack_dtype(name)
        kind = STACK_KINDS[base]
        solo, base = base.endswith(SOLO), base.removesuffix(SOLO)
        stack = Stack(name, http_port=free_port())
        ports = {role: free_port() for role in ("proposer", "verifier", "gateway")}
        stack.metrics_ports["verifier"] = free_port()
        verifier = ["--model", target, "--host", HOST, "--port", str(ports["verifier"])]
        verifier += ["--metrics-port", str(stack.metrics_ports["verifier"])]
        verifier += ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS), "--dtype", dtype]
        verifier += ["--compile"] if compile else []
        if kind is not None:
            stack.metrics_ports["proposer"] = free_port()
            proposer = ["--kind", kind, "--host", HOST, "--port", str(ports["proposer"])]
            proposer += ["--metrics-port", str(stack.metrics_ports["proposer"])]
            proposer += ["--max-model-len", str(MAX_MODEL_LEN)]
            if kind == "draft-model":
                proposer += ["--model", draft, "--dtype", dtype]
            if kind == "eagle":
                assert eagle_head is not None
                proposer += ["--model", eagle_head, "--target-model", target, "--dtype", head_dtype]
            if compile and kind in MODEL_KINDS:
                proposer += ["--compile"]
            if solo:
                proposer += ["--no-suffix-branches"]
            if base.endswith("-ahead"):
                proposer += ["--draft-ahead", str(AHEAD)]
            if base.endswith("-tree"):
                verifier += ["--max-tree-nodes", str(TREE_NODES)]
            cmd, env = pinned(_command("specdec-proposer", "proposer_service.server") + proposer, core_of["other"])
            log_path = log_dir / f"{name}-proposer.log"
            stack.procs.append(Proc(f"{name}-proposer", cmd, ports["proposer"], log_path, env=env))
            verifier += ["--proposer", f"{HOST}:{ports['proposer']}"]
            if "-adaptive" in base:
                k = K_SUFFIX if kind == "suffix" else K_ADAPTIVE
                verifier += ["--num-speculative-tokens", str(k), "--adaptive-k"]
            else:
                verifier += ["--num-speculative-tokens", str(K), "--no-adaptive-k"]
        cmd, env = pinned(_command("specdec-verifier", "verifier_service.server") + verifier, core_of["verifier"])
        stack.procs.append(Proc(f"{name}-verifier", cmd, ports["verifier"], log_dir / f"{name}-verifier.log", env=env))
        gateway = ["--verifiers", f"{HOST}:{ports['verifier']}", "--tokenizer", target]
        gateway += ["--host", HOST, "--port", str(ports["gateway"]), "--health-check-timeout-s", "5"]
        gateway += ["--http-port", str(stack.http_port)]
        cmd, env = pinned(_command("specdec-gateway", "gateway.server") + gateway, core_of["other"])
        stack.procs.append(Proc(f"{name}-gateway", cmd, ports["gateway"], log_dir / f"{name}-gateway.log", env=env))
        if name.endswith(SMALL_PAGES):
            for proc in stack.procs:
                proc.env["SPECDEC_HUGEPAGES"] = "0"
        stacks[name] = stack
    return stacks


SOLO = "-solo"  # a model proposer's drafts alone, without the request's own text (--no-suffix-branches)
SMALL_PAGES = "-4k"  # a stack name's last suffix: its services with SPECDEC_HUGEPAGES=0 (an A/B of huge pages)


def _stack_dtype(name: str) -> tuple[str, str]:
    """A stack's name without its dtype suffix, and its dtype: `eagle-adaptive-bf16` -> (eagle-adaptive, bfloat16)."""
    name = name.removesuffix(SMALL_PAGES)
    for dtype, suffix in HALF_DTYPES.items():
        if name.endswith(f"-{suffix}"):
            return name.removesuffix(f"-{suffix}"), dtype
    return name, "float32"


# ---- measurements ------------------------------------------------------------------------------------------


@dataclass
class Trace:
    """One request: when it was sent and when each token-carrying message arrived (with its token count)."""

    sent: float
    times: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    steps: int = 0

    def arrived(self, at: float, token_ids) -> None:
        """A message with tokens arrived at `at` (time.perf_counter())."""
        self.times.append(at)
        self.counts.append(len(token_ids))
        self.ids.extend(token_ids)

    @property
    def tokens(self) -> int:
        return sum(self.counts)

    @property
    def ttft(self) -> float:
        return self.times[0] - self.sent

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first message's tokens."""
        after = self.tokens - self.counts[0]
        return (self.times[-1] - self.times[0]) / after if after > 0 else None


@dataclass
class Measurement:
    wall_s: float
    traces: list[Trace]

    @property
    def tokens(self) -> int:
        return sum(t.tokens for t in self.traces)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    def summary(self) -> dict:
        ttft = [t.ttft for t in self.traces]
        itl = [x for t in self.traces for x in t.itl]
        tpot = [x for t in self.traces if (x := t.tpot) is not None]
        drafted = sum(t.drafted for t in self.traces)
        accepted = sum(t.accepted for t in self.traces)
        steps = sum(t.steps for t in self.traces)
        decode_steps = sum(max(t.steps - 1, 0) for t in self.traces)  # all but the prefill step
        return {
            "tokens": self.tokens,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
            "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)),
            "itl_p50_ms": 1e3 * float(np.percentile(itl, 50)) if itl else None,
            "itl_p99_ms": 1e3 * float(np.percentile(itl, 99)) if itl else None,
            "tpot_ms": 1e3 * statistics.mean(tpot) if tpot else None,
            "drafted": drafted,
            "accepted": accepted,
            "tokens_per_step": self.tokens / steps if steps else None,
            # with k fixed every decode step is a draft round: 1 + accepted / rounds
            "mean_accepted_length": 1 + accepted / decode_steps if drafted and decode_steps else None,
        }


async def run_gateway(
    address: str,
    prompts: Sequence[list[int]],
    clients: int,
    max_tokens: int,
    temperature: float = 0.0,
    tls: ClientTLS | None = None,
    metadata: Sequence[tuple[str, str]] = (),
    logprobs: int | None = None,
    max_draft_tokens: int | None = None,
) -> Measurement:
    """`clients` concurrent clients work through the prompts (each client one request at a time). Sampled
    requests carry no seed, as most traffic: a seed would switch verification to coupling (docs/engine.md,
    "Seeded sampling"), which engine_bench measures beside rejection sampling. `tls` and `metadata` (an API
    key) are secure_bench's client. `logprobs`: ask each token's logprobs with that many alternatives.
    `max_draft_tokens`: each request's own cap on k (0: a speculative stack decodes it plainly)."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    traces: list[tuple[int, Trace]] = []
    order = {id(p): i for i, p in enumerate(prompts)}

    async with aio_channel(address, tls) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def client() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                request = gateway_pb2.GenerateRequest(
                    prompt_token_ids=prompt, max_tokens=max_tokens, temperature=temperature, ignore_eos=True
                )
                if logprobs is not None:
                    request.logprobs, request.top_logprobs = True, logprobs
                if max_draft_tokens is not None:
                    request.max_draft_tokens = max_draft_tokens
                trace = Trace(time.perf_counter())
                async for msg in stub.Generate(request, timeout=RPC_TIMEOUT_S, metadata=tuple(metadata)):
                    now = time.perf_counter()
                    if msg.token_ids:
                        trace.arrived(now, msg.token_ids)
                    if msg.HasField("usage"):
                        trace.drafted, trace.accepted = msg.usage.drafted_tokens, msg.usage.accepted_tokens
                        trace.steps = msg.usage.num_steps
                if trace.tokens != max_tokens:
                    raise RuntimeError(f"{address}: {trace.tokens} tokens instead of {max_tokens}")
                traces.append((order[id(prompt)], trace))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - start
    return Measurement(wall, [t for _, t in sorted(traces, key=lambda x: x[0])])


async def run_http(
    base_url: str, prompts: Sequence[list[int]], clients: int, max_tokens: int, temperature: float = 0.0
) -> Measurement:
    """run_gateway's workload through the OpenAI-compatible API: /v1/completions with SSE streaming (token id
    prompts, vLLM's return_token_ids for the per-event token counts, include_usage for the counters)."""
    import httpx

    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    traces: list[tuple[int, Trace]] = []
    order = {id(p): i for i, p in enumerate(prompts)}
    async with httpx.AsyncClient(base_url=base_url, timeout=RPC_TIMEOUT_S) as http:

        async def client() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                body: dict[str, Any] = {
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": temperature,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "return_token_ids": True,
                }
                trace = Trace(time.perf_counter())
                async with http.stream("POST", "/v1/completions", json=body) as reply:
                    if reply.status_code != 200:
                        raise RuntimeError(f"{base_url}: HTTP {reply.status_code}: {(await reply.aread())[:300]!r}")
                    async for line in reply.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        now = time.perf_counter()
                        event = json.loads(line[len("data: ") :])
                        ids = event["choices"][0].get("token_ids", []) if event["choices"] else []
                        if ids:
                            trace.arrived(now, ids)
                        if event.get("usage"):
                            trace.drafted = event["usage"]["drafted_tokens"]
                            trace.accepted = event["usage"]["accepted_tokens"]
                trace.steps = len(trace.counts)  # one event per engine step that emitted tokens
                if trace.tokens != max_tokens:
                    raise RuntimeError(f"{base_url}: {trace.tokens} tokens instead of {max_tokens}")
                traces.append((order[id(prompt)], trace))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - start
    return Measurement(wall, [t for _, t in sorted(traces, key=lambda x: x[0])])


async def run_verifier(address: str, prompts: Sequence[list[int]], max_tokens: int) -> Measurement:
    """One client calling Verifier.Generate directly (no gateway hop), prompts one after another."""
    traces = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        start = time.perf_counter()
        for prompt in prompts:
            request = verifier_pb2.VerifierGenerateRequest(
                prompt_token_ids=prompt,
                sampling_params=common_pb2.SamplingParams(temperature=0.0),
                max_tokens=max_tokens,
                ignore_eos=True,
            )
            trace = Trace(time.perf_counter())
            async for msg in stub.Generate(request, timeout=RPC_TIMEOUT_S):
                if msg.token_ids:
                    trace.arrived(time.perf_counter(), msg.token_ids)
                if msg.HasField("usage"):
                    trace.drafted, trace.accepted = msg.usage.drafted_tokens, msg.usage.accepted_tokens
                    trace.steps = msg.usage.num_steps
            if trace.tokens != max_tokens:
                raise RuntimeError(f"{address}: {trace.tokens} tokens instead of {max_tokens}")
            traces.append(trace)
        wall = time.perf_counter() - start
    return Measurement(wall, traces)


class InProcess:
    """The engine in this process: same target and draft, same EngineConfig, k = 4 fixed, batch 1."""

    def __init__(self, target_name: str, draft_name: str) -> None:
        from shared.model.build import CacheConfig
        from shared.model.loader import check_same_vocabulary, load_model
        from specdec_local.builder import build_engine, make_draft_model_drafter
        from verifier_service.engine import EngineConfig

        target = load_model(target_name)
        draft = load_model(draft_name)
        check_same_vocabulary(target[1], draft[1], target_name, draft_name)
        config = EngineConfig(
            num_speculative_tokens=K, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN, adaptive_k=False
        )
        drafter = make_draft_model_drafter(*draft, config, CacheConfig())
        self.engine = build_engine(target, drafter, config)
        self._n = 0

    def run(self, prompts: Sequence[list[int]], max_tokens: int) -> Measurement:
        import torch

        from shared.sampling import SamplingParams

        traces = []
        start = time.perf_counter()
        with torch.inference_mode():
            for prompt in prompts:
                self._n += 1
                rid = f"bench-{self._n}"
                trace = Trace(time.perf_counter())
                self.engine.add_request(
                    rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                )
                while self.engine.has_unfinished():
                    for out in self.engine.step():
                        if out.request_id != rid:
                            continue
                        if out.new_token_ids:
                            trace.arrived(time.perf_counter(), out.new_token_ids)
                            trace.steps += 1
                        trace.drafted += out.num_drafted
                        trace.accepted += out.num_accepted
                if trace.tokens != max_tokens:
                    raise RuntimeError(f"in-process engine: {trace.tokens} tokens instead of {max_tokens}")
                traces.append(trace)
        return Measurement(time.perf_counter() - start, traces)


# ---- the benchmark ---------------------------------------------------------------------------------------------


@dataclass
class Plan:
    runs: int
    max_tokens: int
    batch1_prompts: int
    keys: tuple[str, ...] = tuple(CONFIG_BY_KEY)  # the selected rows (select_configs)


class Progress:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f}s] {message}", flush=True)


def run_benchmark(
    stacks: dict[str, Stack], inproc: InProcess | None, prompt_ids: dict, plan: Plan, log: Callable
) -> dict:
    """`inproc` (the split-overhead comparison at 1 client) is None when the draft-model row is not selected."""
    configs = [CONFIG_BY_KEY[k] for k in plan.keys]

    def prompts_for(prompt_set: str, clients: int) -> list[list[int]]:
        ids = prompt_ids[prompt_set]
        return ids[: plan.batch1_prompts] if clients == 1 else ids[:clients]

    def gw(cfg: GwConfig, clients: int, max_tokens: int) -> Measurement:
        stack = stacks[cfg.stack]
        prompts = prompts_for(cfg.prompt_set, clients)
        if cfg.front == "http":
            url = f"http://{HOST}:{stack.http_port}"
            return asyncio.run(run_http(url, prompts, clients, max_tokens, cfg.temperature))
        return asyncio.run(
            run_gateway(stack.gateway.address, prompts, clients, max_tokens, cfg.temperature, logprobs=cfg.logprobs)
        )

    def gw_prompts(address: str, prompts: list[list[int]], max_tokens: int) -> Measurement:
        return asyncio.run(run_gateway(address, prompts, 1, max_tokens))

    log("warm-up (8 tokens per configuration)")
    for cfg in configs:
        gw(cfg, 1, 8)
    if inproc is not None:
        inproc.run(prompts_for("general", 1)[:1], 8)
        asyncio.run(run_verifier(stacks["draft"].verifier.address, prompts_for("general", 1)[:1], 8))

    trio_runners: dict[str, Callable[[list[list[int]]], Measurement]] = {}
    if inproc is not None:
        direct = stacks["draft"].verifier.address
        trio_runners = {
            "inproc": lambda ps: inproc.run(ps, plan.max_tokens),
            "direct": lambda ps: asyncio.run(run_verifier(direct, ps, plan.max_tokens)),
            "d4": lambda ps: gw_prompts(stacks["draft"].gateway.address, ps, plan.max_tokens),
        }

    def trio(run: int) -> dict[str, Measurement]:
        """The split-overhead comparison at 1 client: in-process engine, client on the verifier, client on the
        gateway, interleaved request by request (the order rotating) so that load changes on the shared
        machine hit the three alike."""
        parts: dict[str, list[Measurement]] = {key: [] for key in trio_runners}
        keys = list(trio_runners)
        for j, prompt in enumerate(prompts_for("general", 1)):
            shift = (run + j) % len(keys)
            for key in keys[shift:] + keys[:shift]:
                parts[key].append(trio_runners[key]([prompt]))
        return {
            key: Measurement(sum(m.wall_s for m in ms), [t for m in ms for t in m.traces]) for key, ms in parts.items()
        }

    results: dict[tuple[str, int], list[Measurement]] = {}

    def record(key: str, clients: int, m: Measurement, run: int) -> None:
        results.setdefault((key, clients), []).append(m)
        s = m.summary()
        log(
            f"run {run + 1}/{plan.runs} clients {clients}: {label_of(key)}: {s['tokens']} tokens in "
            f"{s['wall_s']:.1f} s = {s['tokens_per_s']:.1f} tok/s, TTFT {s['ttft_p50_ms']:.0f} ms, "
            f"TPOT {_fmt(s['tpot_ms'], '.1f')} ms"
        )

    for run in range(plan.runs):
        for clients in CLIENTS:
            jobs: list[tuple[str, Callable[[], Any]]] = [
                (cfg.key, functools.partial(gw, cfg, clients, plan.max_tokens))
                for cfg in configs
                if not (clients == 1 and cfg.key == "d4" and trio_runners)  # at 1 client d4 runs inside the trio
            ]
            if clients == 1 and trio_runners:
                jobs.append(("trio", functools.partial(trio, run)))
            shift = run % len(jobs)
            for key, job in jobs[shift:] + jobs[:shift]:  # rotate the order from run to run
                out = job()
                for k, m in out.items() if isinstance(out, dict) else [(key, out)]:
                    record(k, clients, m, run)
    return summarise(results, plan)


def label_of(key: str) -> str:
    if key in ("inproc", "direct"):
        return INPROC_LABEL if key == "inproc" else DIRECT_LABEL
    return "gateway: " + CONFIG_BY_KEY[key].label


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarise(results: dict[tuple[str, int], list[Measurement]], plan: Plan) -> dict:
    rows: list[dict[str, Any]] = []
    for (key, clients), ms in results.items():
        sums = [m.summary() for m in ms]
        row = {"key": key, "label": label_of(key), "clients": clients, "runs": len(ms)}
        row["prompt_set"] = CONFIG_BY_KEY[key].prompt_set if key in CONFIG_BY_KEY else "general"
        row["temperature"] = CONFIG_BY_KEY[key].temperature if key in CONFIG_BY_KEY else 0.0
        names = ("tokens_per_s", "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms", "tpot_ms", "tokens_per_step")
        for name in names:
            row[name] = _median([s[name] for s in sums])
        drafted = sum(s["drafted"] for s in sums)
        row["acceptance"] = sum(s["accepted"] for s in sums) / drafted if drafted else None
        decode_steps = sum(max(t.steps - 1, 0) for m in ms for t in m.traces)
        accepted = sum(s["accepted"] for s in sums)
        row["mean_accepted_length"] = 1 + accepted / decode_steps if drafted and decode_steps else None
        row["tokens_per_s_runs"] = [s["tokens_per_s"] for s in sums]
        base = CONFIG_BY_KEY[key].baseline if key in CONFIG_BY_KEY else "t"
        if key in CONFIG_BY_KEY and key != base and (base, clients) in results:
            bs = results[(base, clients)]
            row["vs_target"] = statistics.median(m.tokens_per_s / b.tokens_per_s for m, b in zip(ms, bs, strict=True))
        rows.append(row)
    order = {k: i for i, k in enumerate(["inproc", "direct", *CONFIG_BY_KEY])}
    rows.sort(key=lambda r: (r["clients"], order[str(r["key"])]))

    overhead = None
    if ("inproc", 1) in results and ("d4", 1) in results:
        direct = results.get(("direct", 1), [None] * len(results[("inproc", 1)]))
        per_run = []
        for local, mid, remote in zip(results[("inproc", 1)], direct, results[("d4", 1)], strict=True):
            a, b = local.summary(), remote.summary()
            run = {
                "tpot_inproc_ms": a["tpot_ms"],
                "tpot_gateway_ms": b["tpot_ms"],
                "tpot_overhead": b["tpot_ms"] / a["tpot_ms"] - 1,
                "per_token_inproc_ms": 1e3 * a["wall_s"] / a["tokens"],
                "per_token_gateway_ms": 1e3 * b["wall_s"] / b["tokens"],
                "wall_overhead": (b["wall_s"] / b["tokens"]) / (a["wall_s"] / a["tokens"]) - 1,
                "ttft_inproc_ms": a["ttft_p50_ms"],
                "ttft_gateway_ms": b["ttft_p50_ms"],
            }
            if mid is not None:
                m = mid.summary()
                run |= {
                    "tpot_direct_ms": m["tpot_ms"],
                    "per_token_direct_ms": 1e3 * m["wall_s"] / m["tokens"],
                    "ttft_direct_ms": m["ttft_p50_ms"],
                    "tpot_split_overhead": m["tpot_ms"] / a["tpot_ms"] - 1,
                    "tpot_gateway_hop_overhead": b["tpot_ms"] / m["tpot_ms"] - 1,
                }
            per_run.append(run)
        overhead = {k: statistics.median(r[k] for r in per_run) for k in per_run[0]}
        overhead["runs"] = per_run
    return {
        "rows": rows,
        "overhead": overhead,
        "checks": output_checks(results),
        "policy": policy_against_fixed(results),
    }


def render_policy(cells: list[dict[str, Any]]) -> list[str]:
    if not cells:
        return []
    out = [
        "",
        f"### The policy against the fixed configurations it chooses among (target: at least {POLICY_TARGET:g}x "
        "the best of them)",
        "",
        "The best fixed row is the one with the most tokens/s over the runs (the median); the policy is set against "
        "it run by run. Against the faster fixed row of each run instead (the last column) the fixed rows are "
        "favoured: the faster of two equally fast rows, each timed minutes apart on a noisy host, is faster than "
        "either.",
        "",
        "| policy | clients | fixed rows | the best | × the best (median of runs) | per run "
        "| × the faster of each run | result |",
        "| --- | ---: | --- | --- | ---: | --- | ---: | --- |",
    ]
    for c in cells:
        out.append(
            f"| {label_of(c['policy'])} | {c['clients']} | {', '.join(f'`{k}`' for k in c['fixed'])} "
            f"| `{c['best']}` | {c['ratio']:.2f} | {' '.join(f'{r:.2f}' for r in c['per_run'])} "
            f"| {c['against_faster']:.2f} | {'PASS' if c['ratio'] >= POLICY_TARGET else 'FAIL'} |"
        )
    return out


def policy_against_fixed(results: dict[tuple[str, int], list[Measurement]]) -> list[dict[str, Any]]:
    """Per cell where the policy's row and a fixed one ran: the fixed row with the most tokens/s over the runs
    (the median), the policy's tokens/s over its in each run (the rows of one run are timed minutes apart, so each
    run is its own pair), and the median; and, for comparison, the median over the runs of the policy against the
    faster fixed row of each run."""
    cells = []
    for clients in CLIENTS:
        for suffix in ("", *(f"-{s}" for s in HALF_DTYPES.values())):
            for policy, fixed in POLICY_AGAINST_FIXED:
                ms = results.get((policy + suffix, clients))
                ran = [key + suffix for key in fixed if (key + suffix, clients) in results]
                if not ms or not ran:
                    continue
                rows = {key: [m.tokens_per_s for m in results[(key, clients)]] for key in ran}
                best = max(ran, key=lambda key: statistics.median(rows[key]))
                per_run = [m.tokens_per_s / rows[best][i] for i, m in enumerate(ms)]
                faster = [m.tokens_per_s / max(row[i] for row in rows.values()) for i, m in enumerate(ms)]
                cells.append(
                    {
                        "policy": policy + suffix,
                        "clients": clients,
                        "fixed": ran,
                        "best": best,
                        "per_run": per_run,
                        "ratio": statistics.median(per_run),
                        "against_faster": statistics.median(faster),
                    }
                )
    return cells


def output_checks(results: dict[tuple[str, int], list[Measurement]]) -> list[str]:
    """Greedy and lossless: every configuration must emit the same tokens for the same prompt."""
    lines = []
    pairs = [
        (("d4", 1), ("inproc", 1)),
        (("d4", 1), ("t", 1)),
        (("d4h", 1), ("d4", 1)),
        (("d4l", 1), ("d4", 1)),
        (("d4h", 8), ("d4", 8)),
        (("d4l", 8), ("d4", 8)),
        (("n4", 1), ("tq", 1)),
        (("d4", 8), ("t", 8)),
        (("n4", 8), ("tq", 8)),
        (("g4", 1), ("t", 1)),
        (("g4", 8), ("t", 8)),
        (("ga", 1), ("t", 1)),
        (("ga", 8), ("t", 8)),
        *(((key, n), ("t", n)) for key in ("g4d", "gad", "gt", "g4t") for n in CLIENTS),
        (("t", 8), ("t", 1)),
    ]
    # a half-precision target's greedy rows against its own target-only row (a near-tie may flip against fp32);
    # sampled rows carry no seed, so their tokens are not expected to match
    pairs += [
        ((c.key, n), (c.baseline, n))
        for c in CONFIGS
        if c.dtype != "float32" and c.key != c.baseline and not c.temperature
        for n in CLIENTS
    ]
    for x, y in pairs:
        if x not in results or y not in results:
            continue
        same = total = 0
        for mx in results[x]:
            for my in results[y]:
                for tx, ty in zip(mx.traces, my.traces, strict=False):
                    same += tx.ids == ty.ids
                    total += 1
        lines.append(f"{label_of(x[0])} ({x[1]} client(s)) == {label_of(y[0])} ({y[1]} client(s)): {same}/{total}")
    return lines


# ---- the report ----------------------------------------------------------------------------------------------


def _fmt(value, spec: str, default: str = "—") -> str:
    return default if value is None else format(value, spec)


def markers(meta: dict) -> tuple[str, str]:
    """A run's section of the report: half-precision targets and the split placement have their own."""
    if meta.get("placement") == "split":
        return MARK_START_SPLIT, MARK_END_SPLIT
    if any(d in HALF_DTYPES for d in meta["dtypes"]):
        return MARK_START_HALF, MARK_END_HALF
    return MARK_START, MARK_END


def render(summary: dict, meta: dict) -> str:
    m = meta["machine"]
    half = any(d in HALF_DTYPES for d in meta["dtypes"])
    split = meta.get("placement") == "split"
    title = "## Gateway benchmark (`specdec_bench.gateway_bench`)"
    if half:
        title = f"## Gateway benchmark with half-precision targets (`--dtype {','.join(meta['dtypes'])}`)"
    if split:
        title = "## Gateway benchmark, each service on its own core (`--placement split`)"
    where = (
        f"the verifier alone on core {VERIFIER_CORE}, the proposer, the gateway and this client on core "
        f"{PROPOSER_CORE} (`taskset`, OMP_NUM_THREADS=1 each): the deployment the product is built for"
        if split
        else "every process on the same cores"
    )
    start, end = markers(meta)
    out = [start, title, ""]
    out += [
        f"- Date: {meta['date']}; wall time of the whole benchmark: {meta['runtime_s'] / 60:.1f} min"
        + (" (**--quick smoke run: 1 run, short outputs; not a measurement**)" if meta["quick"] else ""),
        f"- Command: `{meta['command']}`",
        f"- Machine: {m['cpu']}, {m['cores']} cores available, torch {m['torch']}, Python {m['python']}; "
        f"{where}; load average at start / end: {meta['load_start']} / {meta['load_end']} "
        "(the machine is shared with other jobs)",
        f"- Models: target `{meta['target']}`, draft `{meta['draft']}` (--dtype {', '.join(meta['dtypes'])}; "
        f"the EAGLE head in {meta.get('head_dtype', 'float32')}, `--head-dtype {meta.get('head_dtype_arg', 'auto')}`); "
        f"EAGLE head: {meta['eagle']}",
        "- Processes per stack, on loopback: gateway + verifier (+ proposer), started as by `scripts/run_all.sh`; "
        f"verifier `--max-model-len {MAX_MODEL_LEN} --max-num-seqs {MAX_NUM_SEQS}`, with a proposer "
        f"`--num-speculative-tokens {K} --no-adaptive-k` (every step drafts k tokens), except the adaptive rows "
        f"(`--num-speculative-tokens {K_ADAPTIVE} --adaptive-k`, the engine default policy, as `make run`); "
        f"drafting-ahead rows: proposer `--draft-ahead {AHEAD}`; tree rows: verifier `--max-tree-nodes {TREE_NODES}`; "
        "the EAGLE proposer is `--kind eagle --model HEAD --target-model TARGET`",
        f"- Work: greedy (T = {SAMPLED_T:g} unseeded, i.e. rejection sampling, where the row says so), "
        f"{meta['max_tokens']} new "
        f"tokens per request (EOS ignored); 1 client: {meta['batch1_prompts']} prompt(s) one after another; "
        f"8 clients: 8 prompts at once; {meta['runs']} run(s), median reported; prompts: the engine benchmark's "
        "(`specdec_bench.prompts`)" + (f"; rows run: {', '.join(meta['keys'])} (`--only`)" if meta.get("only") else ""),
        "",
        "| configuration | clients | T | prompts | tokens/s | × target only | TTFT p50 ms | ITL p50 ms | ITL p99 ms "
        "| TPOT ms | acceptance | mean acc. len | tokens/step |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in summary["rows"]:
        out.append(
            f"| {r['label']} | {r['clients']} | {r['temperature']:g} | {r['prompt_set']} | {r['tokens_per_s']:.1f} "
            f"| {_fmt(r.get('vs_target'), '.2f')} | {_fmt(r['ttft_p50_ms'], '.0f')} | {_fmt(r['itl_p50_ms'], '.0f')} "
            f"| {_fmt(r['itl_p99_ms'], '.0f')} | {_fmt(r['tpot_ms'], '.1f')} | {_fmt(r['acceptance'], '.3f')} "
            f"| {_fmt(r.get('mean_accepted_length'), '.2f')} | {_fmt(r['tokens_per_step'], '.2f')} |"
        )
    o = summary["overhead"]
    if o is not None:
        ok = o["tpot_overhead"] <= OVERHEAD_TARGET
        has_direct = "tpot_direct_ms" in o
        per_run = [r["tpot_overhead"] for r in o["runs"]]
        spread = 100 * (max(per_run) - min(per_run))

        def row(name: str, key: str, spec: str, total: str, target: str = "", result: str = "") -> str:
            direct = f"{o[key + '_direct_ms']:{spec}} | " if has_direct else ""
            return (
                f"| {name} | {o[key + '_inproc_ms']:{spec}} | {direct}{o[key + '_gateway_ms']:{spec}} | {total} "
                f"| {target} | {result} |"
            )

        out += [
            "",
            "### Network split overhead (1 client, draft model, k=4): separate processes vs the in-process engine",
            "",
            "| per-token latency, ms | in-process engine | "
            + ("verifier + proposer processes, client on the verifier | " if has_direct else "")
            + "client -> gateway -> verifier <-> proposer | overhead (gateway vs in-process) | target | result |",
            "| --- | ---: | " + ("---: | " if has_direct else "") + "---: | ---: | --- | --- |",
            row(
                "TPOT (per token after the first)",
                "tpot",
                ".1f",
                f"{o['tpot_overhead']:+.1%}",
                f"<= +{OVERHEAD_TARGET:.0%}",
                "PASS" if ok else "FAIL",
            ),
            row("wall time / tokens (TTFT included)", "per_token", ".1f", f"{o['wall_overhead']:+.1%}"),
            row("TTFT", "ttft", ".0f", f"{o['ttft_gateway_ms'] / o['ttft_inproc_ms'] - 1:+.0%}"),
            "",
            "TPOT overhead per run: "
            + ", ".join(f"{r['tpot_overhead']:+.1%}" for r in o["runs"])
            + (
                f" (spread {spread:.1f} points: differences smaller than that are not resolved on this machine)."
                if len(per_run) > 1
                else " (one run: no spread to judge the noise by)."
            ),
        ]
        if has_direct:
            out += [
                "",
                f"Where it comes from (medians of the per-run ratios, so they need not multiply to the total): "
                f"verifier and proposer in separate processes {o['tpot_split_overhead']:+.1%} (in-process engine "
                f"-> client on the verifier), the gateway hop {o['tpot_gateway_hop_overhead']:+.1%} (client on the "
                "verifier -> client on the gateway). The three are measured interleaved, request by request.",
            ]
    if summary.get("figures"):
        out += [
            "",
            "### Where the time goes (each speculating stack's own Prometheus figures, over all its runs and "
            "warm-up, as `make run` prints them)",
            "",
        ]
        for name, lines in summary["figures"].items():
            if lines:
                out += [f"- `{name}`: " + "; ".join(lines)]
    out += render_policy(summary.get("policy", []))
    out += ["", "### Output checks (greedy: every configuration must emit the same tokens)", ""]
    out += [f"- {line}" for line in summary["checks"]]
    out += ["", "### How to read this", "", HOW_TO_READ, end, ""]
    return "\n".join(out)


HOW_TO_READ = """\
tokens/s is all generated tokens divided by the wall time from the first request sent to the last token
received (1 client: its prompts one after another; 8 clients: 8 requests at once, batched by the
verifier). TTFT is from sending the request to the first message with tokens (prefill, plus queueing
behind other clients); ITL is the gap between consecutive streamed messages that carry tokens, so with
speculative decoding one gap may deliver several tokens (tokens/step, prefill step included, says how many
on average; mean acc. len is 1 + accepted drafts / decode steps, which with k fixed is tokens per draft
round); TPOT is a request's time after its first message divided by the tokens after the first, averaged
over requests: the per-token latency a user sees. × target only is the ratio to the target-only stack on
the same prompts at the same temperature within the same run (median over runs). The in-process row runs
the same engine code and EngineConfig in this process with the draft model in-process too: the overhead
table is the cost of the split into processes (two gRPC hops per step: verifier <-> proposer propose round
trip, verifier -> gateway stream, plus the gateway's detokenization), measured side by side. All processes
share the same 2 cores, so the verifier, proposer and gateway also compete with each other and with the
client; absolute numbers move with the load of the shared machine, the within-run ratios are the numbers
to trust. The default draft was distilled on CPU and agrees with the target only ~10-30 % of the time, so
the draft-model rows show a low-acceptance case. The EAGLE rows run the head in its own proposer process,
which receives the target's hidden states (fp16) with every draft request; greedy, they must emit the
target-only tokens like every other row."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke check: 1 run, 1 prompt at 1 client, 16 tokens")
    parser.add_argument("--runs", type=int, default=None, help="repetitions, median reported (default 3; quick 1)")
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (default 64; quick 16)")
    parser.add_argument("--batch1-prompts", type=int, default=None, help="prompts per 1-client run (default 2)")
    parser.add_argument("--out", default="docs/BENCHMARKS.md", help="Markdown file to update ('' to skip)")
    parser.add_argument("--json", default="", help="also write the raw summary as JSON here")
    parser.add_argument("--logs", default="", help="folder for the service logs (default: a temporary one)")
    parser.add_argument(
        "--eagle-head",
        default=None,
        help="EAGLE head folder (default: $SPECDEC_EAGLE_HEAD or models/smollm2-135m-eagle); the EAGLE rows are "
        "left out when it does not exist",
    )
    parser.add_argument(
        "--only",
        default="",
        help=f"comma-separated rows to run, e.g. t,d4,g4 (rows: {','.join(CONFIG_BY_KEY)}); the target-only "
        "baseline of every selected row is added; the split-overhead comparison runs with d4",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        help="comma-separated target dtypes (float32, bfloat16, float16): a half dtype runs the rows "
        f"{','.join(HALF_TWINS)} among the selected ones again at that dtype, in the same run",
    )
    parser.add_argument(
        "--head-dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="the EAGLE proposers' --dtype (auto: bf16 on a CPU with bf16 instructions, else fp32)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="every verifier (target-only and speculating stacks alike) with --compile: the target's forward as one "
        "compiled graph; every EAGLE head and draft model too (the proposer's --compile)",
    )
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="co-located",
        help="co-located: every process on all cores (default); split: the verifier alone on core 0 with one "
        "thread, the proposer, the gateway and the client on core 1 (writes its own report section)",
    )
    args = parser.parse_args(argv)
    from shared.settings import default_eagle_head

    eagle_dir = str(Path(args.eagle_head or default_eagle_head()).resolve())  # the services run in the repo root
    has_eagle = Path(eagle_dir, "config.json").is_file()
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    keys, notes = select_configs(args.only, has_eagle, eagle_dir, dtypes)
    if not has_eagle:
        print(
            f"EAGLE rows (g4, g4s) left out: no head at {eagle_dir} (config.json missing). Train one with "
            "`make train-draft`, or point --eagle-head / SPECDEC_EAGLE_HEAD at a head folder.",
            file=sys.stderr,
        )
    for note in notes:
        print(f"--only: {note}", file=sys.stderr)
    plan = Plan(
        runs=args.runs or (1 if args.quick else 3),
        max_tokens=args.max_tokens or (16 if args.quick else 64),
        batch1_prompts=args.batch1_prompts or (1 if args.quick else 2),
        keys=keys,
    )
    stack_names = list(dict.fromkeys(CONFIG_BY_KEY[k].stack for k in keys))
    use_eagle = any(n.startswith("eagle") for n in stack_names)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    malloc_tuned = tune_malloc()  # as in the services it starts
    import torch

    torch.set_num_threads(NUM_THREADS)
    if args.placement == "split":  # the client shares the proposer's core, as a client beside a small device
        os.sched_setaffinity(0, {PROPOSER_CORE})
        torch.set_num_threads(1)
    log = Progress()
    load_start = load_average()
    target_name, draft_name = default_target_model(), default_draft_model()
    log_dir = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="specdec-gateway-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    stacks = build_stacks(
        log_dir,
        target_name,
        draft_name,
        eagle_dir if use_eagle else None,
        stack_names,
        args.placement,
        args.compile,
        args.head_dtype,
    )
    log(
        f"starting {sum(len(s.procs) for s in stacks.values())} service processes, a stack at a time; logs in {log_dir}"
    )
    procs = [p for s in stacks.values() for p in s.procs]
    failed = False
    try:
        # One stack at a time, each ready before the next starts: a verifier's warm-up times its target (the
        # speculation policy's first costs), and many warm-ups at once on two cores would time the contention.
        deadline = time.monotonic() + STARTUP_TIMEOUT_S * len(stacks)
        for s in stacks.values():
            for p in s.procs:
                p.start()
            s.wait_ready(deadline)
        from shared.model.loader import load_tokenizer

        tok = load_tokenizer(target_name)
        prompt_ids = {
            "general": [chat_ids(tok, p) for p in GENERAL_PROMPTS],
            "quoting": [chat_ids(tok, p) for p in QUOTING_PROMPTS],
        }
        inproc = None
        if "d4" in keys and args.placement == "co-located":
            log("loading the in-process engine (target + draft)")
            inproc = InProcess(target_name, draft_name)
        log(f"all services ready; plan {asdict(plan)}")
        summary = run_benchmark(stacks, inproc, prompt_ids, plan, log)
        summary["figures"] = {name: s.figures() for name, s in stacks.items() if "proposer" in s.metrics_ports}
    except BaseException:
        failed = True
        raise
    finally:
        codes = {p.name: p.stop() for p in reversed(procs)}
        bad = {n: c for n, c in codes.items() if c != 0}
        if bad:
            print(f"services that did not exit with 0 after SIGTERM: {bad}; logs in {log_dir}", file=sys.stderr)
            for p in procs:
                if p.name in bad:
                    print(f"----- {p.name} -----\n{p.tail()}", file=sys.stderr)
        if failed:
            for p in procs:
                print(f"----- {p.name} (last lines) -----\n{p.tail(15)}", file=sys.stderr)
    runtime = time.perf_counter() - log.start
    meta = {
        **run_meta("gateway_bench", argv, runtime, malloc_tuned, load_start),
        "quick": args.quick,
        "target": target_name,
        "draft": draft_name,
        "eagle": f"`{eagle_dir}`"
        if use_eagle
        else f"none (no head at `{eagle_dir}`: EAGLE rows left out)"
        if not has_eagle
        else "not selected",
        "only": args.only,
        "dtypes": dtypes,
        "head_dtype": str(resolve_head_dtype(args.head_dtype, "cpu", target_name)).removeprefix("torch."),
        "head_dtype_arg": args.head_dtype,
        "placement": args.placement,
        **asdict(plan),
    }
    section = render(summary, meta)
    print(section)
    if args.out:
        write_report(Path(args.out), section, *markers(meta))
        log(f"wrote {args.out}")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, **summary}, indent=1, default=str))
    log(f"done in {runtime / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
