"""End-to-end fixtures: proposer, verifier and gateway as separate OS processes on loopback.

Each "stack" is a set of real service processes (the console scripts of the venv, or `python -c` on the
same entry points when they are missing) with the real default models, logs in files under pytest's
tmp folder, and free ports picked by binding port 0. Every stack the session will need is launched as
soon as the first one is asked for, and the target's greedy references are computed while the services
load (both take minutes on a busy machine). At the end of the session every process gets SIGTERM
(gateway, then verifier, then proposer) and must exit with status 0; one that does not stop within
STOP_TIMEOUT_S is killed and the teardown fails with the tail of its log.

Stacks:
    main      proposer (draft model) + verifier (k = 4 fixed, max_model_len 1024) + gateway
    fault     the same with --max-num-seqs 3 --max-waiting 1 (queue-full test); its proposer is SIGKILLed
              by the proposer-failure test, so the shared main stack is never disturbed
    orphan    a gateway whose only verifier address has nothing listening (UNAVAILABLE test)
    secure    main's services with TLS on every port, mutual TLS between them and an API key at the gateway
              (certificates and key made per run: pki.py)

Environment: SPECDEC_E2E_STARTUP_TIMEOUT (seconds to wait for a stack to be healthy, default 300).
SPECDEC_CACHE_DIR and the model location variables pass through unchanged; other SPECDEC_* variables
(service flags) are not passed on, so the flags given here are what the services run with.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.health_probe import check_once
from shared.proto_gen.specdec.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from shared.settings import default_draft_model, default_eagle_head, default_target_model
from shared.tls import ClientTLS, sync_channel
from tests.e2e.pki import PKI

HOST = "127.0.0.1"
K = 4
MAX_MODEL_LEN = 1024
STARTUP_TIMEOUT_S = float(os.environ.get("SPECDEC_E2E_STARTUP_TIMEOUT", "300"))
STOP_TIMEOUT_S = 60.0
LOG_TAIL_LINES = 40
GATEWAY_SERVICE = "specdec.v1.Gateway"
BIN = Path(sys.executable).parent
ENTRY_POINTS = {  # console script -> module with main()
    "specdec-proposer": "proposer_service.server",
    "specdec-verifier": "verifier_service.server",
    "specdec-gateway": "gateway.server",
}
# SPECDEC_* variables that say where models and caches are; every other SPECDEC_* variable is a service
# flag and is dropped so that it cannot change what the tests start.
PASS_THROUGH = {"SPECDEC_CACHE_DIR", "SPECDEC_MODEL_DIR", "SPECDEC_TARGET_MODEL", "SPECDEC_DRAFT_MODEL"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def service_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_") or k in PASS_THROUGH}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see tests/conftest.py: the cores are shared
    env["PYTHONUNBUFFERED"] = "1"
    return env


# The death signal is set by this wrapper, which then execs the service, rather than by a preexec_fn:
# a preexec_fn makes subprocess fork() (not vfork) and run gRPC's at-fork handlers in the child. With gRPC
# threads alive in pytest (the OTLP receiver, stats channels) the child's restarted poller then raced
# close_fds and aborted the service before exec ("epoll_wait error: Bad file descriptor", SIGABRT in CI).
# argv: expected parent pid, program, args. Exits at once if that parent is already gone.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys; ctypes.CDLL(None, use_errno=True).prctl(1, 15); "  # PR_SET_PDEATHSIG, SIGTERM
    "os.getppid() == int(sys.argv[1]) or sys.exit(1); os.execv(sys.argv[2], sys.argv[2:])"
)


def die_with_parent(argv: list[str]) -> list[str]:
    """argv wrapped so that the process gets SIGTERM when the pytest process dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


def command(script: str) -> list[str]:
    exe = BIN / script
    if exe.exists():
        return [str(exe)]
    module = ENTRY_POINTS[script]
    return [sys.executable, "-c", f"import sys; sys.argv[0] = {script!r}; from {module} import main; main()"]


