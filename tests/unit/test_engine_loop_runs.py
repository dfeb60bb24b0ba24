"""EngineLoop's runs of steps (verifier_service/engine_loop.py): the step thread steps back to back, and whatever
waits to change the engine gets it after the current step. A fake engine isolates the hand-over from the model."""

from __future__ import annotations

import asyncio
import random
import time
from concurrent.futures import ThreadPoolExecutor

from shared.sampling import SamplingParams
from verifier_service.engine import RequestOutput
from verifier_service.engine_loop import EngineLoop
from verifier_service.sequence import FinishReason


class _Stats:
    steps = 0


class CountingEngine:
    """One token per running request per step (1 ms each); records the step at which each request was added."""

    def __init__(self) -> None:
        self.remaining: dict[str, int] = {}
        self.stats = _Stats()
        self.added_at: dict[str, int] = {}

    def add_request(self, request_id, prompt_ids, params, *args) -> None:
        self.remaining[request_id] = params.max_tokens
        self.added_at[request_id] = self.stats.steps

    def abort(self, request_id: str) -> bool:
        return self.remaining.pop(request_id, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self.remaining)

    def step(self) -> list[RequestOutput]:
        time.sleep(0.001)
        outputs = []
        for request_id in list(self.remaining):
            self.remaining[request_id] -= 1
            finished = self.remaining[request_id] <= 0
            if finished:
                del self.remaining[request_id]
            outputs.append(RequestOutput(request_id, [1], FinishReason.LENGTH if finished else None))
        self.stats.steps += 1
        return outputs


def test_requests_arriving_together_beside_a_long_one_all_join_promptly():
    """A run of steps must end for every request that waits to join, however the waits interleave. Two arrivals
    a moment apart once left the second behind the loop's next run (its interrupt cleared while it queued for the
    lock): it waited until another arrival ended that run, or here, with none coming, until the long request
    finished."""

    async def body() -> None:
        engine = CountingEngine()
        loop = EngineLoop(engine, step_thread=ThreadPoolExecutor(1))  # type: ignore[arg-type]
        await loop.start()

        async def consume(request_id: str, max_tokens: int) -> None:
            updates = loop.generate(request_id, [1, 2], SamplingParams(max_tokens=max_tokens))
            async for update in updates:
                if update is not None and update.finished:
                    break
            await updates.aclose()

        long = asyncio.create_task(consume("long", 1_000_000))
        await asyncio.sleep(0.05)
        rng = random.Random(0)
        try:
            for burst in range(100):
                together = []
                for i in range(rng.randint(2, 3)):
                    together.append(asyncio.create_task(consume(f"r{burst}-{i}", 3)))
                    await asyncio.sleep(rng.choice([0, 0, 0.0002, 0.001]))
                try:  # 3 steps of 1 ms each: seconds only if a request never joined the running batch
                    await asyncio.wait_for(asyncio.gather(*together), 5.0)
                except TimeoutError:
                    raise AssertionError(f"burst {burst}: a request did not join within 5 s") from None
        finally:
            long.cancel()
            await loop.stop()

    asyncio.run(body())
