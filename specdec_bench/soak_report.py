"""The soak's records, checks, tables and plot (specdec_bench/soak.py runs it)."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# A process's memory level at a moment: the median of its samples over this many seconds. One sample taken
# while a step's activations are allocated reads tens of MiB above the level (a 2 s interval catches some).
RSS_LEVEL_S = 10.0
MIN_RSS_WINDOW_S = 20.0  # a process instance whose life after warm-up is shorter is reported, not checked


@dataclass
class Record:
    """One request of the load."""

    kind: str  # greedy, seeded, stop, cancel, deadline, invalid
    spec_kind: str  # the deterministic request it was built from
    start_s: float
    end_s: float = 0.0
    ids: list[int] = field(default_factory=list)
    token_times: list[tuple[float, int]] = field(default_factory=list)  # (seconds, tokens in that message)
    finish: int = 0
    # completed, cancelled (by the client, on purpose), deadline (short deadline, on purpose), rejected (invalid,
    # on purpose), failed, mismatch (output differs from the undisturbed reference)
    outcome: str = ""
    code: str = ""
    detail: str = ""
    checked: bool = False  # its tokens were compared with the reference


@dataclass
class Check:
    name: str
    value: str
    target: str
    ok: bool


@dataclass
class SoakReport:
    config: dict[str, Any]
    checks: list[Check]
    outcomes: dict[str, dict[str, int]]  # kind -> outcome -> count
    latency: dict[str, float]
    rss: list[dict[str, Any]]
    events: list[dict[str, Any]]
    final_state: dict[str, Any]
    problems: list[str]
    series: dict[str, list[float]]
    summary: dict[str, Any]

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.checks) and not self.problems

    def markdown(self) -> str:
        lines = ["| check | result | target | pass |", "|---|---|---|---|"]
        lines += [f"| {c.name} | {c.value} | {c.target} | {'yes' if c.ok else '**NO**'} |" for c in self.checks]
        lat = self.latency
        lines += [
            "",
            "| latency | p50 | p99 |",
            "|---|---|---|",
            f"| time to first token (ms) | {lat['ttft_p50_ms']:.0f} | {lat['ttft_p99_ms']:.0f} |",
            f"| inter-token latency (ms per token) | {lat['itl_p50_ms']:.0f} | {lat['itl_p99_ms']:.0f} |",
            "",
            "| requests by kind | " + " | ".join(OUTCOMES) + " |",
            "|---|" + "---|" * len(OUTCOMES),
        ]
        for kind, counts in sorted(self.outcomes.items()):
            lines.append(f"| {kind} | " + " | ".join(str(counts.get(o, 0)) for o in OUTCOMES) + " |")
        lines += ["", "| process (instance) | window (s) | RSS at warm-up (MiB) | RSS at end (MiB) | growth |"]
        lines.append("|---|---|---|---|---|")
        for r in self.rss:
            growth = (
                f"{r['growth'] * 100:+.1f}%"
                if r["checked"]
                else f"{r['growth'] * 100:+.1f}% (not checked: {r['note']})"
            )
            lines.append(
                f"| {r['service']} (pid {r['pid']}) | {r['from_s']:.0f}-{r['to_s']:.0f} | {r['baseline_mib']:.0f} | "
                f"{r['final_mib']:.0f} | {growth} |"
            )
        lines += ["", "Chaos: " + "; ".join(f"{e['what']} {e['service']} at {e['at_s']:.0f} s" for e in self.events)]
        s = self.summary
        lines.append(
            f"\nLoad {s['load_s']:.0f} s after {s['reference_s']:.0f} s of references ({s['num_specs']} deterministic "
            f"requests); {s['requests']} requests, {s['tokens']} tokens streamed ({s['tokens_per_s']:.1f} tokens/s), "
            f"{s['resumed']} resumed by the gateway."
        )
        if self.problems:
            lines += ["", "Problems:", *(f"- {p}" for p in self.problems)]
        bad = self.summary.get("bad_examples", [])
        if bad:
            lines += ["", "Failed or mismatched requests (first few):", *(f"- {b}" for b in bad)]
        return "\n".join(lines)

    @classmethod
    def from_json(cls, path: Path) -> SoakReport:
        """A report written by write(), e.g. to draw its plot again."""
        data = json.loads(path.read_text())
        data["checks"] = [Check(**c) for c in data["checks"]]
        return cls(**data)

    def write(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "soak.md").write_text(self.markdown() + "\n")
        data = asdict(self)
        (out / "soak.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
        plot(self, out / "soak.png")


OUTCOMES = ("completed", "cancelled", "deadline", "rejected", "failed", "mismatch")


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _latencies(records: list[Record]) -> tuple[list[float], list[tuple[float, float]]]:
    """TTFT of every request with tokens (seconds), and per-token inter-token gaps as (time, seconds)."""
    ttft, itl = [], []
    for r in records:
        if not r.token_times:
            continue
        ttft.append(r.token_times[0][0] - r.start_s)
        for (t_prev, _), (t, n) in zip(r.token_times, r.token_times[1:], strict=False):
            itl += [(t, (t - t_prev) / n)] * n
    return ttft, itl


def _rss_rows(rss: dict[str, list], events: list[dict[str, Any]], warmup: float, end_s: float) -> list[dict[str, Any]]:
    """Per process instance: the RSS level once warm (warmup x its serving window in) and at its end (medians
    over RSS_LEVEL_S at each end)."""
    ready = {}  # (service, n-th restart) -> time it was serving again
    restarts: Counter = Counter()
    for e in events:
        if e["what"] == "ready":
            restarts[e["service"]] += 1
            ready[(e["service"], restarts[e["service"]])] = e["at_s"]
    rows = []
    for service, samples in rss.items():
        pids = list(dict.fromkeys(pid for _, pid, _ in samples))
        for n, pid in enumerate(pids):
            mine = [(t, b) for t, p, b in samples if p == pid]
            start = 0.0 if n == 0 else ready.get((service, n), mine[0][0])
            to = mine[-1][0]
            warm_at = start + warmup * max(0.0, to - start)
            after = [(t, b) for t, b in mine if t >= warm_at] or mine[-1:]
            base = statistics.median(b for t, b in after if t <= after[0][0] + RSS_LEVEL_S)
            final = statistics.median(b for t, b in mine if t >= to - RSS_LEVEL_S)
            window = to - warm_at
            rows.append(
                dict(
                    service=service,
                    pid=pid,
                    from_s=start,
                    to_s=to,
                    baseline_mib=base / 2**20,
                    final_mib=final / 2**20,
                    growth=(final - base) / base,
                    checked=window >= MIN_RSS_WINDOW_S,
                    note=f"{window:.0f} s after warm-up" if window < MIN_RSS_WINDOW_S else "",
                )
            )
    return rows


def _series(records: list[Record], itl: list[tuple[float, float]], end_s: float) -> dict[str, list[float]]:
    bucket = max(1.0, round(end_s / 60))
    edges = np.arange(0.0, end_s + bucket, bucket)
    tokens = np.zeros(len(edges))
    ttft: list[list[float]] = [[] for _ in edges]
    gaps: list[list[float]] = [[] for _ in edges]
    for r in records:
        for t, n in r.token_times:
            tokens[min(int(t // bucket), len(edges) - 1)] += n
        if r.token_times:
            ttft[min(int(r.token_times[0][0] // bucket), len(edges) - 1)].append(r.token_times[0][0] - r.start_s)
    for t, g in itl:
        gaps[min(int(t // bucket), len(edges) - 1)].append(g)
    return dict(
        t=[float(e) for e in edges],
        tokens_per_s=[float(x / bucket) for x in tokens],
        ttft_p50_ms=[_pct(v, 50) * 1e3 for v in ttft],
        itl_p50_ms=[_pct(v, 50) * 1e3 for v in gaps],
        bucket_s=[bucket],
    )


def build_report(
    *,
    config: dict[str, Any],
    records: list[Record],
    events: list[dict[str, Any]],
    rss: dict[str, list],
    final_state: dict[str, Any],
    problems: list[str],
    reference_s: float,
    load_s: float,
    num_specs: int,
    warmup_fraction: float,
    rss_growth_limit: float,
    duration_s: float,
) -> SoakReport:
    outcomes: dict[str, dict[str, int]] = {}
    for r in records:
        outcomes.setdefault(r.kind, {})
        outcomes[r.kind][r.outcome] = outcomes[r.kind].get(r.outcome, 0) + 1
    count = Counter(r.outcome for r in records)
    invalid = [r for r in records if r.kind == "invalid"]
    compared = [r for r in records if r.outcome == "completed" and r.kind in ("greedy", "seeded", "stop", "deadline")]
    partial = [r for r in records if r.outcome in ("cancelled", "deadline") and r.ids]
    ttft, itl = _latencies(records)
    rss_rows = _rss_rows(rss, events, warmup_fraction, load_s)
    checked_rss = [r for r in rss_rows if r["checked"]]
    worst = max(checked_rss, key=lambda r: r["growth"], default=None)
    kills = [e for e in events if e["what"] == "kill"]
    gw = next((v for v in final_state.values() if "resumed" in v), {})
    kinds_seen = {r.kind for r in records}
    checks = [
        Check(
            "requests that failed (not on purpose)",
            f"{count['failed']} of {len(records)}",
            "0",
            count["failed"] == 0 and len(records) > 0,
        ),
        Check(
            "deliberately invalid requests refused (INVALID_ARGUMENT)",
            f"{sum(r.outcome == 'rejected' for r in invalid)} of {len(invalid)}",
            "all",
            all(r.outcome == "rejected" for r in invalid),
        ),
        Check(
            "outputs different from the undisturbed reference",
            f"{count['mismatch']} ({len(compared)} completed compared, {len(partial)} cut-short checked as prefixes)",
            "0",
            count["mismatch"] == 0 and len(compared) > 0,
        ),
        Check(
            "request kinds exercised",
            ", ".join(sorted(kinds_seen)),
            "all 6",
            len(kinds_seen) == 6,
        ),
        Check(
            "kills done (each restarted and serving again)",
            f"{len(kills)} kills, {sum(e['what'] == 'ready' for e in events)} back",
            "every planned one",
            bool(kills)
            and not any(e["what"] == "skipped" for e in events)
            and sum(e["what"] == "ready" for e in events) == len(kills),
        ),
        Check(
            "requests resumed on another verifier",
            str(gw.get("resumed", 0)),
            "> 0 (the verifier kills hit streams)",
            gw.get("resumed", 0) > 0,
        ),
        Check(
            "KV blocks free and no request left at the end",
            "; ".join(
                f"{k}: {v['kv_free']}/{v['kv_total']} free, {v['running']}+{v['waiting']} requests"
                if "kv_free" in v
                else f"{k}: {v['active']} in flight"
                for k, v in final_state.items()
            ),
            "100% free, 0 requests",
            not any("not idle" in p for p in problems) and bool(final_state),
        ),
        Check(
            "resident memory growth after warm-up (worst process)",
            f"{worst['growth'] * 100:+.1f}% ({worst['service']})" if worst else "n/a",
            f"< {rss_growth_limit * 100:.0f}%",
            worst is not None and worst["growth"] < rss_growth_limit,
        ),
    ]
    tokens = sum(len(r.ids) for r in records)
    bad = [
        f"{r.kind} ({r.spec_kind}) at {r.start_s:.1f} s: {r.outcome} {r.code} {r.detail[:300]}"
        for r in records
        if r.outcome in ("failed", "mismatch")
    ][:10]
    return SoakReport(
        config=config,
        checks=checks,
        outcomes=outcomes,
        latency=dict(
            ttft_p50_ms=_pct(ttft, 50) * 1e3,
            ttft_p99_ms=_pct(ttft, 99) * 1e3,
            itl_p50_ms=_pct([g for _, g in itl], 50) * 1e3,
            itl_p99_ms=_pct([g for _, g in itl], 99) * 1e3,
        ),
        rss=rss_rows,
        events=events,
        final_state=final_state,
        problems=problems,
        series=_series(records, itl, load_s),
        summary=dict(
            requests=len(records),
            tokens=tokens,
            tokens_per_s=tokens / load_s if load_s else 0.0,
            load_s=load_s,
            reference_s=reference_s,
            num_specs=num_specs,
            resumed=gw.get("resumed", 0),
            bad_examples=bad,
            duration_s=duration_s,
        ),
    )


def plot(report: SoakReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report.series
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    bucket = s["bucket_s"][0]
    top.step(s["t"], s["tokens_per_s"], where="post", color="tab:blue")
    top.set_ylabel(f"tokens/s streamed\n({bucket:g} s buckets)")
    bottom.plot(s["t"], s["ttft_p50_ms"], ".-", label="time to first token, p50", color="tab:orange")
    bottom.plot(s["t"], s["itl_p50_ms"], ".-", label="inter-token latency, p50", color="tab:green")
    bottom.set_yscale("log")
    bottom.set_ylabel("ms")
    bottom.set_xlabel("seconds since the load started")
    for ax in (top, bottom):
        for e in report.events:
            if e["what"] == "kill":
                ax.axvline(e["at_s"], color="red", lw=1.2)
            elif e["what"] == "ready":
                ax.axvline(e["at_s"], color="grey", lw=1, ls="--")
        ax.axvline(report.config["duration_s"], color="black", lw=1, ls=":")
        ax.grid(alpha=0.3)
    ymax = top.get_ylim()[1]
    for e in report.events:
        if e["what"] == "kill":
            top.text(
                e["at_s"], ymax * 0.97, f" kill {e['service'].split('-', 1)[-1]}", color="red", va="top", fontsize=8
            )
    bottom.plot([], [], color="red", label="SIGKILL")
    bottom.plot([], [], color="grey", ls="--", label="restarted service serving again")
    bottom.plot([], [], color="black", ls=":", label="clients stop sending (then running requests finish)")
    bottom.legend(loc="upper left", fontsize=8)
    cfg = report.config
    top.set_title(f"soak: {cfg['clients']} clients, {cfg['duration_s']:.0f} s, gateway + 2 verifiers + proposer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
