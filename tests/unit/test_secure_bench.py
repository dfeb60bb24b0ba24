"""specdec_bench.secure_bench without processes: ratios, PASS/FAIL, the token check, the section's markers, the
flags each role gets. The benchmark itself runs in `make bench`, not here."""

from __future__ import annotations

from specdec_bench import secure_bench as sb
from specdec_bench.gateway_bench import Trace


def measurement(per_token_s: float, ids: list[int], requests: int = 2, cpu: float = 1.0) -> sb.Timed:
    traces = []
    for _ in range(requests):
        t = Trace(0.0, times=[0.1 + i * per_token_s for i in range(len(ids))], counts=[1] * len(ids), ids=list(ids))
        traces.append(t)
    return sb.Timed(requests * (0.1 + len(ids) * per_token_s), traces, {"gateway": cpu, "verifier": 2 * cpu})


def test_overhead_is_the_median_of_per_run_ratios_and_judged_against_3_percent():
    results = {
        ("target", 1, "a"): [measurement(0.100, [1, 2, 3, 4]), measurement(0.100, [1, 2, 3, 4])],
        ("target", 1, "b"): [measurement(0.102, [1, 2, 3, 4]), measurement(0.101, [1, 2, 3, 4])],
        ("target", 8, "a"): [measurement(0.100, [5, 6, 7])],
        ("target", 8, "b"): [measurement(0.110, [5, 6, 8], cpu=1.1)],
    }
    summary = sb.summarise(results)
    one, eight = summary["overhead"]
    assert abs(one["tpot_ms"] - 1.015) < 1e-9 and one["pass"]
    assert abs(eight["tpot_ms"] - 1.1) < 1e-9 and not eight["pass"]
    assert abs(eight["cpu_ms_per_token"] - 1.1) < 1e-9 and one["cpu_ms_per_token"] == 1.0
    assert summary["rows"][0]["gateway_cpu_ms_per_token"] == 1e3 / 8  # 1 s over 2 requests of 4 tokens
    assert summary["checks"][0].endswith("in 4/4 requests")
    assert summary["checks"][1].endswith("in 0/2 requests")  # one token differs

    meta = {
        "date": "d",
        "runtime_s": 60.0,
        "quick": False,
        "command": "python -m specdec_bench.secure_bench",
        "machine": {"cpu": "cpu", "cores": 2, "torch": "t", "python": "p"},
        "load_start": "3.0 2.0 1.0",
        "load_end": "n/a",
        "target": "T",
        "draft": "D",
        "with_draft": False,
        "secured": ["plaintext client: UNAVAILABLE"],
        "runs": 2,
        "max_tokens": 4,
        "batch1_prompts": 2,
    }
    text = sb.render(summary, meta)
    assert text.startswith(sb.MARK_START) and text.rstrip().endswith(sb.MARK_END)
    assert "| PASS |" in text and "| FAIL |" in text and "busy with other jobs" in text


def test_flags_per_role(tmp_path):
    s = sb.make_secrets(tmp_path)
    assert "--api-keys-file" in s.flags("gateway") and "--api-keys-file" not in s.flags("verifier")
    assert "--tls-server-name" not in s.flags("proposer")  # it dials nobody
    assert (tmp_path / "api-keys.txt").read_text().split()[0] == s.key
    assert s.metadata == (("authorization", f"Bearer {s.key}"),)
