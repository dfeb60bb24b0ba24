"""The trainer's whole pipeline on a tiny random target (`--quick`): data, subset, training, card, resume."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import torch
from safetensors import safe_open

from specdec_train.__main__ import main
from specdec_train.report import frequency_subset
from specdec_train.train import TrainConfig, make_batches


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


def test_batches_score_only_positions_that_draft_generated_tokens():
    """Position j drafts token j + 2: with a 5-token prompt the first scored position is 4, and a window that
    lies wholly inside a long prompt is left out; score_prompt=True scores every position with a target."""

    def sample(n_tokens: int, prompt_len: int) -> dict:
        return {
            "tokens": torch.arange(n_tokens, dtype=torch.int32),
            "features": torch.randn(n_tokens - 1, 4).half(),
            "prompt_len": prompt_len,
        }

    config = TrainConfig(batch_size=1, max_len=8)
    (batch,) = make_batches([sample(9, 5)], config, random.Random(0))  # 8 positions: one window
    assert batch.valid[0].tolist() == [False] * 4 + [True] * 3 + [False]
    both = make_batches([sample(17, 12)], config, random.Random(0))  # windows [0, 8) and [8, 16)
    assert [b.valid[0].tolist() for b in both] == [[False] * 3 + [True] * 4 + [False]]  # the second only
    (every,) = make_batches([sample(9, 5)], TrainConfig(batch_size=1, max_len=8, score_prompt=True), random.Random(0))
    assert every.valid[0].tolist() == [True] * 7 + [False]
