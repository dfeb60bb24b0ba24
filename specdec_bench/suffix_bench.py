"""Suffix decoding benchmark (issue 27): the `suffix` drafter against target-only, the n-gram drafter and
transformers' prompt lookup decoding, in-process.

    python -m specdec_bench.suffix_bench [--quick] [--runs N] [--sections quoting1,repeat] [--out docs/BENCHMARKS.md]

Greedy decoding, a forced number of new tokens (EOS ignored). Sections, each run `--runs` times with the rows
in a rotating order, medians of the per-run ratios reported (ratios are taken inside a run: the machine is
shared and its load moves):

    quoting1  the quoting prompts at batch 1, `--batch1-prompts` per run: HF generate, HF prompt lookup
              decoding (prompt_lookup_num_tokens=10), engine k=0, engine + n-gram (adaptive k<=8, the engine's
              default policy), engine + suffix (adaptive k<=8, k<=16, and k<=8 with token trees)
    quoting8  the 8 quoting prompts together: engine k=0, n-gram, the three suffix rows
    general1, general8   the general chat prompts: engine k=0 and the three suffix rows (it must know when not
              to draft)
    repeat    the agent-like workload at batch 1: a question asked once, then again by another session; a function
              rewritten with one small edit, then with another by another session. Every row runs the first
              request, then the repeat, timed, on the same engine (the prefix cache as warm in each): engine
              k=0, n-gram, suffix with a new drafter for the repeat (no history) and suffix after the first.
              Questions and rewrites are reported apart (`--repeat-items` per run: half of each)
    gateway   the repeat workload through real processes (client -> gateway -> verifier <-> proposer, as
              `make run`): a target-only stack and a `--kind suffix` stack (adaptive k <= 16); the first request
              goes to both stacks, then the repeat, timed, in alternating order

In quoting and general rows every request has its own tenant, so the suffix drafter drafts only from the request's
own text (nothing from other requests, as for n-gram and prompt lookup); the repeat section uses one tenant. Each
row builds a fresh engine and drafter, warmed up as the verifier service warms up its own (a synthetic full
batch, then the policy's scoring times at every batch size). The drafter's own time (propose and release calls)
is measured in every suffix row; at batch 8 it is reported per proposed token against a target step at batch 8.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from proposer_service.ngram import NgramDrafter
from proposer_service.suffix import SuffixDrafter
from shared.drafting import Draft, DraftRequest
from shared.malloc_tuning import tune_malloc
from shared.sampling import SamplingParams
from shared.settings import default_draft_model, default_target_model
from specdec_bench.draft_ceiling import Oracle, accepted_runs, interpolate, oracle
from specdec_bench.engine_bench import Models, chat_ids, hf_generation_config, load_models, time_forward
from specdec_bench.prompts import GENERAL_PROMPTS, QUOTING_PROMPTS, REWRITE_TASKS, rewrite_prompt
from specdec_bench.report import load_average, run_meta, write_report
from specdec_local.builder import build_engine
from verifier_service.engine import EngineConfig

MARK_START = "<!-- suffix-bench:start -->"
MARK_END = "<!-- suffix-bench:end -->"
MAX_MODEL_LEN = 1024
LOOKUP_TOKENS = 10  # transformers' prompt lookup: tokens proposed per step (its documented example's value)
TREE_NODES = 16  # the policy drafts a tree only where it may hold more nodes than the chain's k


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    kind: str  # "hf", "hf-lookup" or "engine"
    drafter: str | None = None  # engine: None (k = 0), "ngram" or "suffix"
    k: int = 0
    tree_nodes: int = 0  # > 0: the engine verifies token trees of up to this many nodes (the policy's choice)


ROWS = {
    r.key: r
    for r in (
        Row("a", "HF generate, target", "hf"),
        Row("p", f"HF prompt lookup decoding ({LOOKUP_TOKENS} tokens)", "hf-lookup"),
        Row("c", "engine, target only (k=0)", "engine"),
        Row("e", "engine + n-gram, adaptive k<=8", "engine", "ngram", 8),
        Row("s8", "engine + suffix, adaptive k<=8", "engine", "suffix", 8),
        Row("s", "engine + suffix, adaptive k<=16", "engine", "suffix", 16),
        Row("s8t", f"engine + suffix, adaptive k<=8, trees<={TREE_NODES} nodes", "engine", "suffix", 8, TREE_NODES),
    )
}
SECTIONS = {  # (prompt set, batch, rows)
    "quoting1": ("quoting", 1, ("a", "p", "c", "e", "s8", "s", "s8t")),
    "quoting8": ("quoting", 8, ("c", "e", "s8", "s", "s8t")),
    "general1": ("general", 1, ("c", "s8", "s", "s8t")),
    "general8": ("general", 8, ("c", "s8", "s", "s8t")),
}
ALL_SECTIONS = (*SECTIONS, "repeat", "gateway")
REPEAT_ROWS = ("c", "e", "s-fresh", "s")  # "s-fresh": suffix without the first request


@dataclass
class Measurement:
    tokens: int
    seconds: float
    outputs: list[list[int]]
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    draft_seconds: float = 0.0  # in the drafter's propose and release calls
    proposed: int = 0  # draft tokens the drafter returned (before the engine trims to its k)
    drafter_calls: int = 0
    drafts: int = 0  # non-empty drafts the drafter returned
    trees: int = 0  # of which token trees
    first_outputs: list[list[int]] | None = None  # the repeat rows: the first request's output

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


class TimedDrafter:
    """A drafter with its own time counted: what drafting costs the engine's step."""

    def __init__(self, inner) -> None:
        self.inner, self.seconds, self.proposed, self.calls = inner, 0.0, 0, 0
        self.drafts = self.trees = 0

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        start = time.perf_counter()
        drafts = self.inner.propose(requests)
        self.seconds += time.perf_counter() - start
        self.proposed += sum(len(d.token_ids) for d in drafts)
        self.calls += 1
        self.drafts += sum(bool(d.token_ids) for d in drafts)
        self.trees += sum(d.is_tree for d in drafts)
        return drafts

    def release(self, seq_ids: list[str]) -> None:
        start = time.perf_counter()
        self.inner.release(seq_ids)
        self.seconds += time.perf_counter() - start


