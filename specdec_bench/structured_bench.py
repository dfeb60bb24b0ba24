"""Structured-output benchmark: JSON-schema extraction with speculation on, against the target alone with the
same schema.

    python -m specdec_bench.structured_bench [--runs N] [--only t,n4,d4] [--out docs/BENCHMARKS.md]

In one process, on the in-process engine (shared/grammar.py masks in the verifier; the drafters mask their own
proposals with the same compiler), greedy, prefix caching off: 8 chat prompts each asking to extract a person's
record from a sentence into a JSON schema (name, age, city, occupation), at batch 1 (one prompt at a time) and
batch 8 (all at once). Rows:

    t   target alone (k = 0) with the grammar
    n4  n-gram drafter, k = 4 (extraction copies values from the prompt; the format's forced tokens follow)
    n8  n-gram drafter, k = 8
    d4  the draft model, k = 4;  da: the draft model with the engine's adaptive k (<= 4)
    g4  the EAGLE head, k = 4 (when its folder exists)

Every row must give the same tokens as t (greedy exactness; the run stops otherwise). Reported per row, medians
over --runs (configurations rotate order from run to run; each ratio is taken within one run): tokens/s, the
ratio to t, mean accepted length (1 + accepted / draft rounds), and the grammar's cost: the masks' compute
time (in a worker thread, overlapped with the target's forward) and the time verification waited for them, as
shares of the step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from shared.grammar import StructuredOutput
from shared.malloc_tuning import tune_malloc
from shared.model.build import CacheConfig
from shared.sampling import SamplingParams
from shared.settings import default_draft_model, default_eagle_head, default_target_model
from specdec_bench.report import load_average, run_meta, write_report

MARK_START = "<!-- structured-bench:start -->"
MARK_END = "<!-- structured-bench:end -->"
MAX_TOKENS = 64
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 40},
        "occupation": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city", "occupation"],
    "additionalProperties": False,
}
RECORDS = [
    "Maria Lopez is a 34-year-old architect who lives in Madrid.",
    "At 52, Tom Becker still works as a carpenter in Hamburg.",
    "Aiko Tanaka, 28, is a nurse at a hospital in Osaka.",
    "The baker of the village, Pierre Dubois, turned 61 this year; he has always lived in Lyon.",
    "Priya Sharma (age 40) teaches mathematics in Mumbai.",
    "Lars Nilsson, a 45-year-old fisherman, was born and raised in Bergen.",
    "Our new intern, Sam Carter, is 21 and moved to Chicago last month to study law.",
    "Olga Petrova is a pilot; she is 37 and flies out of Moscow.",
]
ROWS = {  # name: (drafter, k, adaptive)
    "t": (None, 0, False),
    "n4": ("ngram", 4, False),
    "n8": ("ngram", 8, False),
    "d4": ("draft", 4, False),
    "da": ("draft", 4, True),
    "g4": ("eagle", 4, False),
}


def prompts(tokenizer) -> list[list[int]]:
    from specdec_bench.engine_bench import chat_ids

    ask = "Extract the person's name, age, city and occupation from this sentence, as JSON: "
    return [chat_ids(tokenizer, ask + record) for record in RECORDS]


def make_engine(row: str, target, draft, tokenizer, max_num_seqs: int):
    from proposer_service.eagle import make_eagle_drafter
    from proposer_service.ngram import NgramDrafter
    from shared.drafting import Drafter
    from specdec_local.builder import build_engine, enable_structured_output, make_draft_model_drafter
    from verifier_service.engine import EngineConfig

    kind, k, adaptive = ROWS[row]
    config = EngineConfig(num_speculative_tokens=k, max_num_seqs=max_num_seqs, max_model_len=1024, adaptive_k=adaptive)
    cache = CacheConfig(enable_prefix_caching=False)
    drafter: Drafter | None = None
    if kind == "ngram":
        drafter = NgramDrafter()
    elif kind == "draft":
        drafter = make_draft_model_drafter(*draft, config, cache)
    elif kind == "eagle":
        model = target[0]
        drafter = make_eagle_drafter(
            default_eagle_head(), model.embed_tokens.weight, model.lm_head_weight, num_blocks=max_num_seqs * 80
        )
    engine = build_engine(target, drafter, config, cache)
    enable_structured_output(engine, tokenizer)
    return engine


class MaskClock:
    """Adds up the engine's mask work and the verifier's wait for it (wraps two methods of its GrammarMasks)."""

    def __init__(self, engine) -> None:
        self.compute_s = self.wait_s = 0.0
        masks = engine._masks
        compute, finish = masks._compute, masks.finish

        def timed_compute(rows):
            masks, start, end = compute(rows)
            self.compute_s += end - start
            return masks, start, end

        def timed_finish(job):
            masks = finish(job)
            if job is not None and engine.last_masks is not None:
                self.wait_s += engine.last_masks.waited
            return masks

        masks._compute, masks.finish = timed_compute, timed_finish


def run_once(engine, clock: MaskClock, batch: list[list[int]], params: SamplingParams) -> dict:
    stats = engine.stats
    before = (stats.drafted_tokens, stats.accepted_tokens, stats.draft_rounds)
    clock.compute_s = clock.wait_s = 0.0
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    for group in [batch] if engine.config.max_num_seqs > 1 else [[p] for p in batch]:
        base = len(outputs)
        for i, prompt in enumerate(group):
            engine.add_request(str(base + i), prompt, params)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.output_ids
    elapsed = time.perf_counter() - start
    drafted, accepted, rounds = (
        stats.drafted_tokens - before[0],
        stats.accepted_tokens - before[1],
        stats.draft_rounds - before[2],
    )
    return {
        "outputs": [outputs[str(i)] for i in range(len(batch))],
        "seconds": elapsed,
        "tokens": sum(len(o) for o in outputs.values()),
        "mean_accepted_length": 1 + accepted / rounds if rounds else 1.0,
        "acceptance": accepted / drafted if drafted else 0.0,
        "mask_share": clock.compute_s / elapsed,
        "wait_share": clock.wait_s / elapsed,
    }


def bench(rows: list[str], runs: int, log) -> dict:
    from shared.model.loader import load_model, load_tokenizer

    target_name = default_target_model()
    tokenizer = load_tokenizer(target_name)
    target, draft = load_model(target_name), load_model(default_draft_model())
    batch = prompts(tokenizer)
    params = SamplingParams(
        max_tokens=MAX_TOKENS, structured_output=StructuredOutput("json_schema", json.dumps(SCHEMA))
    )
    results: dict = {}
    for batch_size in (1, 8):
        engines = {row: make_engine(row, target, draft, tokenizer, batch_size) for row in rows}
        clocks = {row: MaskClock(engine) for row, engine in engines.items()}
        for row, engine in engines.items():  # warm: the first run of a shape pays for allocation
            run_once(engine, clocks[row], batch[:2], params)
        per_run: dict[str, list[dict]] = {row: [] for row in rows}
        for r in range(runs):
            order = rows[r % len(rows) :] + rows[: r % len(rows)]
            for row in order:
                result = run_once(engines[row], clocks[row], batch, params)
                per_run[row].append(result)
                log(f"batch {batch_size} run {r} {row}: {result['tokens'] / result['seconds']:.1f} tok/s")
            reference = per_run["t"][r]["outputs"] if "t" in per_run else per_run[rows[0]][r]["outputs"]
            for row in rows:
                if per_run[row][r]["outputs"] != reference:
                    raise SystemExit(f"row {row} at batch {batch_size} differs from the target alone: a bug")
        results[batch_size] = {row: summarise(per_run[row], per_run.get("t")) for row in rows}
    return results


def summarise(runs: list[dict], baseline: list[dict] | None) -> dict:
    med = statistics.median
    out = {
        "tokens_per_s": med(r["tokens"] / r["seconds"] for r in runs),
        "mean_accepted_length": med(r["mean_accepted_length"] for r in runs),
        "acceptance": med(r["acceptance"] for r in runs),
        "mask_share": med(r["mask_share"] for r in runs),
        "wait_share": med(r["wait_share"] for r in runs),
        "tokens": runs[0]["tokens"],
    }
    if baseline is not None:
        out["speedup"] = med(b["seconds"] / r["seconds"] for r, b in zip(runs, baseline, strict=True))
    return out


def render(results: dict, meta: dict) -> str:
    m = meta["machine"]
    machine = f"{m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads), {m['malloc']}"
    lines = [
        MARK_START,
        "## Structured output: JSON schema with speculation on",
        "",
        f"{meta['date']}, `{meta['command']}` ({meta['runtime_s']:.0f} s), {machine}; load average "
        f"{meta['load_start']} at start, {meta['load_end']} at end. Target {meta['target']}, draft {meta['draft']}. "
        f"8 extraction prompts, schema name / age / city / occupation, greedy, max {MAX_TOKENS} tokens, "
        f"prefix caching off, median of {meta['runs']} runs; every row's tokens equal the target alone's.",
        "",
        "| batch | row | tokens/s | vs t | mean accepted length | acceptance | mask work / step time | "
        "verify waiting for masks / step time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    names = {
        "t": "t: target alone",
        "n4": "n4: n-gram k=4",
        "n8": "n8: n-gram k=8",
        "d4": "d4: draft model k=4",
        "da": "da: draft model adaptive k",
        "g4": "g4: EAGLE head k=4",
    }
    for batch_size, rows in results.items():
        for row, r in rows.items():
            lines.append(
                f"| {batch_size} | {names[row]} | {r['tokens_per_s']:.1f} | x{r.get('speedup', 1.0):.2f} | "
                f"{r['mean_accepted_length']:.2f} | {r['acceptance']:.0%} | {r['mask_share']:.1%} | "
                f"{r['wait_share']:.1%} |"
            )
    lines += ["", MARK_END, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="timed runs per row (median reported)")
    parser.add_argument("--only", default="", help="comma-separated rows (t is always added)")
    parser.add_argument("--out", default="docs/BENCHMARKS.md", help="Markdown file to update ('' to skip)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    malloc_tuned = tune_malloc()
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f}s] {message}", file=sys.stderr, flush=True)

    rows = [r for r in (args.only.split(",") if args.only else ROWS) if r]
    if "t" not in rows:
        rows.insert(0, "t")
    if "g4" in rows and not Path(default_eagle_head()).is_dir():
        log(f"no EAGLE head at {default_eagle_head()}: row g4 left out")
        rows.remove("g4")
    load_start = load_average()
    results = bench(rows, args.runs, log)
    meta = {
        **run_meta("structured_bench", argv, time.perf_counter() - started, malloc_tuned, load_start),
        "target": default_target_model(),
        "draft": default_draft_model(),
        "runs": args.runs,
    }
    section = render(results, meta)
    print(section)
    if args.out:
        write_report(Path(args.out), section, MARK_START, MARK_END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