@dataclass
class Service:
    name: str
    script: str
    args: list[str]
    log_path: Path
    port: int
    proc: subprocess.Popen | None = None
    expect_killed: bool = False  # a test SIGKILLs it on purpose
    terminated: bool = False  # SIGTERM sent
    _log: object = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self) -> None:
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            die_with_parent([*command(self.script), *self.args]),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=service_env(),
            cwd=Path(__file__).resolve().parents[2],
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as err:
            return f"(no log: {err})"
        # progress bars write \r; keep the last state of each line
        out = [line.rsplit("\r", 1)[-1] for line in text.splitlines()]
        return "\n".join(out[-lines:])

    def describe(self) -> str:
        state = "running" if self.alive() else f"exited with {self.proc.returncode if self.proc else '-'}"
        return (
            f"----- {self.name} ({self.address}, {state}; log {self.log_path}, last {LOG_TAIL_LINES} lines) -----\n"
            f"{self.tail()}"
        )

    def kill(self) -> None:
        """SIGKILL (a crash); the service is then expected to have died with -9."""
        assert self.proc is not None
        self.expect_killed = True
        self.proc.kill()
        self.proc.wait(timeout=30)

    def terminate(self) -> None:
        """Send SIGTERM once (stop() then waits for the exit). Once only, as an orchestrator does: a second
        one can land after the service's asyncio loop has closed and restored the default handler."""
        if self.alive() and not self.terminated:
            self.terminated = True
            self.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]

    def stop(self) -> str | None:
        """SIGTERM, wait; SIGKILL after STOP_TIMEOUT_S. Returns a problem description or None."""
        if self.proc is None:
            return None
        problem = None
        if self.proc.poll() is None or (self.terminated and not self.expect_killed):
            self.terminate()
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
                problem = f"{self.name} did not exit within {STOP_TIMEOUT_S:.0f} s of SIGTERM: killed"
            else:
                if self.proc.returncode != 0:
                    problem = f"{self.name} exited with status {self.proc.returncode} after SIGTERM (expected 0)"
        elif self.expect_killed:
            if self.proc.returncode != -signal.SIGKILL:
                problem = f"{self.name} was killed on purpose but exited with {self.proc.returncode}"
        else:
            problem = f"{self.name} had already exited with status {self.proc.returncode} before the teardown"
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]
        return problem


@dataclass
class Stack:
    """One set of processes. `gateway` always; `verifier` and `proposer` unless this is the orphan gateway."""

    name: str
    services: list[Service] = field(default_factory=list)  # start order: proposer, verifier, gateway
    proposer_expected: bool = True
    ready: bool = False
    # The secure stack: its files, the TLS of the stack's own health and stats calls (the cluster CA and a client
    # certificate from it, which the verifier requires) and the API key its gateway's GetStats needs.
    pki: PKI | None = None
    tls: ClientTLS | None = None
    api_key: str = ""
    http_port: int = field(default_factory=free_port)  # the gateway's OpenAI-compatible HTTP API

    def get(self, name: str) -> Service:
        for s in self.services:
            if s.name.endswith(name):
                return s
        raise KeyError(f"stack {self.name} has no {name}")

    @property
    def gateway(self) -> Service:
        return self.get("gateway")

    @property
    def verifier(self) -> Service:
        return self.get("verifier")

    @property
    def proposer(self) -> Service:
        return self.get("proposer")

    def logs(self) -> str:
        return "\n".join(s.describe() for s in self.services)

    def start(self) -> None:
        for s in self.services:
            s.start()

    def stop(self) -> list[str]:
        return [p for s in reversed(self.services) if (p := s.stop()) is not None]

    # -- readiness -------------------------------------------------------------------------------

    def fail(self, message: str) -> None:
        pytest.fail(f"e2e stack {self.name!r}: {message}\n{self.logs()}", pytrace=False)

    def _wait(self, what: str, predicate, deadline: float, watch: Sequence[Service]) -> None:
        last = ""
        while True:
            try:
                ok, last = predicate()
            except grpc.RpcError as err:
                ok, last = False, f"{err.code().name}: {err.details()}"  # type: ignore[attr-defined]
            if ok:
                return
            for s in watch:
                if not s.alive():
                    code = s.proc.returncode if s.proc is not None else None
                    self.fail(f"{s.name} exited (status {code}) while waiting for {what}")
            if time.monotonic() > deadline:
                self.fail(f"timed out after {STARTUP_TIMEOUT_S:.0f} s waiting for {what} (last state: {last})")
            time.sleep(0.5)

    def wait_ready(self) -> None:
        if self.ready:
            return
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        names = [s.name for s in self.services]
        for s in self.services:
            service = GATEWAY_SERVICE if s is self.gateway and len(names) > 1 else ""
            what = f"{s.name} SERVING {service or '(overall)'}"
            self._wait(what, lambda s=s, v=service: check_once(s.address, v, tls=self.tls), deadline, [s])
        if len(names) > 1:
            if self.proposer_expected:
                self._wait(
                    "the verifier to connect to its proposer",
                    lambda: (self.verifier_stats().stats.proposer_connected, "proposer_connected=false"),
                    deadline,
                    self.services,
                )
            # The gateway learns the context length and vocabulary from its first stats poll.
            self._wait("the gateway's first stats poll", self._gateway_polled, deadline, self.services)
        self.ready = True

    def _gateway_polled(self) -> tuple[bool, str]:
        stats = self.gateway_stats()
        ok = bool(stats.backends) and all(b.healthy and b.HasField("engine") for b in stats.backends)
        return ok, str(stats).replace("\n", " ")

    # -- stats (sync, short-lived channels) ------------------------------------------------------

    def verifier_stats(self, timeout: float = 10.0) -> verifier_pb2.VerifierGetStatsResponse:
        with sync_channel(self.verifier.address, self.tls) as channel:
            return verifier_pb2_grpc.VerifierStub(channel).GetStats(
                verifier_pb2.VerifierGetStatsRequest(), timeout=timeout
            )

    def gateway_stats(self, timeout: float = 10.0) -> gateway_pb2.GetStatsResponse:
        metadata = [("authorization", f"Bearer {self.api_key}")] if self.api_key else None
        with sync_channel(self.gateway.address, self.tls) as channel:
            return gateway_pb2_grpc.GatewayStub(channel).GetStats(
                gateway_pb2.GetStatsRequest(), timeout=timeout, metadata=metadata
            )


