"""The tensor-parallel rank group: start-up, the per-step broadcast from rank 0, failure and shutdown.

Rank 0 is the service process (it runs the scheduler, the sampler and gRPC). `launch_tp_runner` starts
ranks 1..N-1 as `python -m shared.model.tp_worker` subprocesses, which meet rank 0 at a TCPStore on
127.0.0.1 (port chosen by the OS, so no free-port race). Every rank loads the checkpoint, keeps its own
slice of the heads and the MLP (shared/model/parallel.py) and builds its own KV cache with the same number
of blocks; the block tables are rank 0's, sent with each step.

Per step rank 0 broadcasts the step's inputs (the ForwardItems, as JSON: no pickle crosses the socket)
on a gloo "control" group; then every rank runs its shard, with one all-reduce after attention and one
after the MLP of every block on the "compute" group (the same gloo group on CPU; NCCL on CUDA, where
control messages still go over gloo on the CPU, as vLLM does). The embedding and LM head are replicated,
so rank 0 computes the full logits itself; the other ranks stop at the hidden states.

Failure: a collective that fails (a dead peer closes its sockets and gloo raises at once) or a rank
process that exits (a watchdog thread polls them) marks the group failed for good: every later step
raises UnavailableError, and the `on_failure` callbacks run once, so the service can report NOT_SERVING
and exit non-zero. Workers exit when rank 0 dies (their receive fails, and they poll their parent) and
on the "stop" message of a clean shutdown. The groups are standalone ProcessGroup objects: no global
torch.distributed state, so one process may hold several groups (in tests).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shared.errors import UnavailableError
from shared.kv.cache import KVCache
from shared.model.attention import TreeSpec
from shared.model.config import ModelArch
from shared.model.parallel import TensorParallel
from shared.model.runner import FINAL_LAYER, ForwardItem, ModelRunner

log = logging.getLogger("specdec.tp")

ENV_RANK = "SPECDEC_TP_RANK"
ENV_WORLD_SIZE = "SPECDEC_TP_WORLD_SIZE"
ENV_STORE_PORT = "SPECDEC_TP_STORE_PORT"
ENV_SPEC = "SPECDEC_TP_SPEC"
ENV_PARENT_PID = "SPECDEC_TP_PARENT_PID"

HOST = "127.0.0.1"
CONTROL_BYTES = 16384  # one broadcast carries a step of up to ~16 KB of JSON; longer ones take a second
IDLE_TIMEOUT = datetime.timedelta(days=3650)  # a worker waits for the next step as long as rank 0 lives
POLL_S = 0.05


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its shard and its KV cache (sent to workers as JSON)."""

    model: str
    num_blocks: int
    block_size: int
    dtype: str = "float32"
    device: str = "cpu"  # "cuda" means cuda:<rank>
    attention_backend: str = "auto"
    num_threads: int = 0  # torch threads per rank on CPU; 0 leaves torch's default
    timeout_s: float = 300.0  # longest wait inside a step's collectives before the group is declared dead

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        return cls(**json.loads(text))


def rank_device(device: str, rank: int) -> str:
    """Rank r of a CUDA group uses the r-th GPU after the one named (cuda -> cuda:r, cuda:2 -> cuda:2+r)."""
    if not device.startswith("cuda"):
        return device
    _, _, index = device.partition(":")
    return f"cuda:{int(index or 0) + rank}"


def check_tensor_parallel(arch: ModelArch, world_size: int) -> None:
    """Raise ValueError, naming the numbers, if the model cannot be split `world_size` ways (before any
    process is started or weight is read): the shapes are checked by building the model on the meta device."""
    if world_size < 1:
        raise ValueError(f"the tensor-parallel size must be >= 1, got {world_size}")
    from shared.model.llama import LlamaModel

    with torch.device("meta"):
        LlamaModel(arch, TensorParallel(0, world_size))