def make_drafter(kind: str | None) -> TimedDrafter | None:
    if kind is None:
        return None
    return TimedDrafter(NgramDrafter() if kind == "ngram" else SuffixDrafter())


def new_engine(models: Models, row: Row, drafter: TimedDrafter | None):
    config = EngineConfig(
        num_speculative_tokens=max(row.k, 1),
        max_num_seqs=8,
        max_model_len=MAX_MODEL_LEN,
        max_tree_nodes=row.tree_nodes,
    )
    engine = build_engine(models.target, drafter, config)
    # As the verifier service does before it serves (verifier_service/builder.py): the policy then starts from
    # scoring times measured at every batch size, not from guesses where a closed batch shrinks to new sizes.
    engine.warm_up()
    return engine


def run_engine(engine, drafter: TimedDrafter | None, prompts: list[list[int]], batch: int, max_tokens: int, tenants):
    """The prompts `batch` at a time; request i under tenants(i). Counters are this call's only."""
    stats = engine.stats
    before = (stats.drafted_tokens, stats.accepted_tokens, stats.draft_rounds)
    timed = (drafter.seconds, drafter.proposed, drafter.calls, drafter.drafts, drafter.trees) if drafter else (0,) * 5
    outputs: dict[int, list[int]] = {}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for g in range(0, len(prompts), batch):
        for i in range(g, min(g + batch, len(prompts))):
            engine.add_request(f"r{time.monotonic_ns()}-{i}", prompts[i], params, tenant=tenants(i))
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outputs[int(out.request_id.rsplit("-", 1)[1])] = out.output_ids
    seconds = time.perf_counter() - start
    ordered = [outputs[i] for i in range(len(prompts))]
    assert all(len(o) == max_tokens for o in ordered), [len(o) for o in ordered]
    return Measurement(
        sum(map(len, ordered)),
        seconds,
        ordered,
        stats.drafted_tokens - before[0],
        stats.accepted_tokens - before[1],
        stats.draft_rounds - before[2],
        (drafter.seconds - timed[0]) if drafter else 0.0,
        (drafter.proposed - timed[1]) if drafter else 0,
        (drafter.calls - timed[2]) if drafter else 0,
        (drafter.drafts - timed[3]) if drafter else 0,
        (drafter.trees - timed[4]) if drafter else 0,
    )


