"""The service boundary (docs/architecture.md: the services meet only over gRPC) and the grpc-free service cores
are enforced by import-linter: the repository keeps the contracts of pyproject.toml, and each contract does
break when an import crosses its boundary."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "shared",
    "verifier_service",
    "proposer_service",
    "gateway",
    "specdec_local",
    "specdec_bench",
    "specdec_train",
)
SERVICES_CONTRACT = "verifier_service, proposer_service and gateway never import each other"
SHARED_CONTRACT = "shared imports no service, no composition root, no benchmark"
CORES_CONTRACT = "the gateway core and the verifier engine import no grpc"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """lint-imports on the packages under `root`, with `root` first on the import path (ahead of any editable
    install of another checkout). --no-cache: nothing written into the tree."""
    exe = Path(sys.executable).parent / "lint-imports"
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "importlinter.cli"]
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [*command, "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def copy_of_repository(dest: Path) -> Path:
    """The root packages' *.py files and pyproject.toml (the contracts), nothing else."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, dest / package, ignore=_all_but_python)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _all_but_python(folder: str, names: list[str]) -> list[str]:
    def keep(name: str) -> bool:
        return name.endswith(".py") or ((Path(folder) / name).is_dir() and name != "__pycache__")

    return [name for name in names if not keep(name)]


def test_the_repository_keeps_the_import_contracts() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{SERVICES_CONTRACT} KEPT" in result.stdout
    assert f"{SHARED_CONTRACT} KEPT" in result.stdout
    assert f"{CORES_CONTRACT} KEPT" in result.stdout


@pytest.mark.parametrize(
    ("module", "injected", "broken", "kept"),
    [
        ("verifier_service/engine.py", "import proposer_service.ngram", SERVICES_CONTRACT, SHARED_CONTRACT),
        # The services also break here: every service imports shared.sampling, so each reaches verifier_service.
        ("shared/sampling.py", "import verifier_service", SHARED_CONTRACT, None),
        ("gateway/core.py", "import grpc", CORES_CONTRACT, SERVICES_CONTRACT),
        ("verifier_service/engine.py", "import grpc", CORES_CONTRACT, SHARED_CONTRACT),
    ],
    ids=["verifier-imports-proposer", "shared-imports-verifier", "gateway-core-imports-grpc", "engine-imports-grpc"],
)
def test_a_crossing_import_breaks_its_contract(tmp_path, module, injected, broken, kept) -> None:
    repo = copy_of_repository(tmp_path)
    path = repo / module
    path.write_text(path.read_text() + f"\n{injected}  # crosses the boundary\n")
    result = lint_imports(repo)
    assert result.returncode != 0, result.stdout
    assert f"{broken} BROKEN" in result.stdout, result.stdout + result.stderr
    if kept is not None:
        assert f"{kept} KEPT" in result.stdout
    assert injected.removeprefix("import ") in result.stdout  # the report names the offending import
