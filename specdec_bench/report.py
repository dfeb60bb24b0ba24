"""What every benchmark does with its report: say how and where it ran (`run_meta`), and replace its own
marked section of docs/BENCHMARKS.md (`write_report`)."""

from __future__ import annotations

import os
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path


def write_report(path: Path, section: str, start: str, end: str) -> None:
    """Replace the text between the markers `start` and `end` (append the section when they are missing)."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        text = head + section + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (the machine is shared: reports say how busy it was)."""
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def machine_info(malloc_tuned: bool) -> dict:
    import torch
    import transformers

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
        "malloc": "glibc thresholds fixed (shared/malloc_tuning.py)" if malloc_tuned else "glibc defaults",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def run_meta(module: str, argv: list[str] | None, runtime_s: float, malloc_tuned: bool, load_start: str) -> dict:
    """When and how long the run was, its command (the command line's arguments when run from the shell), the
    machine and its load at the start and now: the part of every report's metadata that is the same."""
    command = f"python -m specdec_bench.{module}" + (" " + " ".join(sys.argv[1:]) if argv is None else "")
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "runtime_s": runtime_s,
        "command": command.strip(),
        "machine": machine_info(malloc_tuned),
        "load_start": load_start,
        "load_end": load_average(),
    }