def run_hf(models: Models, row: Row, prompts: list[list[int]], max_tokens: int) -> Measurement:
    """One prompt at a time (transformers' prompt lookup decoding takes batch 1 only)."""
    config = hf_generation_config(models, 0.0, max_tokens, assisted=False)
    if row.kind == "hf-lookup":
        config.prompt_lookup_num_tokens = LOOKUP_TOKENS
    outputs, seconds = [], 0.0
    hf_model: Any = models.hf_target
    for ids in prompts:
        start = time.perf_counter()
        out = hf_model.generate(input_ids=torch.tensor([ids]), generation_config=config)
        seconds += time.perf_counter() - start
        outputs.append(out[0, len(ids) :].tolist())
    return Measurement(sum(map(len, outputs)), seconds, outputs)


def run_row(models: Models, key: str, prompts: list[list[int]], batch: int, max_tokens: int) -> Measurement:
    row = ROWS[key]
    if row.kind != "engine":
        return run_hf(models, row, prompts, max_tokens)
    drafter = make_drafter(row.drafter)
    return run_engine(new_engine(models, row, drafter), drafter, prompts, batch, max_tokens, lambda i: f"t{i}")


# ---- the repeat workload ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RepeatItem:
    name: str
    kind: str  # "question" (asked again as is) or "rewrite" (the same code, another small edit)
    first: list[int]
    repeat: list[int]


def repeat_items(tokenizer) -> list[RepeatItem]:
    items = [
        RepeatItem(f"question {i + 1}", "question", ids, ids)
        for i, ids in enumerate(chat_ids(tokenizer, p) for p in GENERAL_PROMPTS)
    ]
    for i, (code, first, second) in enumerate(REWRITE_TASKS):
        items.append(
            RepeatItem(
                f"rewrite {i + 1}",
                "rewrite",
                chat_ids(tokenizer, rewrite_prompt(code, first)),
                chat_ids(tokenizer, rewrite_prompt(code, second)),
            )
        )
    return items


def run_repeat(models: Models, key: str, item: RepeatItem, max_tokens: int) -> Measurement:
    """The repeat timed, after the first request on the same engine and tenant in every row (the prefix cache
    as warm in each); only "s" drafts the repeat with the drafter that followed the first request ("s-fresh"
    gets a new drafter for the repeat)."""
    row = ROWS["s" if key.startswith("s") else key]
    drafter = make_drafter(row.drafter)
    engine = new_engine(models, row, drafter)
    first = run_engine(engine, drafter, [item.first], 1, max_tokens, lambda i: "agent")
    if key == "s-fresh":
        assert drafter is not None
        drafter.inner = SuffixDrafter()  # no history: what the first request left is gone
    m = run_engine(engine, drafter, [item.repeat], 1, max_tokens, lambda i: "agent")
    m.first_outputs = first.outputs
    return m


def repeat_ceiling(models: Models, item: RepeatItem, target_only: Measurement) -> Oracle:
    """The best the repeat allows drafting from the text seen (draft_ceiling.py): the suffix drafter (k <= 16, as
    the "s" row) replayed over the target's greedy answers, first and repeat, and the target's forward times at
    the repeat's context (the model's own: no scheduler or sampler around it)."""
    assert target_only.first_outputs is not None
    drafter = SuffixDrafter()
    k = ROWS["s"].k
    accepted_runs(drafter, "first", item.first, target_only.first_outputs[0], k, "agent")
    runs = accepted_runs(drafter, "repeat", item.repeat, target_only.outputs[0], k, "agent")
    times = time_forward(*models.target, [item.repeat], (1, 2, 5, 9, 17), 3)
    return oracle(runs, interpolate(times))


def run_gateway_section(models: Models, plan: Plan, items: list[RepeatItem], log: Callable[[str], None]) -> dict:
    """The repeat workload through service processes; {("gateway-<kind>", "c" or "s"): [Measurement per item and
    run]}."""
    import asyncio
    import tempfile

    from specdec_bench.gateway_bench import STARTUP_TIMEOUT_S, build_stacks, run_gateway

    log_dir = Path(tempfile.mkdtemp(prefix="specdec-suffix-bench-"))
    stacks = build_stacks(log_dir, models.target_name, models.draft_name, names=["target", "suffix-adaptive"])
    procs = [p for stack in stacks.values() for p in stack.procs]
    log(f"starting {len(procs)} service processes; logs in {log_dir}")
    results: dict[tuple[str, str], list[Measurement]] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for stack in stacks.values():
            stack.wait_ready(deadline)

        def send(name: str, prompt: list[int]) -> Measurement:
            m = asyncio.run(run_gateway(stacks[name].gateway.address, [prompt], 1, plan.max_tokens))
            (trace,) = m.traces
            return Measurement(m.tokens, m.wall_s, [trace.ids], trace.drafted, trace.accepted, max(trace.steps - 1, 0))

        send("target", items[0].first)  # warm-up
        for run in range(plan.runs):
            for i, item in enumerate(pick(items, run, plan.repeat_items_per_run)):
                for name in stacks:  # both have served the first request: their prefix caches alike
                    send(name, item.first)
                order = [("c", "target"), ("s", "suffix-adaptive")][:: 1 if (run + i) % 2 else -1]
                for key, name in order:
                    m = send(name, item.repeat)
                    results.setdefault((f"gateway-{item.kind}", key), []).append(m)
                    log(f"run {run + 1} gateway {item.name} {key}: {m.tokens_per_s:.1f} tok/s")
    finally:
        codes = {p.name: p.stop() for p in reversed(procs)}
        log(f"service exit codes {codes}")
    return results


