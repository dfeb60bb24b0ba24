"""deploy/docker/Dockerfile stays honest: every path it copies exists and passes .dockerignore, every command
it runs exists in the repository, pins agree with constraints.txt, and the checklist hadolint cannot see
(no image is built here: there is no container engine). hadolint itself runs in `make k8s-validate`."""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import shlex
import subprocess
import tomllib
from dataclasses import dataclass, field
from importlib.util import find_spec

import pytest

from shared.tls import add_client_arguments, client_from_arguments
from tests.deploy.manifests import OVERLAYS, REPO, SERVICES, container, deployment, render

DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
TARGETS = ("cpu", "gpu")


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def instructions() -> list[tuple[str, str]]:
    """(KEYWORD, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, args = line.partition(" ")
            out.append((keyword.upper(), args.strip()))
    return out


def parse() -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARG defaults and the stages by name."""
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for keyword, rest in instructions():
        if keyword == "FROM":
            base, _, name = rest.partition(" AS ")
            current = Stage(name.strip(), base.strip())
            stages[current.name] = current
        elif current is None and keyword == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
        elif current is not None:
            current.instructions.append((keyword, rest))
    return args, stages


def copy_sources(args: str) -> tuple[str | None, list[str]]:
    words = shlex.split(args)
    from_stage = next((w.split("=", 1)[1] for w in words if w.startswith("--from=")), None)
    paths = [w for w in words if not w.startswith("--")]
    return from_stage, paths[:-1]


def dockerignore_allows(path: str) -> bool:
    """.dockerignore semantics for our allow-list file: the last matching pattern wins."""
    allowed = True
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pattern) for p in prefixes) or fnmatch.fnmatch(path, pattern.removeprefix("**/")):
            allowed = negate
    return allowed


def test_targets_and_stage_references():
    _, stages = parse()
    assert set(TARGETS) <= set(stages)
    seen: list[str] = []
    for stage in stages.values():
        for copy in stage.all("COPY"):
            source_stage, _ = copy_sources(copy)
            assert source_stage is None or source_stage in seen, f"{stage.name}: --from={source_stage}"
        seen.append(stage.name)
    assert stages["source"].base == "scratch"


def test_every_copied_path_exists_and_enters_the_build_context():
    _, stages = parse()
    copied = []
    for stage in stages.values():
        for copy in stage.all("COPY"):
            source_stage, paths = copy_sources(copy)
            if source_stage is None:
                copied.extend(paths)
    assert copied
    for path in copied:
        assert (REPO / path).exists(), f"COPY {path}: not in the repository"
        assert dockerignore_allows(path), f"COPY {path}: excluded by .dockerignore"
    # What pip needs to build the package: pyproject's packages and its readme, all copied.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["readme"] in copied
    for package in ("shared", "verifier_service", "proposer_service", "gateway"):
        assert package in copied
    for excluded in (".venv", ".cache", ".git", "tests", "shared/x.gguf", "gateway/__pycache__"):
        assert not dockerignore_allows(excluded)


def test_bases_are_pinned_and_pins_agree_with_constraints():
    args, stages = parse()
    for name in ("PYTHON_IMAGE", "CUDA_DEVEL_IMAGE", "CUDA_BASE_IMAGE"):
        image = args[name]
        repo, _, tag = image.rpartition(":")
        assert repo and re.search(r"\d+\.\d+", tag) and "latest" not in tag, f"{name}={image} is not a pinned tag"
    for stage in stages.values():
        base = stage.base.strip("${}")
        assert base in args or base in stages or base == "scratch", f"FROM {stage.base}"
    text = DOCKERFILE.read_text()
    torch_pin = next(line for line in (REPO / "constraints.txt").read_text().splitlines() if line.startswith("torch=="))
    assert text.count(torch_pin) == 2  # both variants
    assert text.count("pip install -c constraints.txt") == 2
    # The gpu venv is copied between stages: its interpreter must exist at the same path in the runtime.
    assert "python3.12 -m venv" in " ".join(stages["gpu-build"].all("RUN"))
    assert "install -y --no-install-recommends python3.12 " in " ".join(stages["gpu"].all("RUN"))


