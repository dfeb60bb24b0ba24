"""Where the default models are: `SPECDEC_MODEL_DIR` (default: the `shared/models` folder beside the
repository), overridden per model by `SPECDEC_TARGET_MODEL` / `SPECDEC_DRAFT_MODEL`, which take any HF
folder, .gguf folder or hub id. Without a model folder the hub ids below are used."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TARGET_DIRNAME = "smollm2-135m-instruct-q4_1"
DEFAULT_DRAFT_DIRNAME = "smollm2-135m-draft-4l"
# A real pair sharing SmolLM2's tokenizer, for machines that reach the hub.
HUB_TARGET = "HuggingFaceTB/SmolLM2-360M-Instruct"
HUB_DRAFT = "HuggingFaceTB/SmolLM2-135M-Instruct"


DEFAULT_EAGLE_HEAD = REPO_ROOT / "models" / "smollm2-135m-eagle"  # made by `make train-draft`, committed


def default_eagle_head() -> str:
    return os.environ.get("SPECDEC_EAGLE_HEAD") or str(DEFAULT_EAGLE_HEAD)


def model_dir() -> Path:
    return Path(os.environ.get("SPECDEC_MODEL_DIR", REPO_ROOT.parent / "shared" / "models"))


def default_target_model() -> str:
    return os.environ.get("SPECDEC_TARGET_MODEL") or _local_or_hub(DEFAULT_TARGET_DIRNAME, HUB_TARGET)


def default_draft_model() -> str:
    return os.environ.get("SPECDEC_DRAFT_MODEL") or _local_or_hub(DEFAULT_DRAFT_DIRNAME, HUB_DRAFT)


def _local_or_hub(dirname: str, hub_id: str) -> str:
    local = model_dir() / dirname
    return str(local) if local.is_dir() else hub_id
