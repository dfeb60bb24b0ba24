"""Both engines loaded at once, taking turns: the peer benchmark's interleaved mode (`specdec_bench.peer_bench`).

On a shared machine whose speed drifts by more than the gap between two engines within minutes, fresh processes
one after another compare one minute's machine with another's. Here each engine is one long-lived worker process
that loads its model and warms up once, then waits, blocked on a pipe, until the driver asks it for one timed pass
at a batch size; the driver asks the two in turn, a pass each, the order flipping every round, so each ratio
compares passes seconds apart.

Waiting is not always idle: vLLM's worker process busy-polls its shared-memory queue for a second after its last
step (shm_broadcast's SpinCondition, `busy_loop_s = 1`), which on two cores took a quarter of the next pass's speed
from whichever engine ran next (ours, bf16 at batch 8: 303 tokens/s right after a vLLM pass, 405 alone). So before
a pass the driver waits until the other engine's processes have gone quiet (`wait_quiet`), and it counts the CPU
time they use during the pass (`cpu_seconds`), which the report shows.

The protocol is one JSON object per line over two pipes of their own (the engines' logs keep stdout and stderr):
the worker says `{"ready": ..., "load_s": ...}` once warmed up, answers `{"batch": B}` with that pass's result and
`{"finish": true}` with its last words (vLLM's speculative counters) before it exits. vLLM's side of it lives in
peer_vllm.py, which may not import this repository.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

# Quiet: the worker's processes used under 5% of a core over a window of a quarter of a second
QUIET_WINDOW_S, QUIET_SHARE, QUIET_LIMIT_S = 0.25, 0.05, 10.0


def session_cpu_seconds(session: int) -> float:
    """User + system CPU seconds used so far by every live process of `session` (a worker's own session: the
    engine and the processes it started), from /proc; 0 where /proc cannot tell."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
        except (OSError, IndexError):
            continue  # a process that ended meanwhile
        if len(fields) > 12 and int(fields[3]) == session:  # field 6 of proc(5): the session; 14, 15: utime, stime
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


class WorkerDied(RuntimeError):
    """The worker exited or stopped answering: its log says why."""


class Worker:
    """One engine's long-lived process (the driver's side)."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path, cwd: Path, timeout_s: float) -> None:
        commands_read, commands_write = os.pipe()
        results_read, results_write = os.pipe()
        self.log_path, self.timeout_s = log_path, timeout_s
        with open(log_path, "wb") as log:
            # its own process group: vLLM's engine-core processes go with it when it is stopped
            self.proc = subprocess.Popen(
                [*cmd, str(commands_read), str(results_write)],
                pass_fds=(commands_read, results_write),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        os.close(commands_read)
        os.close(results_write)
        self._commands = os.fdopen(commands_write, "w")
        self._results = os.fdopen(results_read)

    def wait_ready(self) -> dict:
        return self._receive()

    def ask(self, message: dict) -> dict:
        try:
            self._commands.write(json.dumps(message) + "\n")
            self._commands.flush()
        except BrokenPipeError as e:
            raise WorkerDied(self._why()) from e
        return self._receive()

    def cpu_seconds(self) -> float:
        """CPU seconds its processes have used so far."""
        return session_cpu_seconds(self.proc.pid)

    def wait_quiet(self) -> float:
        """Until its processes use under QUIET_SHARE of a core over QUIET_WINDOW_S (at most QUIET_LIMIT_S): the
        seconds waited."""
        start = time.monotonic()
        used = self.cpu_seconds()
        while time.monotonic() - start < QUIET_LIMIT_S:
            time.sleep(QUIET_WINDOW_S)
            now = self.cpu_seconds()
            if now - used < QUIET_SHARE * QUIET_WINDOW_S:
                break
            used = now
        return time.monotonic() - start

    def stop(self) -> dict:
        """Its last words (or {} when it is already gone), then the process group ends."""
        try:
            return self.ask({"finish": True})
        except WorkerDied:
            return {}
        finally:
            kill_group(self.proc.pid)
            self.proc.wait()
            with contextlib.suppress(BrokenPipeError):  # a command still buffered for a worker that is gone
                self._commands.close()
            self._results.close()

    def _receive(self) -> dict:
        # A child of the worker (vLLM's engine core) may hold the pipe's write end too, so its end of file is not
        # the worker's death: poll the process while waiting.
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            readable, _, _ = select.select([self._results], [], [], 1.0)
            if readable:
                line = self._results.readline()
                if line:
                    return json.loads(line)
            if self.proc.poll() is not None:
                raise WorkerDied(self._why())
        raise WorkerDied(f"no answer in {self.timeout_s:.0f} s ({self._why()})")

    def _why(self) -> str:
        return why_it_ended(self.proc.poll(), self.log_path)


def why_it_ended(returncode: int | None, log_path: Path) -> str:
    """An engine process's exit status and the last lines of its log, for the report."""
    tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
    return f"exit {returncode}: {' / '.join(tail)[-400:]} (log {log_path})"


def kill_group(pgid: int) -> None:
    """The engine process and every process it started (vLLM's engine core and workers)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def serve(commands_fd: int, results_fd: int, load: Callable[[], tuple[dict, Callable[[int], dict]]]) -> None:
    """The worker's side: `load()` loads and warms up, returning what `ready` says and the pass to run per batch
    size. Our engine's worker (peer_bench --ours-serve) runs this; peer_vllm.py has the same loop of its own."""
    with os.fdopen(commands_fd) as commands, os.fdopen(results_fd, "w") as results:
        ready, run_pass = load()
        results.write(json.dumps({"ready": True} | ready) + "\n")
        results.flush()
        for line in commands:
            message = json.loads(line)
            if message.get("finish"):
                results.write("{}\n")
                results.flush()
                return
            results.write(json.dumps(run_pass(int(message["batch"]))) + "\n")
            results.flush()
