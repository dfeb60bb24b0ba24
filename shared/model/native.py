"""The C++ kernels (paged_kernel.cpp for the cpu attention backend, tile_kernel.cpp for bf16 and fp32 products,
small_ops_kernel.cpp for the eager forward's RMSNorm, rotary, K/V writes, residual adds and SiLU), built once per
machine with the system's C++ compiler and loaded through ctypes.

Built with `-march=native` into SPECDEC_KERNEL_CACHE (default ~/.cache/specdec/kernels), under a name that hashes
the source, the flags, the compiler and the CPU's feature flags, so a container image shared by machines never
loads a build for another CPU. Without a compiler, or when the build fails, the callers keep torch's kernels."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from shared.model.cpuinfo import cpuinfo_field

log = logging.getLogger("specdec.native")

# -ffp-contract=off: the compiler may not fuse a multiply and an add in one place and not in another (the kernels
# fuse explicitly where the CPU can), so a row's arithmetic is the same wherever it is inlined.
FLAGS = ("-std=c++17", "-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")  # if constexpr
X86_FLAGS = ("-mprefer-vector-width=512",)  # GCC's auto-vectorised loops (exp, softmax) otherwise stop at 256 bits
# The headers the kernels share (bf16.h, exp.h): on the include path, and hashed into every build's name.
HEADERS = Path(__file__).parent


def compiler() -> str | None:
    """The system's C++ compiler (`$CXX`, else g++, c++ or clang++), as torch.compile's CPU backend finds one."""
    return next((c for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c and shutil.which(c)), None)


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_KERNEL_CACHE") or Path.home() / ".cache" / "specdec" / "kernels")


def _cpu_features() -> str:
    """The CPU's feature flags (x86 `flags`, ARM `Features`), else the processor's name."""
    return cpuinfo_field("flags") or cpuinfo_field("Features") or platform.processor()


# A C function's (argument types, result type), as ctypes declares it
Signature = tuple[Sequence[type], type | None]


def build(source: Path, what: str, signatures: dict[str, Signature] | None = None) -> ctypes.CDLL | None:
    """`source` built (once: later calls find the library in the cache) and loaded, its functions declared as
    `signatures` says; None, logged, where it cannot be built or loaded. `what` names the kernel in the log."""
    cxx = compiler()
    if cxx is None:
        log.info("no C++ compiler: the %s is not built", what)
        return None
    flags = FLAGS + (X86_FLAGS if platform.machine() in ("x86_64", "AMD64") else ())
    headers = [h.read_text() for h in sorted(HEADERS.glob("*.h"))]
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
        parts = (source.read_text(), *headers, " ".join(flags), cxx, version, _cpu_features())
        key = hashlib.sha256(b"\0".join(s.encode() for s in parts)).hexdigest()[:16]
        path = cache_dir() / f"{source.stem}-{key}.so"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # then one rename: racing builds are harmless
                built = Path(tmp) / path.name
                subprocess.run(
                    [cxx, *flags, f"-I{HEADERS}", "-o", str(built), str(source)],
                    check=True,
                    capture_output=True,
                    timeout=300,
                )
                os.replace(built, path)
            log.info("built the %s: %s", what, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("the %s could not be built (%s) %s", what, e, detail.decode(errors="replace")[-2000:])
        return None
    for name, (argtypes, restype) in (signatures or {}).items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib
