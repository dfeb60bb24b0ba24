"""The services' OpenMP spin count (shared/omp_defaults.py): set before torch loads, a user's choice kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shared import omp_defaults


@pytest.mark.parametrize("package", ["verifier_service", "proposer_service"])
def test_a_service_package_sets_the_spin_count_before_torch_loads(package):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    probe = f"import sys, os; import {package}; print('torch' in sys.modules, os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", str(omp_defaults.SPIN_COUNT)]


@pytest.mark.parametrize(
    ("given", "expected"),
    [({}, str(omp_defaults.SPIN_COUNT)), ({"OMP_WAIT_POLICY": "PASSIVE"}, None), ({"GOMP_SPINCOUNT": "7"}, "7")],
)
def test_a_users_wait_policy_or_spin_count_is_kept(monkeypatch, given, expected):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    omp_defaults.apply()
    assert os.environ.get("GOMP_SPINCOUNT") == expected
