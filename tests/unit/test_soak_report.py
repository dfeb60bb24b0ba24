"""The soak's checks fail when they should (specdec_bench/soak_report.py), on made-up records."""

from __future__ import annotations

from specdec_bench.soak import Spec, _check_output
from specdec_bench.soak_report import Record, SoakReport, build_report

KINDS = ("greedy", "seeded", "stop", "cancel", "deadline", "invalid")


def _records() -> list[Record]:
    out = []
    for i, kind in enumerate(KINDS * 3):
        outcome = {"cancel": "cancelled", "deadline": "deadline", "invalid": "rejected"}.get(kind, "completed")
        t = float(i)
        out.append(Record(kind, "greedy", t, t + 1, [1, 2, 3], [(t + 0.2, 1), (t + 0.4, 2)], 1, outcome))
    return out


def _events() -> list[dict]:
    return [dict(at_s=5.0, what="kill", service="s-verifier-a"), dict(at_s=9.0, what="ready", service="s-verifier-a")]


def _report(records=None, rss_end=100, final=None, problems=(), rss_mib=None):
    """`rss_mib`: the gateway's (time, MiB) samples; by default 100 MiB until 50 s, then `rss_end`."""
    mib = 2**20
    samples = rss_mib or [(t, 100 if t < 50 else rss_end) for t in range(0, 60, 2)]
    rss = {"s-gateway": [(t, 42, v * mib) for t, v in samples]}
    return build_report(
        config=dict(clients=2, duration_s=60.0),
        records=records if records is not None else _records(),
        events=_events(),
        rss=rss,
        final_state=final
        or {
            "s-verifier-a": dict(running=0, waiting=0, kv_free=10, kv_total=10),
            "s-gateway": dict(active=0, total=18, resumed=2),
        },
        problems=list(problems),
        reference_s=1.0,
        load_s=60.0,
        num_specs=4,
        warmup_fraction=0.3,
        rss_growth_limit=0.05,
        duration_s=60.0,
    )


def test_a_clean_run_passes_and_renders(tmp_path):
    report = _report()
    assert report.passed, report.markdown()
    assert "| time to first token (ms) | 200 |" in report.markdown()
    report.write(tmp_path)
    assert (tmp_path / "soak.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "soak.md").read_text()
    assert SoakReport.from_json(tmp_path / "soak.json").markdown() == report.markdown()


def test_each_check_can_fail():
    records = _records()
    records[0].outcome = "mismatch"
    assert not _report(records).passed
    records = _records()
    records[1].outcome = "failed"
    assert not _report(records).passed
    records = _records()
    next(r for r in records if r.kind == "invalid").outcome = "completed"
    assert not _report(records).passed
    assert not _report([r for r in _records() if r.kind != "stop"]).passed  # a kind never exercised
    assert not _report(rss_end=106).passed  # 6% growth after warm-up
    assert _report(rss_end=104).passed
    busy = {"s-verifier-a": dict(running=0, waiting=0, kv_free=9, kv_total=10), "s-gateway": dict(active=0, resumed=1)}
    assert not _report(final=busy, problems=["not idle at the end: s-verifier-a"]).passed
    assert not _report(final={"s-gateway": dict(active=0, resumed=0)}).passed  # nothing resumed


def test_outputs_are_compared_with_the_reference():
    spec = Spec("seeded", {}, ref_ids=[5, 6, 7, 8], ref_finish=2)
    done = Record("seeded", "seeded", 0.0, ids=[5, 6, 7, 8], finish=2, outcome="completed")
    _check_output(done, spec)
    assert done.outcome == "completed"
    wrong = Record("seeded", "seeded", 0.0, ids=[5, 6, 9, 8], finish=2, outcome="completed")
    _check_output(wrong, spec)
    assert wrong.outcome == "mismatch"
    cut = Record("cancel", "seeded", 0.0, ids=[5, 6], outcome="cancelled")
    _check_output(cut, spec)
    assert cut.outcome == "cancelled"
    longer = Record("cancel", "seeded", 0.0, ids=[5, 6, 7, 8, 9, 10], finish=1, outcome="completed")
    _check_output(longer, spec)
    assert longer.outcome == "completed"
    diverged = Record("deadline", "seeded", 0.0, ids=[5, 7], outcome="deadline")
    _check_output(diverged, spec)
    assert diverged.outcome == "mismatch"


def test_memory_growth_is_of_the_level_not_of_one_sample():
    """A last sample taken mid-step (20% above the level) is no growth; the level rising 6% for the last 10 s is."""
    spike = [(t, 120 if t == 58 else 100) for t in range(0, 60, 2)]
    assert _report(rss_mib=spike).passed
    risen = [(t, 106 if t >= 48 else 100) for t in range(0, 60, 2)]
    assert not _report(rss_mib=risen).passed
