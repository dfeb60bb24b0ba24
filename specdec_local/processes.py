"""Proposer, verifier(s) and gateway as separate OS processes on loopback: the e2e tests' stacks and the soak.

Each `Stack` is a set of real service processes (the console scripts of the venv, or `python -c` on the same
entry points when they are missing) with the real default models, logs in files, and free ports picked by
binding port 0. `Service.kill` is a crash (SIGKILL); `Service.restart` starts the same command on the same
port again (a supervisor restarting it). `Service.stop` is SIGTERM then a wait: a service must exit with
status 0 within STOP_TIMEOUT_S.

Environment: SPECDEC_E2E_STARTUP_TIMEOUT (seconds to wait for a stack to be healthy, default 300).
SPECDEC_CACHE_DIR and the model location variables pass through unchanged; other SPECDEC_* variables
(service flags) are not passed on, so the flags given here are what the services run with.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

import grpc

from gateway.health_probe import check_once
from shared.proto_gen.specdec.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from shared.settings import default_draft_model, default_eagle_head, default_target_model
from shared.tls import ClientTLS, sync_channel

HOST = "127.0.0.1"
K = 4
MAX_MODEL_LEN = 1024
STARTUP_TIMEOUT_S = float(os.environ.get("SPECDEC_E2E_STARTUP_TIMEOUT", "300"))
STOP_TIMEOUT_S = 60.0
LOG_TAIL_LINES = 40
GATEWAY_SERVICE = "specdec.v1.Gateway"
BIN = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = {  # console script -> module with main()
    "specdec-proposer": "proposer_service.server",
    "specdec-verifier": "verifier_service.server",
    "specdec-gateway": "gateway.server",
}
# SPECDEC_* variables that say where models and caches are, and the log level (DEBUG: the speculation policy's
# reasons, step by step, in the service logs a failing test prints); every other SPECDEC_* variable is a service
# flag and is dropped so that it cannot change what the stack starts.
PASS_THROUGH = {
    "SPECDEC_CACHE_DIR",
    "SPECDEC_MODEL_DIR",
    "SPECDEC_TARGET_MODEL",
    "SPECDEC_DRAFT_MODEL",
    "SPECDEC_LOG_LEVEL",
}
_PAGE = os.sysconf("SC_PAGE_SIZE")


class StackError(RuntimeError):
    """A stack did not come up (a service exited, or it was not healthy in time); the message has the logs."""


class StackPKI(Protocol):
    """Certificates and an API key for a TLS stack (tests/e2e/pki.py)."""

    api_key: str
    api_keys_file: Path

    def service_args(self, service: str) -> list[str]: ...

    def client(self) -> ClientTLS: ...


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LISTEN_SPAN = 8192  # the ports below the ephemeral range that services are given
_handed_out: set[int] = set()


def free_port() -> int:
    """A free port for a service started later, below the kernel's ephemeral range: a port the kernel picked
    (bind to 0) could meanwhile become the local port of an outgoing connection of a service already running (a
    client, a health check), and the later service fails to bind it (`gateway_bench` lost a whole run to this,
    2026-12-06: "Failed to bind to address 127.0.0.1:49717"). Never the same port twice in a process."""
    low = _ephemeral_low()
    for _ in range(1000):
        port = random.randint(max(1024, low - LISTEN_SPAN), low - 1) if low > 1024 + 64 else 0
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            port = s.getsockname()[1]
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port below {low}")


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for outgoing connections (Linux's default 32768); 0 if unknown, and
    then any port the kernel gives."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def service_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_") or k in PASS_THROUGH}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the cores are shared: busy-waiting OpenMP threads hurt
    env["PYTHONUNBUFFERED"] = "1"
    return env


# The death signal is set by this wrapper, which then execs the service, rather than by a preexec_fn:
# a preexec_fn makes subprocess fork() (not vfork) and run gRPC's at-fork handlers in the child. With gRPC
# threads alive in the parent (the OTLP receiver, stats channels) the child's restarted poller then raced
# close_fds and aborted the service before exec ("epoll_wait error: Bad file descriptor", SIGABRT in CI).
# argv: expected parent pid, program, args. Exits at once if that parent is already gone.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys; ctypes.CDLL(None, use_errno=True).prctl(1, 15); "  # PR_SET_PDEATHSIG, SIGTERM
    "os.getppid() == int(sys.argv[1]) or sys.exit(1); os.execv(sys.argv[2], sys.argv[2:])"
)


def die_with_parent(argv: list[str]) -> list[str]:
    """argv wrapped so that the process gets SIGTERM when this process dies (Linux only)."""
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
    expect_killed: bool = False  # SIGKILLed on purpose (and not restarted since)
    terminated: bool = False  # SIGTERM sent
    starts: int = 0
    _log: IO[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def role(self) -> str:
        """proposer, verifier or gateway."""
        return self.script.removeprefix("specdec-")

    def start(self) -> None:
        # A restart appends to the same log, so one file tells the whole story of the port.
        self._log = open(self.log_path, "ab" if self.starts else "wb")  # noqa: SIM115 (closed in stop)
        self.starts += 1
        self.expect_killed = self.terminated = False
        self.proc = subprocess.Popen(
            die_with_parent([*command(self.script), *self.args]),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=service_env(),
            cwd=REPO_ROOT,
        )

    def restart(self) -> None:
        """Start the same command on the same port after a kill (the port is free again once it died)."""
        assert not self.alive(), f"{self.name} is still running"
        if self._log is not None:
            self._log.close()
        self.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_bytes(self) -> int | None:
        """Resident set size of the running process (None when it is not running)."""
        if not self.alive():
            return None
        try:
            with open(f"/proc/{self.proc.pid}/statm") as f:  # type: ignore[union-attr]
                resident = int(f.read().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            return None
        return resident or None  # 0: killed, not yet reaped (a zombie has no memory)

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
        """SIGKILL (a crash); the service is then expected to have died with -9 (until a restart)."""
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
            self._log.close()
        return problem


@dataclass
class Stack:
    """One set of processes: a gateway always; proposer and verifier(s) unless this is an orphan gateway."""

    name: str
    services: list[Service] = field(default_factory=list)  # start order: proposer, verifiers, gateway
    proposer_expected: bool = True
    ready: bool = False
    # A TLS stack: its files, the TLS of the stack's own health and stats calls (the cluster CA and a client
    # certificate from it, which the verifier requires) and the API key its gateway's GetStats needs.
    pki: StackPKI | None = None
    tls: ClientTLS | None = None
    api_key: str = ""
    http_port: int = field(default_factory=free_port)  # the gateway's OpenAI-compatible HTTP API

    def get(self, name: str) -> Service:
        for s in self.services:
            if s.name.endswith(name):
                return s
        raise KeyError(f"stack {self.name} has no {name}")

    def _role(self, role: str) -> list[Service]:
        return [s for s in self.services if s.role == role]

    @property
    def gateway(self) -> Service:
        return self._role("gateway")[0]

    @property
    def verifiers(self) -> list[Service]:
        return self._role("verifier")

    @property
    def verifier(self) -> Service:
        """The first verifier (the only one in single-verifier stacks)."""
        return self.verifiers[0]

    @property
    def proposer(self) -> Service:
        return self._role("proposer")[0]

    def logs(self) -> str:
        return "\n".join(s.describe() for s in self.services)

    def start(self) -> None:
        for s in self.services:
            s.start()

    def stop(self) -> list[str]:
        """Gateway first, then verifiers, then the proposer. Returns the problems (empty: a clean stop)."""
        problems = []
        for role in ("gateway", "verifier", "proposer"):
            tier = self._role(role)
            for s in tier:
                s.terminate()
            problems += [p for s in tier if (p := s.stop()) is not None]
        return problems

    # -- readiness -------------------------------------------------------------------------------

    def fail(self, message: str) -> None:
        raise StackError(f"stack {self.name!r}: {message}\n{self.logs()}")

    def _wait(
        self,
        what: str,
        predicate: Callable[[], tuple[bool, str]],
        deadline: float,
        watch: Sequence[Service],
        timeout_s: float,
    ) -> None:
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
                self.fail(f"timed out after {timeout_s:.0f} s waiting for {what} (last state: {last})")
            time.sleep(0.5)

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        if self.ready:
            return
        self.wait_healthy(timeout_s)
        self.ready = True

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Every service SERVING, every verifier connected to its proposer, and the gateway seeing every
        verifier healthy with engine stats (after a restart too)."""
        deadline = time.monotonic() + timeout_s
        full = len(self.services) > 1
        for s in self.services:
            service = GATEWAY_SERVICE if s.role == "gateway" and full else ""
            what = f"{s.name} SERVING {service or '(overall)'}"
            self._wait(what, functools.partial(check_once, s.address, service, tls=self.tls), deadline, [s], timeout_s)
        if full:
            if self.proposer_expected:
                for v in self.verifiers:
                    self._wait(
                        f"{v.name} to connect to its proposer",
                        functools.partial(self._proposer_connected, v),
                        deadline,
                        self.services,
                        timeout_s,
                    )
            # The gateway learns the context length and vocabulary from its first stats poll.
            self._wait(
                "the gateway's stats poll of every verifier", self._gateway_polled, deadline, self.services, timeout_s
            )

    def _proposer_connected(self, verifier: Service) -> tuple[bool, str]:
        return self.verifier_stats(verifier).stats.proposer_connected, "proposer_connected=false"

    def _gateway_polled(self) -> tuple[bool, str]:
        stats = self.gateway_stats()
        ok = bool(stats.backends) and all(b.healthy and b.HasField("engine") for b in stats.backends)
        return ok, str(stats).replace("\n", " ")

    # -- stats (sync, short-lived channels) ------------------------------------------------------

    def verifier_stats(
        self, verifier: Service | None = None, timeout: float = 10.0
    ) -> verifier_pb2.VerifierGetStatsResponse:
        with sync_channel((verifier or self.verifier).address, self.tls) as channel:
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
    num_verifiers: int = 1,
    proposer_kind: str = "draft-model",
    proposer_args: Sequence[str] = (),
    adaptive_k: bool = False,
    pki: StackPKI | None = None,
) -> Stack:
    """A stack (not started): a proposer, `num_verifiers` verifiers that all draft from it (k = K fixed unless
    adaptive_k), and a gateway over the verifiers; or, without verifier, a gateway whose only verifier address
    has nothing listening. With `pki`, TLS on every port, mutual TLS between services, an API key at the gateway."""
    target, draft = default_target_model(), default_draft_model()
    drafter = (
        ["--model", draft]
        if proposer_kind == "draft-model"
        else ["--model", default_eagle_head(), "--target-model", target]
    )
    stack = Stack(name, pki=pki)
    if pki is not None:
        stack.tls, stack.api_key = pki.client(), pki.api_key

    def tls_args(service: str) -> list[str]:
        return pki.service_args(service) if pki is not None else []

    gateway_port = free_port()
    if with_verifier:
        proposer_port = free_port()
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
                    *proposer_args,
                    *tls_args("proposer"),
                ],
                log_dir / f"{name}-proposer.log",
                proposer_port,
            )
        )
        addresses = []
        for i in range(num_verifiers):
            suffix = "" if num_verifiers == 1 else f"-{chr(ord('a') + i)}"
            verifier_port = free_port()
            stack.services.append(
                Service(
                    f"{name}-verifier{suffix}",
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
                        "--no-warm-up",  # tests count every step and draft; the soak turns it back on
                        *verifier_args,
                        *tls_args("verifier"),
                    ],
                    log_dir / f"{name}-verifier{suffix}.log",
                    verifier_port,
                )
            )
            addresses.append(f"{HOST}:{verifier_port}")
        verifiers = ",".join(addresses)
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
                *(["--api-keys-file", str(pki.api_keys_file)] if pki is not None else []),
            ],
            log_dir / f"{name}-gateway.log",
            gateway_port,
        )
    )
    return stack
