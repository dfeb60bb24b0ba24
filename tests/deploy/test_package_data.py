"""An installed (not editable) package carries the C++ kernels' sources and headers: shared/model/native.py builds
them on the machine that runs them, and without a source the kernel silently stays unbuilt (torch's ops instead).
A wheel built from a clean tree held no .cpp at all before pyproject declared them."""

from __future__ import annotations

import fnmatch
import tomllib

from tests.deploy.manifests import REPO


def test_every_kernel_source_and_header_is_package_data():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = declared.get("shared.model", [])
    model = REPO / "shared" / "model"
    sources = sorted(p.name for suffix in ("*.cpp", "*.h") for p in model.glob(suffix))
    assert sources, "no kernel sources found"
    missing = [name for name in sources if not any(fnmatch.fnmatch(name, pattern) for pattern in patterns)]
    assert not missing, f"not installed with the package: {missing}"
