"""The trainer's whole pipeline on a tiny random target (`--quick`): data, subset, training, card, resume."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from safetensors import safe_open

from specdec_train.__main__ import main
from specdec_train.report import frequency_subset


def test_quick_pipeline_writes_a_loadable_head_and_resumes(tmp_path):
    work, out = tmp_path / "work", tmp_path / "head"
    args = ["--quick", "--work-dir", str(work), "--out", str(out), "--threads", "1"]
    main(args)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["SpecdecEagleHead"] and config["draft_vocab_size"] == 64
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        dtypes = {name: f.get_tensor(name).dtype for name in names}
        first = {name: f.get_tensor(name) for name in names}
    assert "vocab_subset" in names and not any("embed" in n or "lm_head" in n for n in names)
    assert {d for n, d in dtypes.items() if n != "vocab_subset"} == {torch.float16}
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    card = (out / "README.md").read_text()
    assert "python -m specdec_train" in card and "mean accepted length" in card
    shards = sorted((work / "data").glob("shard-*.pt"))
    stamps = [p.stat().st_mtime_ns for p in shards]
    checkpoint = work / "checkpoint-seed0.pt"
    assert torch.load(checkpoint)["step"] == 12

    main(args)  # everything is on disk: nothing is generated or trained again
    assert [p.stat().st_mtime_ns for p in shards] == stamps
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert all(torch.equal(f.get_tensor(n), first[n]) for n in names)


def test_frequency_subset_ranks_by_count_then_id():
    samples = [{"tokens": torch.tensor([5, 5, 5, 9, 9, 2]), "prompt_len": 0}]
    subset = frequency_subset(samples, vocab_size=12, size=5, always=(11,))
    assert subset.tolist() == [11, 5, 9, 2, 0]


def test_help():
    result = subprocess.run([sys.executable, "-m", "specdec_train", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "--quick" in result.stdout and "--time-budget-min" in result.stdout
