"""Real default models, loaded once per test session, and transformers' greedy reference outputs.

Imported by tests/conftest.py so service, integration and end-to-end tests share one set of references.
transformers' greedy decoding of the 135M target at batch 1 is bound by memory bandwidth (about 95 ms a token
here, one thread as fast as two): the 20 references take about 4 minutes. When a session needs them,
tests/conftest.py starts `python -m tests.real_models` in the background as soon as the tests are collected, and
the fixture waits for its file; the unit tests, which need none, run meanwhile."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from shared.model.loader import load_hf_model, load_model, load_tokenizer
from shared.settings import default_draft_model, default_target_model
from tests.prompts import encode_prompts

MAX_NEW_TOKENS = 128
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(default_target_model())


@pytest.fixture(scope="session")
def target():
    return load_model(default_target_model())


@pytest.fixture(scope="session")
def draft():
    return load_model(default_draft_model())


@pytest.fixture(scope="session")
def hf_target():
    """transformers' own model of the target: the reference for greedy outputs and logprobs."""
    return load_hf_model(default_target_model())


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    return encode_prompts(tokenizer)


@pytest.fixture(scope="session")
def greedy_references(prompts) -> list[list[int]]:
    """transformers' greedy `generate` of the target alone, one prompt at a time (no padding)."""
    if _background is None:
        return compute_references(prompts)
    made = _background.result()
    assert made["prompts"] == prompts, "the background references were made from other prompts"
    return made["references"]


def compute_references(prompts: list[list[int]]) -> list[list[int]]:
    hf = load_hf_model(default_target_model())
    refs = []
    for ids in prompts:
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        refs.append(out[0, len(ids) :].tolist())
    del hf
    return refs


class _Background:
    """The references being made by a second process, which writes them with the prompts they were made from."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="specdec-references-"))
        self.out, self.log = self.folder / "references.json", self.folder / "references.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.real_models", str(self.out)], cwd=REPO, env=env, stdout=log, stderr=log
            )

    def result(self) -> dict:
        if self.process.wait() != 0:
            raise RuntimeError(f"making the greedy references failed:\n{self.log.read_text()[-4000:]}")
        return json.loads(self.out.read_text())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


_background: _Background | None = None


def start_references_in_background() -> None:
    global _background
    if _background is None:
        _background = _Background()


def stop_background() -> None:
    if _background is not None:
        _background.stop()


if __name__ == "__main__":
    torch.set_num_threads(1)
    prompts = encode_prompts(load_tokenizer(default_target_model()))
    made = {"prompts": prompts, "references": compute_references(prompts)}
    Path(sys.argv[1]).write_text(json.dumps(made))
