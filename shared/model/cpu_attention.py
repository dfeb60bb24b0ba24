"""The `cpu` attention backend: paged_kernel.cpp, built once per machine with the system's C++ compiler and called
through ctypes. It reads K and V in place through the block tables and computes every query from its own keys
alone (see the kernel's header), so one call serves a whole step: prefill chunks, decode rows, k + 1 scoring rows
and token-tree nodes, with no padding, no gathered copy of the context and no split into calls.

Built with `-march=native` into SPECDEC_KERNEL_CACHE (default ~/.cache/specdec/kernels), under a name that hashes
the source, the flags, the compiler and the CPU's feature flags, so a container image shared by machines never
loads a build for another CPU. Without a compiler, or when the build fails, `auto` keeps the torch backend."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("specdec.attention")

SOURCE = Path(__file__).with_name("paged_kernel.cpp")
# -ffp-contract=off: the compiler may not fuse a multiply and an add in one place and not in another (the kernel
# fuses explicitly where the CPU can), so every query's arithmetic is the same wherever it is inlined.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
X86_FLAGS = ("-mprefer-vector-width=512",)  # GCC's auto-vectorised loops (exp, softmax) otherwise stop at 256 bits
DTYPES = {torch.float32: "specdec_paged_attention_f32", torch.bfloat16: "specdec_paged_attention_bf16"}
HEAD_SIZES = (16, 32, 64, 96, 128, 256)  # the kernel's builds (each a template instance: compile time)


def compiler() -> str | None:
    """The system's C++ compiler (`$CXX`, else g++, c++ or clang++), as torch.compile's CPU backend finds one."""
    return next((c for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c and shutil.which(c)), None)


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_KERNEL_CACHE") or Path.home() / ".cache" / "specdec" / "kernels")


def _cpu_features() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), platform.processor())


@functools.cache
def load_kernel(source: Path = SOURCE) -> ctypes.CDLL | None:
    """The built kernel, building it on first use; None (logged) where it cannot be built or loaded. `source`:
    another version of paged_kernel.cpp, for specdec_bench.kernel_bench's A/B of two builds."""
    cxx = compiler()
    if cxx is None:
        log.info("no C++ compiler: the cpu attention kernel is not built")
        return None
    flags = FLAGS + (X86_FLAGS if platform.machine() in ("x86_64", "AMD64") else ())
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256(
            b"\0".join(s.encode() for s in (source.read_text(), " ".join(flags), cxx, version, _cpu_features()))
        ).hexdigest()[:16]
        path = cache_dir() / f"paged_kernel-{key}.so"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # then one rename: racing builds are harmless
                built = Path(tmp) / path.name
                subprocess.run(
                    [cxx, *flags, "-o", str(built), str(source)], check=True, capture_output=True, timeout=300
                )
                os.replace(built, path)
            log.info("built the cpu attention kernel: %s", path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("the cpu attention kernel could not be built (%s) %s", e, detail.decode(errors="replace")[-2000:])
        return None
    pointer, integer = ctypes.c_void_p, ctypes.c_int64
    for name in DTYPES.values():
        getattr(lib, name).argtypes = [pointer] * 10 + [integer] * 5 + [ctypes.c_float, ctypes.c_int]
        getattr(lib, name).restype = None
    return lib


def supports(dtype: torch.dtype | None, head_dim: int | None) -> bool:
    return dtype in DTYPES and head_dim in HEAD_SIZES


class CpuPagedAttention:
    """The whole step's attention in one kernel call (paged_attention does not split it into groups)."""

    name = "cpu"
    whole_step = True

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._functions = {dtype: getattr(lib, name) for dtype, name in DTYPES.items()}

    def __call__(self, q, k_cache, v_cache, meta: Any, scale: float) -> torch.Tensor:
        # meta: an attention.AttentionMetadata (not imported: attention imports this module, not the reverse)
        rows = meta.rows_for_kernel()  # built with the metadata where build_metadata(kernel=True)
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        q = q.contiguous()  # [T, H, D]
        out = torch.empty_like(q)
        _, block_size, kv_heads, head_dim = k_cache.shape
        self._functions[q.dtype](
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
            rows.block_tables.data_ptr(), rows.block_tables.shape[1], rows.seq_start.data_ptr(),
            rows.row_keys.data_ptr(), rows.extra_start.data_ptr(), rows.extra_keys.data_ptr(),
            rows.num_seqs, q.shape[1], kv_heads, head_dim, block_size, scale, torch.get_num_threads(),
        )  # fmt: skip
        return out


def main() -> None:
    """`python -m shared.model.cpu_attention` (make setup): build the kernel now rather than at a service's start."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    lib = load_kernel()
    print(f"cpu attention kernel: {lib._name if lib is not None else 'not built; auto runs the torch backend'}")


if __name__ == "__main__":
    main()
