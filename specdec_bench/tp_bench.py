"""Tensor-parallel benchmark: verifier step time and draft proposal time per token at TP 1 and TP 2.

    python -m specdec_bench.tp_bench [--quick] [--runs N] [--device cpu|cuda] [--out docs/BENCHMARKS.md]

The default models cannot be split 2 ways (SmolLM2-135M and its 4-layer draft have 9 attention heads), so
the models here are random-weight Llamas with the real target's shape but 8 heads / 2 KV heads
(head_dim 72, so hidden stays 576): "target" has 30 layers, "draft" 4. Random weights change nothing about
speed. Both are saved to a temporary folder and loaded the way the services load them (TP 2: rank 1 is a
`shared.model.tp_worker` process, gloo on CPU / NCCL on CUDA).

Measured, each the median of `--runs` timed repetitions after 2 warm-up ones:
    step      one verifier scoring forward: per sequence [last token + k = 4 drafts] over a 128-token context
              in the paged cache (what Engine.step's single runner.forward does), batch 1 and 8
    proposal  DraftModelDrafter.propose with k = 4 for every sequence (each sequence committed one more
              token since the last round), divided by 4: time per draft token, batch 1 and 8
On CPU TP 1 gets all the cores as torch threads and TP 2 one process per rank with cores / 2 threads each,
so both use the same cores; TP 1 with one thread is also shown. The settings are loaded together and take
turns, so a change in the machine's load hits them alike.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from proposer_service.draft_model import DraftModelDrafter
from shared.drafting import DraftRequest
from shared.kv.block_manager import BlockManager
from shared.model.runner import ForwardItem, ModelRunner
from shared.model.tp_group import RankSpec, default_threads_per_rank, launch_tp_runner
from shared.sampling import SamplingParams
from specdec_bench.report import load_average, write_report

MARK_START = "<!-- tp-bench:start -->"
MARK_END = "<!-- tp-bench:end -->"
BLOCK = 16
CONTEXT = 128
K = 4
BATCHES = (1, 8)
SHAPES = {"target": 30, "draft": 4}  # layers; everything else as SmolLM2-135M, but 8 heads / 2 KV heads


def save_synthetic(folder: Path, layers: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=72,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
    )
    torch.manual_seed(layers)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def num_blocks_needed() -> int:
    return max(BATCHES) * (-(-(CONTEXT + 2 * K + 64) // BLOCK)) + 8


@dataclass(frozen=True)
class Setting:
    label: str
    tp: int
    threads: int  # torch threads per rank (0: torch's default, on GPU)


def settings(tps: list[int], device: str) -> list[Setting]:
    out = []
    for tp in tps:
        threads = default_threads_per_rank(device, tp)
        out.append(Setting(f"TP {tp}", tp, threads))
        if device == "cpu" and tp == 1 and threads > 1:
            # The reference that isolates process/collective overhead from "fewer threads per process".
            out.append(Setting("TP 1, 1 thread", 1, 1))
    return out


def make_runner(path: str, setting: Setting, device: str) -> ModelRunner:
    if setting.tp == 1:
        from shared.model.build import CacheConfig
        from shared.model.build import make_runner as make_local
        from shared.model.loader import load_model

        model, arch = load_model(path, torch.float32, device)
        return make_local(model, arch, num_blocks_needed(), CacheConfig(block_size=BLOCK))
    spec = RankSpec(path, num_blocks_needed(), BLOCK, device=device, num_threads=setting.threads)
    return launch_tp_runner(spec, setting.tp)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def side_by_side(calls: dict[str, Callable[[], object]], threads: dict[str, int], runs: int, device: str):
    """Median seconds per setting; the settings take turns (rotating order) so that a change in the
    machine's load hits them alike. 2 warm-up rounds are not timed."""
    times: dict[str, list[float]] = {label: [] for label in calls}
    labels = list(calls)
    for i in range(runs + 2):
        order = labels[i % len(labels) :] + labels[: i % len(labels)]
        for label in order:
            if threads[label]:
                torch.set_num_threads(threads[label])
            sync(device)
            start = time.perf_counter()
            calls[label]()
            sync(device)
            if i >= 2:
                times[label].append(time.perf_counter() - start)
    return {label: statistics.median(t) for label, t in times.items()}