def default_threads_per_rank(device: str, world_size: int) -> int:
    """On CPU the ranks share the machine's cores; on GPU torch's default is left alone."""
    if device != "cpu":
        return 0
    return max(1, (os.cpu_count() or 1) // world_size)


def build_rank_runner(spec: RankSpec, tp: TensorParallel) -> ModelRunner:
    """This rank's shard of the model and its slice of the paged KV cache (its own KV heads, all blocks)."""
    from shared.model.loader import load_model

    dtype = getattr(torch, spec.dtype)
    device = rank_device(spec.device, tp.rank)
    model, arch = load_model(spec.model, dtype, device, tp)
    local_kv_heads = tp.local_kv_heads(arch.num_kv_heads)
    cache = KVCache(arch.num_layers, spec.num_blocks, spec.block_size, local_kv_heads, arch.head_dim, dtype, device)
    return ModelRunner(model, cache, spec.attention_backend)


# ---- the process groups -------------------------------------------------------------------------


def _gloo_group(store: Any, rank: int, world_size: int, timeout_s: float) -> Any:
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def _nccl_group(store: Any, rank: int, world_size: int, timeout_s: float) -> Any:  # pragma: no cover - GPU only
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupNCCL(store, rank, world_size, opts)


class Channel:
    """One rank's end of the group: `control` (gloo, CPU) carries step inputs from rank 0, `compute` carries
    the model's all-reduces (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, store: Any, rank: int, world_size: int, device: str, timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.control = _gloo_group(dist.PrefixStore("control", store), rank, world_size, timeout_s)
        if device.startswith("cuda"):  # pragma: no cover - GPU only
            torch.cuda.set_device(rank_device(device, rank))
            self.compute = _nccl_group(dist.PrefixStore("compute", store), rank, world_size, timeout_s)
        else:
            self.compute = self.control
        self._buffer = torch.zeros(CONTROL_BYTES, dtype=torch.uint8)

    def tp(self) -> TensorParallel:
        return TensorParallel(self.rank, self.world_size, self.compute)

    def _broadcast(self, tensor: torch.Tensor, timeout: datetime.timedelta | None = None) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        if timeout is not None:
            opts.timeout = timeout
        self.control.broadcast([tensor], opts).wait()

    def send(self, message: dict[str, Any]) -> None:
        """Rank 0: broadcast one message (8-byte length, then JSON)."""
        payload = json.dumps(message, separators=(",", ":")).encode()
        data = torch.frombuffer(bytearray(len(payload).to_bytes(8, "little") + payload), dtype=torch.uint8)
        head = min(len(data), CONTROL_BYTES)
        self._buffer[:head] = data[:head]
        self._broadcast(self._buffer)
        if len(data) > CONTROL_BYTES:
            self._broadcast(data[CONTROL_BYTES:].clone())

    def receive(self) -> dict[str, Any]:
        """Ranks > 0: wait (without a deadline: an idle service sends nothing) for rank 0's next message."""
        self._broadcast(self._buffer, IDLE_TIMEOUT)
        size = int.from_bytes(bytes(self._buffer[:8].tolist()), "little")
        data = bytes(self._buffer[8 : min(8 + size, CONTROL_BYTES)].numpy())
        if 8 + size > CONTROL_BYTES:
            rest = torch.zeros(8 + size - CONTROL_BYTES, dtype=torch.uint8)
            self._broadcast(rest)
            data += bytes(rest.numpy())
        return json.loads(data)


def encode_items(items: list[ForwardItem]) -> list[list[Any]]:
    return [
        [
            it.block_table,
            it.num_cached,
            it.token_ids,
            it.num_logits,
            None if it.tree is None else dataclasses.astuple(it.tree),
        ]
        for it in items
    ]


def decode_items(rows: list[list[Any]]) -> list[ForwardItem]:
    return [
        ForwardItem(table, cached, tokens, num_logits, None if tree is None else _tree(*tree))
        for table, cached, tokens, num_logits, tree in rows
    ]


def _tree(prefix_len: int, positions: list[int], visible: list[list[int]]) -> TreeSpec:
    return TreeSpec(prefix_len, tuple(positions), tuple(tuple(v) for v in visible))


# ---- rank 0's handle ----------------------------------------------------------------------------


class TPGroup:
    """Rank 0's view of the group: the worker processes, the channel, failure state and callbacks."""

    def __init__(self, world_size: int, procs: list[subprocess.Popen], store: Any, channel: Channel) -> None:
        self.world_size = world_size
        self.procs = procs  # rank r is procs[r - 1]
        self.store = store
        self.channel = channel
        self.lock = threading.RLock()  # one sender at a time: a step (send + own shard) is atomic
        self.failure: str | None = None
        self._callbacks: list[Callable[[str], None]] = []
        self._closing = False
        self._watchdog: threading.Thread | None = None

    @property
    def tp(self) -> TensorParallel:
        return self.channel.tp()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @classmethod
    def launch(cls, spec: RankSpec, world_size: int, connect_timeout_s: float = 120.0) -> TPGroup:
        """Start ranks 1..N-1 and connect the group; the workers then load their shards in the background
        (`wait_ready`)."""
        if world_size < 2:
            raise ValueError(f"a tensor-parallel group needs at least 2 ranks, got {world_size}")
        store = dist.TCPStore(
            HOST,
            0,
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=connect_timeout_s),
            wait_for_workers=False,
        )
        procs: list[subprocess.Popen] = []
        try:
            for rank in range(1, world_size):
                procs.append(_spawn_worker(spec, rank, world_size, store.port))
            channel = _wait_for(
                lambda: Channel(store, 0, world_size, spec.device, spec.timeout_s),
                procs,
                connect_timeout_s,
                "connecting the tensor-parallel group",
            )
        except BaseException:
            _kill(procs)
            raise
        log.info("tensor-parallel group connected world_size=%d worker_pids=%s", world_size, [p.pid for p in procs])
        return cls(world_size, procs, store, channel)

    def wait_ready(self, timeout_s: float = 1800.0) -> None:
        """Wait until every worker has loaded its shard; raise with the worker's own message if one failed."""
        deadline = time.monotonic() + timeout_s
        pending = set(range(1, self.world_size))
        while pending:
            for rank in sorted(pending):
                if self.store.check([f"error/{rank}"]):
                    message = self.store.get(f"error/{rank}").decode(errors="replace")
                    raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {message}")
                if self.store.check([f"ready/{rank}"]):
                    pending.discard(rank)
            _raise_if_exited(self.procs, "loading the model")
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks {sorted(pending)} not ready after {timeout_s:.0f} s")
            if pending:
                time.sleep(POLL_S)

    # ---- failure ---------------------------------------------------------------------------------

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` once, from any thread, when the group fails; starts the watchdog."""
        with _fail_lock:
            self._callbacks.append(callback)
            already = self.failure
        if already is not None:  # failed before this callback was registered: fail() did not call it
            callback(already)
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        while not self._closing and self.failure is None:
            exited = self._exited()
            if exited and not self._closing:
                self.fail(exited)
                return
            time.sleep(POLL_S * 4)

    def fail(self, reason: str) -> None:
        """Mark the group dead (it cannot recover: ranks may be mid-collective) and run the callbacks once."""
        with _fail_lock:
            if self.failure is not None:
                return
            self.failure = reason
            callbacks = list(self._callbacks)
        log.error("tensor-parallel group failed: %s", reason)
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:
                log.exception("tensor-parallel failure callback raised")

    def check_alive(self) -> None:
        if self.failure is not None:
            raise UnavailableError(f"the tensor-parallel group has failed ({self.failure}); the service is exiting")

    def step_failed(self, err: BaseException) -> UnavailableError:
        """A collective or the local shard raised mid-step: the ranks are out of step for good. The usual
        cause is a dead rank (its sockets close before its exit is seen): name it when it shows up soon."""
        reason = f"a step failed on rank 0: {type(err).__name__}: {_short(err)}"
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            exited = self._exited()
            if exited:
                reason = exited
                break
            time.sleep(POLL_S)
        self.fail(reason)
        return UnavailableError(f"the tensor-parallel group has failed ({reason}); the service is exiting")

    def _exited(self) -> str | None:
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
        return None

    # ---- sending ---------------------------------------------------------------------------------

    def send(self, message: dict[str, Any]) -> None:
        self.check_alive()
        try:
            self.channel.send(message)
        except Exception as err:
            raise self.step_failed(err) from err

    # ---- shutdown --------------------------------------------------------------------------------

    def close(self, timeout_s: float = 10.0) -> None:
        """Clean shutdown: tell the workers to stop, wait for them, kill what is left."""
        self._closing = True
        if self.failure is None and self.lock.acquire(timeout=timeout_s):
            try:
                self.channel.send({"op": "stop"})
            except Exception as err:  # a worker already gone: nothing to tell it
                log.warning("could not send stop to the tensor-parallel ranks: %s", err)
            finally:
                self.lock.release()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel worker pid %d did not stop; killing it", proc.pid)
        self.kill()

    def kill(self) -> None:
        self._closing = True
        _kill(self.procs)


_fail_lock = threading.Lock()


def _short(err: BaseException) -> str:
    """gloo's messages start with a source location and end with advice; keep the part in between."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". This is typically")[0]


def _spawn_worker(spec: RankSpec, rank: int, world_size: int, port: int) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(
        {
            ENV_RANK: str(rank),
            ENV_WORLD_SIZE: str(world_size),
            ENV_STORE_PORT: str(port),
            ENV_SPEC: spec.to_json(),
            ENV_PARENT_PID: str(os.getpid()),
        }
    )
    if spec.num_threads:
        env["OMP_NUM_THREADS"] = str(spec.num_threads)
    # The repository root on the path, whatever the parent's working directory.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return subprocess.Popen([sys.executable, "-m", "shared.model.tp_worker"], env=env, stdin=subprocess.DEVNULL)


def _raise_if_exited(procs: list[subprocess.Popen], during: str) -> None:
    for rank, proc in enumerate(procs, start=1):
        code = proc.poll()
        if code is not None:
            raise RuntimeError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code} while {during}")


def _wait_for(fn: Callable[[], Any], procs: list[subprocess.Popen], timeout_s: float, during: str) -> Any:
    """Run a blocking call (that needs every worker) in a thread while watching the workers."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as err:
            result["error"] = err

    thread = threading.Thread(target=target, name="tp-connect", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive():
        thread.join(POLL_S)
        if not thread.is_alive():
            break
        _raise_if_exited(procs, during)
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s {during}")
    if "error" in result:
        raise result["error"]
    return result["value"]


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process that ignores SIGKILL
            log.error("tensor-parallel worker pid %d survived SIGKILL", proc.pid)


# ---- rank 0's runner ----------------------------------------------------------------------------


class _BroadcastingCache(KVCache):
    """Rank 0's KV cache as the engine and drafters see it (the same tensors); copy-on-write copies are
    sent to every rank, which applies them to its own slice."""

    def __init__(self, local: KVCache, group: TPGroup) -> None:  # no super().__init__: nothing is allocated
        self.local = local
        self.group = group
        self.block_size = local.block_size
        self.num_blocks = local.num_blocks
        self.layers = local.layers

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        with self.group.lock:
            self.group.send({"op": "copy_blocks", "pairs": [list(p) for p in pairs]})
            self.local.copy_blocks(pairs)

    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        with self.group.lock:
            self.group.send({"op": "copy_slots", "pairs": [list(p) for p in pairs]})
            self.local.copy_slots(pairs)


class TPModelRunner(ModelRunner):
    """Rank 0's ModelRunner: each forward broadcasts its inputs, then runs rank 0's own shard, which
    yields the full logits (the LM head is replicated). Used by the verifier's engine and the proposer's
    draft-model drafter exactly like a ModelRunner."""

    def __init__(self, runner: ModelRunner, group: TPGroup) -> None:  # no super().__init__: wraps `runner`
        self.local = runner
        self.group = group
        self.model = runner.model
        self.device = runner.device
        self.cache = _BroadcastingCache(runner.cache, group)

    @property
    def tensor_parallel_size(self) -> int:
        return self.group.world_size

    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor]:
        return self.forward_with_hidden(items)[0]

    def forward_with_hidden(
        self, items: list[ForwardItem], layers: tuple[int, ...] = FINAL_LAYER
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Rank 0's hidden states are the full ones, those of every layer: the row-parallel layers all-reduce
        before returning."""
        with self.group.lock:
            self.group.send({"op": "forward", "items": encode_items(items)})
            try:
                return self.local.forward_with_hidden(items, layers)
            except Exception as err:  # the ranks are out of step now: the group cannot go on
                raise self.group.step_failed(err) from err

    def on_failure(self, callback: Callable[[str], None]) -> None:
        self.group.on_failure(callback)

    def close(self) -> None:
        self.group.close()


def launch_tp_runner(spec: RankSpec, world_size: int, ready_timeout_s: float = 1800.0) -> TPModelRunner:
    """Start the group, load rank 0's shard while the workers load theirs, wait until all are ready."""
    if spec.num_threads and rank_device(spec.device, 0) == "cpu":
        torch.set_num_threads(spec.num_threads)
    started = time.monotonic()
    group = TPGroup.launch(spec, world_size)
    try:
        runner = build_rank_runner(spec, group.tp)
        group.wait_ready(ready_timeout_s)
    except BaseException:
        group.kill()
        raise
    log.info(
        "tensor-parallel group ready world_size=%d worker_pids=%s seconds=%.1f",
        world_size,
        ",".join(str(pid) for pid in group.worker_pids),
        time.monotonic() - started,
    )
    return TPModelRunner(runner, group)
