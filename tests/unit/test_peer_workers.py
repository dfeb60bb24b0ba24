"""The peer benchmark's interleaved workers (specdec_bench/peer_workers.py): the line protocol over their own pipes,
with stand-in workers (no engine), and a worker's death or silence reported with its log rather than waited on."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest

from specdec_bench.peer_bench import quiet_pass
from specdec_bench.peer_workers import Worker, WorkerDied

ROOT = Path(__file__).resolve().parents[2]

STAND_IN = textwrap.dedent(
    """
    import sys, threading, time
    from specdec_bench.peer_workers import serve

    def spin(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass

    def load():
        print("a log line on stdout, not on the protocol's pipe", flush=True)
        def run_pass(batch):
            if batch == 13:
                raise SystemExit("unlucky batch")
            if batch == 99:
                time.sleep(60)
            if batch == 5:  # a pass that takes a while
                time.sleep(0.6)
            if batch == 7:  # as vLLM's worker does: busy for a while after answering
                threading.Thread(target=spin, args=(1.0,)).start()
            return {"seconds": [0.5], "outputs": [[batch] * 3]}
        return {"load_s": 1.5}, run_pass

    serve(int(sys.argv[1]), int(sys.argv[2]), load)
    """
)


def start(tmp_path: Path, timeout_s: float = 30.0) -> Worker:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    return Worker([sys.executable, str(script)], env, tmp_path / "worker.log", ROOT, timeout_s)


def test_ready_passes_and_last_words(tmp_path: Path) -> None:
    worker = start(tmp_path)
    assert worker.wait_ready() == {"ready": True, "load_s": 1.5}
    assert worker.ask({"batch": 8}) == {"seconds": [0.5], "outputs": [[8, 8, 8]]}
    assert worker.ask({"batch": 1}) == {"seconds": [0.5], "outputs": [[1, 1, 1]]}
    assert worker.stop() == {}
    assert worker.proc.returncode is not None
    assert "a log line on stdout" in (tmp_path / "worker.log").read_text()


def test_a_dead_worker_is_reported_with_its_log(tmp_path: Path) -> None:
    worker = start(tmp_path)
    worker.wait_ready()
    with pytest.raises(WorkerDied, match="unlucky batch"):
        worker.ask({"batch": 13})
    assert worker.stop() == {}  # already gone: no last words, no hang


def test_a_silent_worker_times_out(tmp_path: Path) -> None:
    worker = start(tmp_path, timeout_s=3.0)
    worker.wait_ready()
    with pytest.raises(WorkerDied, match="no answer in 3 s"):
        worker.ask({"batch": 99})
    worker.stop()


def test_a_pass_starts_once_the_other_worker_is_quiet_and_counts_its_cpu(tmp_path: Path) -> None:
    """A worker busy for a second after its pass (vLLM's shm queue polls so) would take the cores from the next pass:
    the driver waits it out, and the CPU it used during the next pass is reported, which shows a spinner."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    workers = {"spinner": start(tmp_path / "a"), "measured": start(tmp_path / "b")}
    try:
        for worker in workers.values():
            worker.wait_ready()
        workers["spinner"].ask({"batch": 7})
        before = workers["spinner"].cpu_seconds()
        unguarded = workers["measured"].ask({"batch": 5})  # asked at once: the spinner works through the pass
        assert unguarded["seconds"] == [0.5] and workers["spinner"].cpu_seconds() - before >= 0.2
        workers["spinner"].ask({"batch": 7})
        start_s = time.monotonic()
        guarded = quiet_pass(workers, "measured", 5)
        assert time.monotonic() - start_s >= 1.0  # its second of spinning waited out, then the pass's 0.6 s
        assert guarded["seconds"] == [0.5] and guarded["beside_cpu_s"] < 0.1
    finally:
        for worker in workers.values():
            worker.stop()