def step_call(runner: ModelRunner, batch: int) -> Callable[[], object]:
    """A scoring step over `batch` sequences with a CONTEXT-token prefix (prefilled here, untimed)."""
    per_seq = -(-(CONTEXT + K + 1) // BLOCK)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    gen = torch.Generator().manual_seed(batch)
    vocab = runner.vocab_size
    runner.forward([ForwardItem(t, 0, torch.randint(0, vocab, (CONTEXT,), generator=gen).tolist(), 1) for t in tables])
    items = [ForwardItem(t, CONTEXT, torch.randint(0, vocab, (K + 1,), generator=gen).tolist(), K + 1) for t in tables]
    return lambda: runner.forward(items)


def proposal_call(runner: ModelRunner, batch: int) -> Callable[[], object]:
    """A propose round of k = 4 for `batch` sequences, each having committed one more token since the last
    round (the first round, the prefill, runs here untimed)."""
    drafter = DraftModelDrafter(runner, BlockManager(runner.cache.num_blocks, BLOCK))
    gen = torch.Generator().manual_seed(100 + batch)
    vocab = runner.vocab_size
    histories = {f"b{batch}s{b}": torch.randint(0, vocab, (CONTEXT,), generator=gen).tolist() for b in range(batch)}
    sent = dict.fromkeys(histories, 0)

    def round_() -> None:
        requests = []
        for seq_id, tokens in histories.items():
            requests.append(DraftRequest(seq_id, len(tokens), tokens[sent[seq_id] :], K, SamplingParams()))
            sent[seq_id] = len(tokens)
        for draft in drafter.propose(requests):
            histories[draft.seq_id].append(draft.token_ids[0])  # the verifier accepted one token

    round_()
    return round_


@dataclass
class Row:
    model: str
    what: str
    batch: int
    seconds: dict[str, float]


WHAT = {"target": "step: score 1 + k = 4 tokens per sequence", "draft": "proposal: time per draft token (k = 4)"}


def run(args: argparse.Namespace, log: Callable[[str], None]) -> tuple[list[Row], list[Setting], dict[str, str]]:
    rows: list[Row] = []
    threads_before = torch.get_num_threads()
    plan = settings(args.tp, args.device)
    threads = {s.label: s.threads for s in plan}
    with tempfile.TemporaryDirectory(prefix="tp-bench-") as tmp:
        for name, layers in SHAPES.items():
            log(f"saving the synthetic {name} ({layers} layers)")
            path = save_synthetic(Path(tmp) / name, layers)
            runners: dict[str, ModelRunner] = {}
            try:
                for setting in plan:
                    log(f"loading the {name} at {setting.label}")
                    if setting.threads:
                        torch.set_num_threads(setting.threads)
                    runners[setting.label] = make_runner(path, setting, args.device)
                with torch.inference_mode():
                    for batch in BATCHES:
                        make = step_call if name == "target" else proposal_call
                        calls = {label: make(runner, batch) for label, runner in runners.items()}
                        seconds = side_by_side(calls, threads, args.runs, args.device)
                        if name == "draft":
                            seconds = {label: t / K for label, t in seconds.items()}
                        rows.append(Row(name, WHAT[name], batch, seconds))
                        log(
                            f"  {WHAT[name]} batch {batch}: "
                            + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in seconds.items())
                        )
            finally:
                for runner in runners.values():
                    close = getattr(runner, "close", None)
                    if close is not None:
                        close()
                torch.set_num_threads(threads_before)
    meta = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} logical CPUs, {platform.platform()}",
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "omp": os.environ.get("OMP_WAIT_POLICY", "unset"),
    }
    return rows, plan, meta


def render(
    rows: list[Row], plan: list[Setting], meta: dict[str, str], args: argparse.Namespace, load: tuple[str, str]
) -> str:
    labels = [p.label for p in plan]
    base = labels[0]
    others = labels[1:]
    head = "| model | measurement | batch | " + " | ".join(f"{label} (ms)" for label in labels)
    head += "".join(f" | {label} / {base}" for label in others) + " |"
    lines = [head, "|" + "---|" * (3 + len(labels) + len(others))]
    for r in rows:
        cells = [f"{r.seconds[label] * 1000:.1f}" for label in labels]
        ratios = [f"{r.seconds[label] / r.seconds[base]:.2f}x" for label in others]
        lines.append(f"| {r.model} | {r.what} | {r.batch} | " + " | ".join(cells + ratios) + " |")
    threads = "; ".join(f"{p.label}: {p.threads or 'default'} thread(s) per rank" for p in plan)
    tp_labels = [p.label for p in plan if p.tp > 1]
    verdicts = []
    for label in tp_labels:
        spread = [r.seconds[label] / r.seconds[base] for r in rows]
        verdicts.append(f"{label} took {min(spread):.2f}x to {max(spread):.2f}x the time of {base} on this run")
    return "\n".join(
        [
            MARK_START,
            "## Tensor parallelism (tp-bench)",
            "",
            f"`python -m specdec_bench.tp_bench{' --quick' if args.quick else ''}` on {meta['date']}: "
            f"{meta['machine']}; device {meta['device']}; torch {meta['torch']}; OMP_WAIT_POLICY={meta['omp']}; "
            f"{threads}. Load average (1/5/15 min) {load[0]} at the start, {load[1]} at the end: this machine's "
            f"2 cores are shared with other jobs. Medians of {args.runs} timed repetitions after 2 warm-up ones; "
            "the settings take turns, so load changes hit them alike.",
            "",
            "Models: random weights, shaped like the default target (30 layers) and draft (4 layers): hidden 576, "
            "MLP 1536, vocabulary 49152, but 8 attention heads / 2 KV heads (head_dim 72), because the real "
            "ones have 9 heads, which 2 ranks cannot split (TP 3 can). TP 2 is rank 0 in the benchmark process "
            "and rank 1 a `shared.model.tp_worker` process, gloo all-reduces over loopback. The step row is one "
            "verifier scoring forward (per sequence the last token + 4 drafts over a 128-token paged context); "
            "the proposal row is `DraftModelDrafter.propose` with k = 4, divided by 4.",
            "",
            *lines,
            "",
            "How to read it: on a CPU the settings share the same 2 cores, so tensor parallelism adds no compute. "
            "It adds two all-reduces per layer (60 per target step, 8 per draft step) plus one broadcast of the "
            "step's inputs, and each is a round trip between processes that must both get a core. What it can "
            "change is how well the cores are used: one process with 2 OpenMP threads synchronises at every op, "
            "two single-threaded processes only at the all-reduces, and on a busy machine either can win. "
            f"{'; '.join(verdicts)}. The 1-thread TP 1 column (one process on one core) separates the two "
            "effects: TP 1 at 2 threads against 1 thread is what a second OpenMP thread gives on this machine "
            "at this load; TP 2 against 1-thread TP 1 is what a second core gives through tensor parallelism. "
            "These numbers say nothing about GPUs, where TP splits the weights' memory traffic "
            "across devices and all-reduces over NVLink (NCCL), and pays for a target that does not fit on one "
            "GPU, while the draft stays at TP 1 in its own proposer. No GPU was available for this run: there "
            "are no GPU numbers.",
            MARK_END,
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke check: 3 timed runs")
    parser.add_argument("--runs", type=int, default=None, help="timed repetitions per cell (default 15; quick 3)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (TP N uses cuda:0..N-1)")
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes to compare, comma-separated")
    parser.add_argument("--out", default="docs/BENCHMARKS.md", help="Markdown file to update ('' to skip)")
    args = parser.parse_args(argv)
    args.runs = args.runs or (3 if args.quick else 15)
    args.tp = [int(t) for t in args.tp.split(",")]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {message}", file=sys.stderr, flush=True)

    load_start = load_average()
    rows, plan, meta = run(args, log)
    section = render(rows, plan, meta, args, (load_start, load_average()))
    print(section)
    if args.out:
        write_report(Path(args.out), section, MARK_START, MARK_END)
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