def build_stack(
    name: str,
    log_dir: Path,
    *,
    verifier_args: Sequence[str] = (),
    with_verifier: bool = True,
    proposer_kind: str = "draft-model",
    adaptive_k: bool = False,
    secure: bool = False,
) -> Stack:
    target, draft = default_target_model(), default_draft_model()
    drafter = (
        ["--model", draft]
        if proposer_kind == "draft-model"
        else ["--model", default_eagle_head(), "--target-model", target]
    )
    stack = Stack(name)
    if secure:
        stack.pki = PKI(log_dir / f"{name}-pki")
        stack.tls, stack.api_key = stack.pki.client(), stack.pki.api_key

    def tls_args(service: str) -> list[str]:
        return stack.pki.service_args(service) if stack.pki else []

    gateway_port = free_port()
    if with_verifier:
        proposer_port, verifier_port = free_port(), free_port()
        stack.services.append(
            Service(
                f"{name}-proposer",
                "specdec-proposer",
                [
                    "--kind",
                    proposer_kind,
                    *drafter,
                    "--host",
                    HOST,
                    "--port",
                    str(proposer_port),
                    "--max-model-len",
                    str(MAX_MODEL_LEN),
                    *tls_args("proposer"),
                ],
                log_dir / f"{name}-proposer.log",
                proposer_port,
            )
        )
        stack.services.append(
            Service(
                f"{name}-verifier",
                "specdec-verifier",
                [
                    "--model",
                    target,
                    "--proposer",
                    f"{HOST}:{proposer_port}",
                    "--num-speculative-tokens",
                    str(K),
                    "--adaptive-k" if adaptive_k else "--no-adaptive-k",
                    "--max-model-len",
                    str(MAX_MODEL_LEN),
                    "--host",
                    HOST,
                    "--port",
                    str(verifier_port),
                    *verifier_args,
                    *tls_args("verifier"),
                ],
                log_dir / f"{name}-verifier.log",
                verifier_port,
            )
        )
        verifiers = f"{HOST}:{verifier_port}"
    else:
        verifiers = f"{HOST}:{free_port()}"  # nothing listens there
        stack.proposer_expected = False
    stack.services.append(
        Service(
            f"{name}-gateway",
            "specdec-gateway",
            [
                "--verifiers",
                verifiers,
                "--tokenizer",
                target,
                "--host",
                HOST,
                "--port",
                str(gateway_port),
                "--http-port",
                str(stack.http_port),
                "--health-check-timeout-s",
                "5",
                "--expose-backends",  # the stack waits for healthy verifiers in GetStats
                "--enable-reflection",  # grpcurl without proto files (test_grpcurl.py)
                *tls_args("gateway"),
                *(["--api-keys-file", str(stack.pki.api_keys_file)] if stack.pki else []),
            ],
            log_dir / f"{name}-gateway.log",
            gateway_port,
        )
    )
    return stack


