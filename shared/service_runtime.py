"""A service's life after start-up, the same for verifier and proposer: serve until SIGTERM, drain, stop;
and when a tensor-parallel rank dies, stop serving and exit non-zero (a process supervisor restarts it)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import ClassVar, TypeVar

from shared.gc_tuning import freeze_startup_heap
from shared.grpc_server import install_sigterm
from shared.model.tp_group import TPModelRunner

RANK_FAILURE_EXIT_CODE = 1  # a tensor-parallel rank died: the service cannot serve and exits

S = TypeVar("S", bound="ServiceRuntime")


class ServiceRuntime:
    """Base of a running service. Subclasses say how they stop serving after a rank failure (`_fail`, which
    ends with `self.failed.set()`) and how they drain (`shutdown`)."""

    role: ClassVar[str]  # "verifier" or "proposer", in log lines
    log: ClassVar[logging.Logger]  # the service's own logger, so its lines keep their logger name

    def __init__(self) -> None:
        self.failed = asyncio.Event()  # set when a tensor-parallel rank died: serve() then exits non-zero
        self.failure_reason: str | None = None
        self._failing: asyncio.Task | None = None

    @property
    def tp_runner(self) -> TPModelRunner | None:
        raise NotImplementedError

    async def _fail(self, reason: str) -> None:
        raise NotImplementedError

    async def shutdown(self, grace_s: float) -> None:
        raise NotImplementedError

    def watch_rank_failures(self) -> None:
        """Call on the event loop once serving: a rank failure, reported from any thread, starts `_fail`."""
        runner = self.tp_runner
        if runner is None:
            return
        aio_loop = asyncio.get_running_loop()

        def on_rank_failure(reason: str) -> None:  # any thread
            aio_loop.call_soon_threadsafe(self._start_failing, reason)

        runner.on_failure(on_rank_failure)

    def _start_failing(self, reason: str) -> None:
        if self.failure_reason is None:
            self.failure_reason = reason
            self._failing = asyncio.get_running_loop().create_task(self._fail(reason))

    def exit_after_failure(self) -> None:
        """Exit the process now with a non-zero code: a step or drafting thread may be stuck in a collective, so
        no orderly interpreter shutdown is attempted; the worker ranks are killed first."""
        self.log.critical("exiting after a tensor-parallel failure: %s", self.failure_reason)
        runner = self.tp_runner
        if runner is not None:
            runner.group.kill()
        logging.shutdown()
        os._exit(RANK_FAILURE_EXIT_CODE)

    @classmethod
    async def serve_until_stopped(
        cls: type[S], start: Callable[[], Awaitable[S]], grace_s: float, on_ready: Callable[[S], None] | None = None
    ) -> None:
        """Start, serve until SIGTERM/SIGINT, then drain for at most `grace_s`. A rank failure, before or during
        the drain, ends the process with RANK_FAILURE_EXIT_CODE."""
        stop = asyncio.Event()
        install_sigterm(stop)
        try:
            server = await start()
        except ValueError as err:  # a configuration the model cannot serve (e.g. heads not divisible by N)
            cls.log.error("cannot start the %s: %s", cls.role, err)
            raise SystemExit(2) from err
        freeze_startup_heap()  # the model, tokenizer and libraries, loaded: never garbage (shared/gc_tuning.py)
        if on_ready is not None:
            on_ready(server)
        await first_of(stop.wait(), server.failed.wait())
        if not server.failed.is_set():
            shutdown = asyncio.ensure_future(server.shutdown(grace_s))
            await first_of(shutdown, server.failed.wait())  # a rank may die during the drain, too
            if not server.failed.is_set():
                await shutdown
                return
        server.exit_after_failure()


async def first_of(*aws: Awaitable[object]) -> None:
    """Wait for the first of `aws` to finish; cancel the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in tasks:
        if not task.done():
            task.cancel()
