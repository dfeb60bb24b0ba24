"""Facts about a model or device that both services look up the same way (no weights read)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from shared.model.loader import ModelSource


def tokenizer_fingerprint(name_or_path: str) -> str:
    """sha256 of the token -> id mapping of a local model folder's tokenizer.json; "" when there is none.

    Only local files are read (never the hub, never a GGUF parse): an unknown fingerprint is not checked.
    """
    try:
        folder = Path(ModelSource.resolve(name_or_path).name_or_path)
    except (FileNotFoundError, OSError):
        return ""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return ""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        vocab = dict(data.get("model", {}).get("vocab") or {})
        for token in data.get("added_tokens") or []:
            vocab[token["content"]] = token["id"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ""
    if not vocab or not isinstance(vocab, dict):
        return ""
    payload = json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()
    return hashlib.sha256(payload).hexdigest()[:32]


def resolve_device(device: str) -> str:
    """ "auto": cuda when there is one, else cpu; anything else as given."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