STACK_FIXTURES: dict[str, dict[str, Any]] = {
    "e2e_stack": dict(name="main"),
    "fault_stack": dict(name="fault", verifier_args=["--max-num-seqs", "3", "--max-waiting", "1"]),
    "orphan_gateway": dict(name="orphan", with_verifier=False),
    # The repository's EAGLE head, adaptive k (the default), and a verifier KV cache far too small for 8
    # sequences at once: a 256-token context limit and 20 blocks of 16 (320 tokens, just above one
    # full-length sequence), while the 8 prompts + 128 tokens need about 80 blocks (prefix caching shares the
    # chat template's blocks and some answers end early, which is why 66 blocks at 1,024 never preempted).
    # Greedy streams run through preemption by recompute.
    "eagle_stack": dict(
        name="eagle",
        proposer_kind="eagle",
        adaptive_k=True,
        verifier_args=["--max-model-len", "256", "--num-kv-blocks", "20"],
    ),
    "secure_stack": dict(name="secure", secure=True),
}


class Launcher:
    def __init__(self, log_dir: Path, needed: set[str]) -> None:
        self.log_dir = log_dir
        self.needed = needed
        self.stacks: dict[str, Stack] = {}

    def launch(self, fixture: str) -> Stack:
        if fixture not in self.stacks:
            stack = build_stack(log_dir=self.log_dir, **STACK_FIXTURES[fixture])
            stack.start()
            self.stacks[fixture] = stack
        return self.stacks[fixture]

    def launch_needed(self) -> None:
        for fixture in STACK_FIXTURES:
            if fixture in self.needed:
                self.launch(fixture)

    def stop_all(self) -> list[str]:
        """Gateways first, then verifiers, then proposers (each tier's processes stop in parallel)."""
        problems = []
        for tier in ("gateway", "verifier", "proposer"):
            services = [(st, s) for st in self.stacks.values() for s in st.services if s.name.endswith(tier)]
            for _, s in services:
                s.terminate()
            for stack, s in services:
                if (p := s.stop()) is not None:
                    problems.append(f"{p}\n{stack.logs()}")
        return problems


@pytest.fixture(scope="session")
def _launcher(request, tmp_path_factory) -> Iterator[Launcher]:
    needed = {
        name for item in request.session.items for name in getattr(item, "fixturenames", ()) if name in STACK_FIXTURES
    }
    launcher = Launcher(tmp_path_factory.mktemp("e2e-logs"), needed)
    launcher.launch_needed()  # every stack this session uses starts loading now, in parallel
    yield launcher
    problems = launcher.stop_all()
    assert not problems, "services did not shut down cleanly:\n" + "\n".join(problems)


def _stack(request, launcher: Launcher, fixture: str) -> Stack:
    stack = launcher.launch(fixture)
    # The target's greedy references (tests/real_models.py) take minutes: compute them while the services load.
    request.getfixturevalue("greedy_references")
    stack.wait_ready()
    return stack


@pytest.fixture(scope="session")
def e2e_stack(request, _launcher) -> Stack:
    return _stack(request, _launcher, "e2e_stack")


@pytest.fixture(scope="session")
def fault_stack(request, _launcher) -> Stack:
    return _stack(request, _launcher, "fault_stack")


@pytest.fixture(scope="session")
def orphan_gateway(request, _launcher) -> Stack:
    return _stack(request, _launcher, "orphan_gateway")


@pytest.fixture(scope="session")
def eagle_stack(request, _launcher) -> Stack:
    return _stack(request, _launcher, "eagle_stack")


@pytest.fixture(scope="session")
def secure_stack(request, _launcher) -> Stack:
    return _stack(request, _launcher, "secure_stack")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing e2e test shows the tail of every service log of the stacks it used."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.when == "call":
        for value in getattr(item, "funcargs", {}).values():
            if isinstance(value, Stack):
                report.sections.append((f"service logs of stack {value.name!r}", value.logs()))