def pick(items: list[RepeatItem], run: int, n: int) -> list[RepeatItem]:
    """n items for this run, half questions (rounded up) and half rewrites, the next ones of each every run."""
    picked = []
    for kind, count in (("question", (n + 1) // 2), ("rewrite", n // 2)):
        of_kind = [item for item in items if item.kind == kind]
        picked += [of_kind[(run * count + i) % len(of_kind)] for i in range(count)]
    return picked


# ---- the benchmark ------------------------------------------------------------------------------------


@dataclass
class Plan:
    runs: int
    max_tokens: int
    batch1_prompts: int
    sections: tuple[str, ...]
    repeat_items_per_run: int


def run_benchmark(models: Models, plan: Plan, log: Callable[[str], None]) -> dict:
    tok = models.tokenizer
    prompt_ids = {
        "general": [chat_ids(tok, p) for p in GENERAL_PROMPTS],
        "quoting": [chat_ids(tok, p) for p in QUOTING_PROMPTS],
    }
    items = repeat_items(tok)
    step = statistics.median(time_forward(*models.target, prompt_ids["general"][:8], [1], 8)[1] for _ in range(3))
    log(f"target step at batch 8 (one token per sequence): {step * 1e3:.1f} ms")
    log("warm-up")
    for key in ("a", "p", "c", "s"):
        run_row(models, key, prompt_ids["quoting"][:1], 1, 4)
    results: dict[tuple[str, str], list[Measurement]] = {}
    repeat: dict[tuple[str, str], Measurement] = {}
    item_ratios: dict[str, list[float]] = {}  # repeat item -> suffix / target only, per run
    ceilings: dict[str, Oracle] = {}
    for run in range(plan.runs):
        for section in plan.sections:
            if section == "gateway":
                continue  # after the in-process runs: its services would compete with them for the cores
            if section == "repeat":
                for item in pick(items, run, plan.repeat_items_per_run):
                    shift = run % len(REPEAT_ROWS)
                    for key in REPEAT_ROWS[shift:] + REPEAT_ROWS[:shift]:
                        m = run_repeat(models, key, item, plan.max_tokens)
                        repeat[(item.name, key)] = m
                        results.setdefault((f"repeat-{item.kind}", key), []).append(m)
                        log(f"run {run + 1} repeat {item.name} {key}: {m.tokens_per_s:.1f} tok/s")
                    ratio = repeat[(item.name, "s")].tokens_per_s / repeat[(item.name, "c")].tokens_per_s
                    item_ratios.setdefault(item.name, []).append(ratio)
                    if item.name not in ceilings:
                        ceilings[item.name] = repeat_ceiling(models, item, repeat[(item.name, "c")])
                continue
            prompt_set, batch, keys = SECTIONS[section]
            ids = prompt_ids[prompt_set]
            prompts = (
                ids[:batch]
                if batch > 1
                else [ids[(run * plan.batch1_prompts + i) % len(ids)] for i in range(plan.batch1_prompts)]
            )
            shift = run % len(keys)
            for key in keys[shift:] + keys[:shift]:
                m = run_row(models, key, prompts, batch, plan.max_tokens)
                results.setdefault((section, key), []).append(m)
                log(f"run {run + 1} {section} {ROWS[key].label}: {m.tokens_per_s:.1f} tok/s")
    if "gateway" in plan.sections:
        results.update(run_gateway_section(models, plan, items, log))
    summary = summarise(results, repeat, step, plan)
    summary["ceilings"] = [
        {
            "item": name,
            "oracle_tokens_per_step": oracle.tokens_per_step,
            "oracle_vs_c": oracle.speedup,
            "measured_vs_c": statistics.median(item_ratios[name]),
        }
        for name, oracle in ceilings.items()
    ]
    return summary


def _ratio(results, section: str, key: str, base: str) -> float | None:
    ms, bs = results.get((section, key)), results.get((section, base))
    if not ms or not bs:
        return None
    return statistics.median(m.tokens_per_s / b.tokens_per_s for m, b in zip(ms, bs, strict=True))


def label_of(section: str, key: str) -> str:
    if key == "s-fresh":
        return "engine + suffix, adaptive k<=16, no history (fresh drafter)"
    if section.startswith("gateway"):
        return {"c": "gateway: target only (k=0)", "s": "gateway: suffix proposer, adaptive k<=16"}[key]
    return ROWS[key].label


def summarise(results, repeat, step: float, plan: Plan) -> dict:
    rows = []
    for (section, key), ms in results.items():
        row = {
            "section": section,
            "key": key,
            "label": label_of(section, key),
            "tokens_per_s": statistics.median(m.tokens_per_s for m in ms),
            "tokens_per_s_runs": [round(m.tokens_per_s, 2) for m in ms],
            "vs_c": _ratio(results, section, key, "c"),
            "vs_p": _ratio(results, section, key, "p"),
            "vs_e": _ratio(results, section, key, "e"),
        }
        drafted = sum(m.drafted for m in ms)
        if drafted:
            row["acceptance"] = sum(m.accepted for m in ms) / drafted
            row["mean_accepted_length"] = 1 + sum(m.accepted for m in ms) / sum(m.rounds for m in ms)
        proposed = sum(m.proposed for m in ms)
        if any(m.trees for m in ms):
            row["tree_share"] = sum(m.trees for m in ms) / sum(m.drafts for m in ms)
        if any(m.draft_seconds for m in ms):
            row["draft_ms_per_call"] = 1e3 * sum(m.draft_seconds for m in ms) / max(1, sum(m.drafter_calls for m in ms))
            if proposed:
                row["draft_ms_per_token"] = 1e3 * sum(m.draft_seconds for m in ms) / proposed
        rows.append(row)
    checks = output_checks(results, repeat)
    return {"rows": rows, "target_step_b8_s": step, "checks": checks, "repeat_items": sorted({n for n, _ in repeat})}


def output_checks(results, repeat) -> list[str]:
    """Greedy: every row equals engine k=0 on the same prompts, in every run."""
    lines = []
    for (section, key), ms in sorted(results.items()):
        base = results.get((section, "c"))
        if key == "c" or not base:
            continue
        pairs = [(o1, o2) for m, b in zip(ms, base, strict=True) for o1, o2 in zip(m.outputs, b.outputs, strict=True)]
        same = sum(o1 == o2 for o1, o2 in pairs)
        label = label_of(section, key)
        lines.append(f"{section}: {label} == engine k=0 on {same}/{len(pairs)} sequences")
    return lines


def render(summary: dict, meta: dict, plan: Plan) -> str:
    m = meta["machine"]
    out = [
        MARK_START,
        "## Suffix decoding (`specdec_bench.suffix_bench`, issue 27)",
        "",
        f"- Date: {meta['date']}; wall time {meta['runtime_s'] / 60:.1f} min; command `{meta['command']}`",
        f"- Machine: {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}, torch {m['torch']}, "
        f"transformers {m['transformers']}; load average at start / end: {meta['load_start']} / {meta['load_end']} "
        "(the machine is shared with other jobs)",
        f"- Greedy, {plan.max_tokens} new tokens per sequence (EOS ignored), {plan.runs} run(s), medians of the "
        f"per-run ratios; batch 1: {plan.batch1_prompts} prompt(s) per run (the next ones each run); repeat: "
        f"{plan.repeat_items_per_run} item(s) per run of: {', '.join(summary['repeat_items'])}",
        f"- Target step at batch 8 (one token per sequence): {summary['target_step_b8_s'] * 1e3:.1f} ms",
        "",
        "| section | row | tokens/s | × engine k=0 | × HF prompt lookup | × n-gram | acceptance | mean acc. len "
        "| drafter ms / call | drafter ms / proposed token |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def f(v, spec=".2f"):
        return "—" if v is None else format(v, spec)

    for r in sorted(
        summary["rows"], key=lambda r: (r["section"], list(ROWS).index(r["key"]) if r["key"] in ROWS else 9)
    ):
        out.append(
            f"| {r['section']} | {r['label']} | {r['tokens_per_s']:.1f} | {f(r['vs_c'])} | {f(r['vs_p'])} "
            f"| {f(r['vs_e'])} | {f(r.get('acceptance'), '.3f')} | {f(r.get('mean_accepted_length'))} "
            f"| {f(r.get('draft_ms_per_call'), '.3f')} | {f(r.get('draft_ms_per_token'), '.3f')} |"
        )
    trees = [f"{r['section']} {r['tree_share']:.0%}" for r in summary["rows"] if r.get("tree_share")]
    if trees:
        out += ["", f"Drafts sent as token trees (the rest chains), trees<={TREE_NODES} rows: {', '.join(trees)}"]
    out += ["", "### Targets", "", "| target | measured | result |", "| --- | ---: | --- |"]
    by = {(r["section"], r["key"]): r for r in summary["rows"]}

    def target(label: str, value: float | None, ok: Callable[[float], bool]) -> None:
        if value is not None:
            out.append(f"| {label} | {value:.2f} | {'PASS' if ok(value) else 'FAIL'} |")

    for key in ("s", "s8"):
        target(
            f"quoting, batch 1: {ROWS[key].label} >= 1.5x HF prompt lookup",
            by.get(("quoting1", key), {}).get("vs_p"),
            lambda v: v >= 1.5,
        )
    for section in ("repeat-question", "repeat-rewrite", "gateway-question", "gateway-rewrite"):
        measured = by.get((section, "s"), {}).get("vs_c")
        target(f"{section}: suffix after the first request >= 3x target only", measured, lambda v: v >= 3)
    for section in ("general1", "general8"):
        for key in ("s8", "s"):
            measured = by.get((section, key), {}).get("vs_c")
            target(f"{section}: {ROWS[key].label} >= 0.97x engine k=0", measured, lambda v: v >= 0.97)
    for section in ("quoting8", "general8"):
        cost = by.get((section, "s"), {}).get("draft_ms_per_token")
        if cost is not None:
            share = cost / 1e3 / summary["target_step_b8_s"]
            label = f"{section}: drafting time per proposed token < 2% of a target step at batch 8"
            out.append(f"| {label} | {share:.2%} | {'PASS' if share < 0.02 else 'FAIL'} |")
    if summary.get("ceilings"):
        out += ["", CEILING_NOTE, "", "| item | oracle tokens / step | oracle × target only | measured × target only |"]
        out.append("| --- | ---: | ---: | ---: |")
        for c in summary["ceilings"]:
            ratios = f"{c['oracle_vs_c']:.2f} | {c['measured_vs_c']:.2f}"
            out.append(f"| {c['item']} | {c['oracle_tokens_per_step']:.2f} | {ratios} |")
    out += ["", "### Output checks (greedy)", ""] + [f"- {line}" for line in summary["checks"]]
    out += ["", HOW_TO_READ, MARK_END, ""]
    return "\n".join(out)


CEILING_NOTE = """\
### What the repeat workload allows (`specdec_bench.draft_ceiling`)

The suffix drafter (k <= 16) replayed over the target's greedy answers, first and repeat; at every step an oracle
drafts exactly the tokens the target accepts (the best any draft length policy could do with these drafts),
timed by the target's own forward times at the repeat's context (no scheduler or sampler). Measured: the suffix
row over target only for that item (median over the runs it was in). Where the target answers the repeat
differently from the first request and from its prompt, no drafter of seen text can reach far."""


HOW_TO_READ = """\
tokens/s: generated tokens over the wall time of generation (engine construction excluded). Each ratio is
taken inside a run, row against baseline timed minutes apart, and the median over runs is shown. The suffix rows
draft from the request's own text (quoting, general: every request has its own tenant) and, in the repeat
section, from the first request's answer held in the tenant's global tree ("no history" is the same drafter
without the first request). The drafter's time is what its propose and release calls took, in the engine's
thread (the tree updates of every committed token included); at batch 8 it is divided by the tokens it
proposed and set against a target step at batch 8."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke check: 1 run, 32 tokens")
    parser.add_argument("--runs", type=int, default=None, help="repetitions (default 3; quick 1)")
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per sequence (default 128; quick 32)")
    parser.add_argument("--batch1-prompts", type=int, default=2, help="prompts per batch-1 run (default 2)")
    parser.add_argument(
        "--repeat-items",
        type=int,
        default=4,
        help="repeat workload items per run, half questions, half rewrites (default 4)",
    )
    parser.add_argument("--sections", default=",".join(ALL_SECTIONS), help="comma-separated sections")
    parser.add_argument("--out", default="docs/BENCHMARKS.md", help="Markdown file to update ('' to skip)")
    parser.add_argument("--json", default="", help="also write the raw summary as JSON here")
    args = parser.parse_args(argv)
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = [s for s in sections if s not in ALL_SECTIONS]
    if unknown:
        raise SystemExit(f"--sections: unknown {unknown}; sections are {', '.join(ALL_SECTIONS)}")
    plan = Plan(
        runs=args.runs or (1 if args.quick else 3),
        max_tokens=args.max_tokens or (32 if args.quick else 128),
        batch1_prompts=args.batch1_prompts,
        sections=sections,
        repeat_items_per_run=args.repeat_items,
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    malloc_tuned = tune_malloc()
    torch.set_num_threads(2)
    started = time.perf_counter()
    load_start = load_average()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {message}", flush=True)

    models = load_models(default_target_model(), default_draft_model(), hf=True)
    with torch.inference_mode():
        summary = run_benchmark(models, plan, log)
    meta = run_meta("suffix_bench", argv, time.perf_counter() - started, malloc_tuned, load_start)
    section = render(summary, meta, plan)
    print(section)
    if args.out:
        write_report(Path(args.out), section, MARK_START, MARK_END)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, **summary}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
