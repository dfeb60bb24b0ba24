"""Load Llama-family weights from an HF folder, a hub id, or a folder holding a .gguf file.

transformers reads every format (sharded safetensors, .bin, GGUF with de-quantisation), so it is the one
reader; we then copy its tensors into our own module. Parsing a GGUF file costs 15-20 s (its tokenizer is
rebuilt too), so the de-quantised tensors are kept as safetensors in a cache keyed by the file's identity.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.model.config import ModelArch
from shared.model.llama import LlamaModel
from shared.model.parallel import SINGLE, TensorParallel
from shared.model.rope import RotaryEmbedding

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a local folder or hub id, and the .gguf file in it if that is the format."""

    name_or_path: str
    gguf_file: str | None = None

    @classmethod
    def resolve(cls, name_or_path: str) -> ModelSource:
        path = Path(name_or_path).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            return cls(str(path.parent), path.name)
        if path.is_dir():
            has_hf_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
            ggufs = sorted(path.glob("*.gguf"))
            if not has_hf_weights and ggufs:
                return cls(str(path), ggufs[0].name)
            return cls(str(path))
        if name_or_path.startswith((".", "/", "~")):
            raise FileNotFoundError(f"model path {name_or_path!r} does not exist")
        return cls(name_or_path)  # a hub id

    @property
    def hf_kwargs(self) -> dict[str, Any]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE_DIR", Path.home() / ".cache" / "specdec"))


def load_hf_config(source: ModelSource) -> Any:
    from transformers import AutoConfig

    folder = Path(source.name_or_path)
    # A folder with its own config.json is read from that (fast); otherwise the GGUF metadata is parsed.
    if source.gguf_file and (folder / "config.json").is_file():
        return AutoConfig.from_pretrained(source.name_or_path)
    return AutoConfig.from_pretrained(source.name_or_path, **source.hf_kwargs)


def load_tokenizer(name_or_path: str) -> Any:
    from transformers import AutoTokenizer

    source = ModelSource.resolve(name_or_path)
    folder = Path(source.name_or_path)
    if source.gguf_file and not (folder / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(source.name_or_path, gguf_file=source.gguf_file)
    return AutoTokenizer.from_pretrained(source.name_or_path)


def load_hf_model(name_or_path: str, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' own model: the reference our runner is tested against, and the weight reader."""
    from transformers import AutoModelForCausalLM

    source = ModelSource.resolve(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(source.name_or_path, dtype=dtype, **source.hf_kwargs)
    return model.eval()


def load_state_dict(source: ModelSource) -> dict[str, torch.Tensor]:
    if not source.gguf_file:
        return load_hf_model(source.name_or_path).state_dict()
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    cached = _gguf_cache_path(source)
    if cached.is_file():
        return load_file(str(cached))
    # Services started together on a cold cache (a pod's verifier and EAGLE proposer, the tests' stacks) would
    # each spend 15-20 s of CPU de-quantising the same file: the first converts, the others wait and read it.
    with _exclusive(cached.with_suffix(".lock")):
        if cached.is_file():
            return load_file(str(cached))
        gguf = Path(source.name_or_path) / str(source.gguf_file)
        state = {k: v.contiguous() for k, v in load_hf_model(str(gguf)).state_dict().items() if k != "lm_head.weight"}
        try:
            tmp = cached.with_suffix(f".tmp{os.getpid()}")
            save_file(state, str(tmp))
            tmp.replace(cached)  # atomic, so a reader without the lock never sees a half-written file
        except (OSError, SafetensorError) as err:  # a read-only cache only costs time (safetensors' own I/O error)
            log.warning("could not cache de-quantised GGUF weights at %s: %s", cached, err)
    return state


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An advisory lock across processes (flock: released by the kernel if its holder dies); none where the cache
    folder cannot be written, where every loader converts on its own as before."""
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:
        fd = None
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # closing releases the lock


def _gguf_cache_path(source: ModelSource) -> Path:
    gguf = Path(source.name_or_path) / str(source.gguf_file)
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / f"{gguf.stem}-{key}.safetensors"


def load_embeddings(name_or_path: str) -> tuple[torch.Tensor, torch.Tensor, ModelArch]:
    """The target's embedding and LM head [vocab, hidden] (the same tensor when tied), reading only those
    tensors from safetensors files (a GGUF target's de-quantised cache is made first if missing)."""
    from safetensors import safe_open

    source = ModelSource.resolve(name_or_path)
    arch = ModelArch.from_hf_config(load_hf_config(source))
    names = ["model.embed_tokens.weight"] + ([] if arch.tie_word_embeddings else ["lm_head.weight"])
    if source.gguf_file:
        if not _gguf_cache_path(source).is_file():
            load_state_dict(source)
        files = [_gguf_cache_path(source)]
    else:
        files = sorted(Path(source.name_or_path).glob("*.safetensors"))
    found: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in set(names) & set(f.keys()):
                found[name] = f.get_tensor(name).float()
    if len(found) < len(names):  # no local safetensors (hub id, .bin checkpoint): read the whole state
        state = load_state_dict(source)
        found = {name: state[name].float() for name in names}
    embed = found["model.embed_tokens.weight"]
    return embed, found.get("lm_head.weight", embed), arch


def build_model(
    arch: ModelArch,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    tp: TensorParallel = SINGLE,
    pack: bool = True,
) -> LlamaModel:
    """`pack`: linear weights in oneDNN's layout (`LlamaModel.pack_weights`); off only to measure the gain."""
    with torch.device("meta"):
        model = LlamaModel(arch, tp)
    model = model.to_empty(device=device).to(dtype)
    # Buffers made on the meta device hold no values; the RoPE table is rebuilt where the model lives.
    model.rotary = RotaryEmbedding(arch.rope_parameters, arch.head_dim, arch.max_position_embeddings).to(device)
    model.load_hf_state_dict(state)
    if pack:
        model.pack_weights()
    return model.eval()


def load_model(
    name_or_path: str, dtype: torch.dtype = torch.float32, device: str = "cpu", tp: TensorParallel = SINGLE
) -> tuple[LlamaModel, ModelArch]:
    source = ModelSource.resolve(name_or_path)
    arch = ModelArch.from_hf_config(load_hf_config(source))
    model = build_model(arch, load_state_dict(source), dtype, device, tp)
    log.info("loaded %s: %d layers, vocab %d", name_or_path, arch.num_layers, arch.vocab_size)
    return model, arch


def check_same_vocabulary(target: ModelArch, draft: ModelArch, target_name: str, draft_name: str) -> None:
    """Draft token ids are used as target token ids, so the vocabularies must be the same."""
    if target.vocab_size != draft.vocab_size:
        raise ValueError(
            f"draft model {draft_name!r} has vocabulary size {draft.vocab_size} but target {target_name!r} has "
            f"{target.vocab_size}: speculative decoding needs a draft that shares the target's tokenizer"
        )
