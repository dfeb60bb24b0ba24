"""A tensor-parallel rank > 0: `python -m shared.model.tp_worker`, started by rank 0 (shared/model/tp_group.py).

It connects to rank 0's store, loads its shard and its KV-cache slice, reports ready, then loops: receive
the step's inputs from rank 0, run its shard (the all-reduces meet rank 0's), repeat. The logits are rank
0's business (replicated LM head), so a worker stops at the hidden states. It exits 0 on "stop", and
non-zero when anything fails, including rank 0 going away (the broadcast fails at once when rank 0's
sockets close; a thread also checks the parent process, in case rank 0 hangs without dying).
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import threading
import time
import traceback

log = logging.getLogger("specdec.tp.worker")

EXIT_FAILED = 1
EXIT_ORPHANED = 2


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            log.error("rank 0 (pid %d) is gone; exiting", parent_pid)
            os._exit(EXIT_ORPHANED)
        time.sleep(0.5)


def main() -> int:
    from shared.malloc_tuning import tune_malloc
    from shared.model import tp_group

    tune_malloc()  # as rank 0's service process does
    rank = int(os.environ[tp_group.ENV_RANK])
    world_size = int(os.environ[tp_group.ENV_WORLD_SIZE])
    port = int(os.environ[tp_group.ENV_STORE_PORT])
    spec = tp_group.RankSpec.from_json(os.environ[tp_group.ENV_SPEC])
    logging.basicConfig(
        level=os.environ.get("SPECDEC_LOG_LEVEL", "INFO").upper(),
        format=f"ts=%(asctime)s level=%(levelname)s logger=%(name)s rank={rank} msg=%(message)s",
    )
    # Ctrl-C in a terminal reaches every process of the group: rank 0 shuts the group down in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(
        target=_watch_parent, args=(int(os.environ[tp_group.ENV_PARENT_PID]),), name="parent-watch", daemon=True
    ).start()

    import torch
    import torch.distributed as dist

    if spec.num_threads and not spec.device.startswith("cuda"):
        torch.set_num_threads(spec.num_threads)
    store = dist.TCPStore(tp_group.HOST, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=120))
    try:
        channel = tp_group.Channel(store, rank, world_size, spec.device, spec.timeout_s)
        runner = tp_group.build_rank_runner(spec, channel.tp())
    except Exception as err:
        traceback.print_exc()
        store.set(f"error/{rank}", f"{type(err).__name__}: {err}")
        return EXIT_FAILED
    from shared.hugepages import advise_process_memory

    advise_process_memory(f"tensor-parallel rank {rank}")  # its shard and cache slice, as rank 0's
    store.set(f"ready/{rank}", "1")
    log.info("tensor-parallel rank %d/%d ready model=%s pid=%d", rank, world_size, spec.model, os.getpid())
    return serve(channel, runner)


def serve(channel, runner) -> int:
    """The worker loop; returns the exit code."""
    import torch

    from shared.model.attention import build_metadata, uses_kernel
    from shared.model.tp_group import decode_items

    model, cache, device = runner.model, runner.cache, runner.device
    steps = 0
    while True:
        try:
            message = channel.receive()
        except Exception as err:
            log.error("lost rank 0 (%s); exiting", err)
            return EXIT_FAILED
        op = message.get("op")
        try:
            if op == "forward":
                items = decode_items(message["items"])
                spans = [it.span() for it in items]
                meta = build_metadata(spans, cache.block_size, device, kernel=uses_kernel(model.backend))
                input_ids = torch.tensor([t for it in items for t in it.token_ids], dtype=torch.int64, device=device)
                model(input_ids, cache.layers, meta)  # writes this rank's K/V; hidden states are not needed here
                steps += 1
            elif op == "copy_blocks":
                cache.copy_blocks([(src, dst) for src, dst in message["pairs"]])
            elif op == "copy_slots":
                cache.copy_slots([(src, dst) for src, dst in message["pairs"]])
            elif op == "stop":
                log.info("tensor-parallel rank %d stopping after %d steps", channel.rank, steps)
                return 0
            else:
                raise ValueError(f"unknown message {op!r}")
        except Exception:
            log.exception("tensor-parallel rank %d failed in %r; exiting", channel.rank, op)
            return EXIT_FAILED


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: gloo's threads may still hold sockets to a dead peer