@pytest.mark.parametrize("target", TARGETS)
def test_runtime_stage_checklist(target):
    """The runtime image: non-root numeric user (the manifests' runAsUser), console scripts on PATH, the
    health check through grpc.health.v1, writable paths only under the volumes the manifests mount."""
    _, stages = parse()
    stage = stages[target]
    (user,) = stage.all("USER")
    uid = int(user.split(":")[0])
    assert uid >= 10000
    for overlay in OVERLAYS:
        for component in SERVICES:
            pod = deployment(render(overlay), component)["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsUser"] == uid
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    (cmd,) = stage.all("CMD")
    (command,) = json.loads(cmd)  # the JSON array form
    assert command in scripts
    (healthcheck,) = stage.all("HEALTHCHECK")
    module = re.search(r"python -m ([\w.]+)", healthcheck).group(1)
    assert module == "gateway.health_probe" and find_spec(module) is not None
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(stage.all("ENV"))))
    assert env["PATH"].startswith("/opt/specdec/bin:")
    assert env["HOME"] == "/tmp" and env["SPECDEC_MODEL_DIR"] == "/models"
    assert env["SPECDEC_CACHE_DIR"].startswith("/cache/") and env["HF_HOME"].startswith("/cache/")
    mounts = {m["mountPath"] for m in container(deployment(render("cpu"), "verifier"))["volumeMounts"]}
    assert {"/tmp", "/cache", "/models"} <= mounts
    assert set(stage.all("EXPOSE")[0].split()) == {"50051", "50052", "50053"}


def test_hadolint_style_checklist():
    """What hadolint checks, restated for a machine without it (hadolint runs in make k8s-validate)."""
    keywords = [kw for kw, _ in instructions()]
    assert "ADD" not in keywords and "MAINTAINER" not in keywords
    for keyword, args in instructions():
        if keyword == "WORKDIR":
            assert args.startswith("/")
        if keyword == "RUN" and "apt-get install" in args:
            assert "--no-install-recommends" in args and "-y" in args
            assert "rm -rf /var/lib/apt/lists/*" in args and "apt-get update" in args
        for command in args.split("&&") if keyword == "RUN" else []:
            if "pip install" in command:
                words = shlex.split(command.split("pip install", 1)[1])
                # Options, their values (index URLs, constraints.txt) and the local project are not packages.
                packages = [w for w in words if not w.startswith(("-", "http", "$", "/src")) and w != "constraints.txt"]
                assert packages or "/src" in command
                assert all("==" in p for p in packages), f"unpinned pip install: {packages}"
        if keyword == "RUN":
            assert "sudo" not in args and "curl" not in args and "wget" not in args
        if keyword in ("CMD", "ENTRYPOINT"):
            assert args.startswith("[")


@pytest.mark.parametrize("target", TARGETS)
def test_healthcheck_checks_the_name_localhost_only_with_tls(target, tmp_path):
    """The HEALTHCHECK's shell line, run with a stand-in `python` that records its arguments: plaintext probes
    127.0.0.1 as it is; with a certificate the probe must check a name the certificate carries (localhost)."""
    _, stages = parse()
    (healthcheck,) = stages[target].all("HEALTHCHECK")
    shell, flag, script = json.loads(healthcheck.split(" CMD ", 1)[1])
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)

    def argv(**env: str) -> list[str]:
        out = subprocess.run(
            [shell, flag, script],
            env={"PATH": f"{tmp_path}:/usr/bin:/bin", **env},
            check=True,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        return out.splitlines()

    probe = ["-m", "gateway.health_probe"]
    assert argv() == [*probe, "127.0.0.1:50051"]
    assert argv(SPECDEC_PORT="50052") == [*probe, "127.0.0.1:50052"]
    tls = argv(SPECDEC_PORT="50053", SPECDEC_TLS_CERT_FILE="/etc/specdec/tls/tls.crt")
    assert tls == [*probe, "127.0.0.1:50053", "--tls-server-name=localhost"]
    # ...which the probe parses: the name reaches its TLS settings, the files come from SPECDEC_TLS_*.
    parser = argparse.ArgumentParser()
    add_client_arguments(parser)
    client = client_from_arguments(parser.parse_args(["--tls-ca-file=ca.crt", tls[-1]]))
    assert client is not None and client.server_name == "localhost"
