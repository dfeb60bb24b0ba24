"""What every benchmark does with its report: replace its own marked section of docs/BENCHMARKS.md."""

from __future__ import annotations

import os
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
