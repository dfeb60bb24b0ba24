"""Both services tensor-parallel, for real: `specdec-verifier --tensor-parallel-size 2` as a process (its rank 1
another process) fed by a proposer at --tensor-parallel-size 2 (in this process; its rank 1 a process), on
tiny checkpoints saved to disk. Greedy output over gRPC equals transformers'; then the failure paths:
the proposer's rank dies -> the proposer reports its failure and stops, the verifier goes on at k = 0 with
the same output; the verifier's rank dies -> the running request ends UNAVAILABLE and the verifier process
exits non-zero, without hanging.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proposer_service.config import ProposerConfig
from proposer_service.server import ProposerServer
from shared.proto_gen.specdec.v1 import verifier_pb2, verifier_pb2_grpc
from specdec_local.processes import free_port
from tests.tiny import hf_greedy, tiny_hf_model

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[3, 17, 42, 8, 1], [60, 2, 2, 9, 33, 71, 5, 12, 90, 14, 27]]
MAX_TOKENS = 16


class Process:
    """A service subprocess whose stderr is collected by a thread (so its pipe never fills)."""

    def __init__(self, argv: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def find(self, pattern: str) -> re.Match | None:
        for line in list(self.lines):
            if match := re.search(pattern, line):
                return match
        return None

    async def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if match := self.find(pattern):
                return match
            if self.proc.poll() is not None:
                break
            await asyncio.sleep(0.1)
        raise AssertionError(f"no {pattern!r} in the output:\n{''.join(self.lines[-30:])}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def test_verifier_tp2_and_proposer_tp2_greedy_then_rank_failures(tmp_path):
    target_hf = tiny_hf_model(seed=1, logit_scale=8.0)
    target_hf.save_pretrained(tmp_path / "target")
    with torch.no_grad():  # the draft: the target with noisy weights (some drafts accepted, some not)
        gen = torch.Generator().manual_seed(0)
        draft_hf = tiny_hf_model(seed=1, logit_scale=8.0)
        for p in draft_hf.parameters():
            p.add_(0.2 * p.std() * torch.randn(p.shape, generator=gen))
    draft_hf.save_pretrained(tmp_path / "draft")
    references = [hf_greedy(target_hf, p, MAX_TOKENS, eos=False) for p in PROMPTS]

    async def body() -> None:
        proposer_port = free_port()
        # Both start at once (the verifier connects to the proposer whenever it comes up).
        verifier = Process(
            [
                sys.executable,
                "-m",
                "verifier_service.server",
                *("--model", str(tmp_path / "target"), "--tensor-parallel-size", "2"),
                *("--host", "127.0.0.1", "--port", "0", "--device", "cpu"),
                *("--proposer", f"127.0.0.1:{proposer_port}", "--num-speculative-tokens", "3", "--no-adaptive-k"),
                *("--max-model-len", "256", "--block-size", "4", "--max-num-seqs", "4"),
                *("--proposer-reconnect-max-s", "0.5"),
            ]
        )
        proposer = None
        try:
            proposer = await ProposerServer.start(
                ProposerConfig(
                    model=str(tmp_path / "draft"),
                    tensor_parallel_size=2,
                    host="127.0.0.1",
                    port=proposer_port,
                    device="cpu",
                    max_model_len=256,
                    block_size=4,
                    max_num_seqs=4,
                    max_k=4,
                )
            )
            await run_checks(proposer, verifier, references)
        finally:
            verifier.stop()
            if proposer is not None:
                if proposer.tp_runner is not None:
                    proposer.tp_runner.group.kill()
                await proposer.server.stop(0)

    asyncio.run(asyncio.wait_for(body(), 150))


async def generate(stub, prompt: list[int], max_tokens: int) -> list[int]:
    tokens: list[int] = []
    request = verifier_pb2.VerifierGenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True)
    async for msg in stub.Generate(request, timeout=60):
        tokens += msg.token_ids
    return tokens


async def run_checks(proposer: ProposerServer, verifier: Process, references: list[list[int]]) -> None:
    port = int((await verifier.wait_for(r"verifier serving .*port=(\d+)", 90)).group(1))
    worker_pid = int((await verifier.wait_for(r"tensor-parallel group ready .*worker_pids=(\d+)", 5)).group(1))
    assert proposer.tp_runner is not None and proposer.tp_runner.tensor_parallel_size == 2

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = verifier_pb2_grpc.VerifierStub(channel)
        for _ in range(300):  # the proposer came up in parallel: wait until the verifier is connected to it
            stats = await stub.GetStats(verifier_pb2.VerifierGetStatsRequest())
            if stats.stats.proposer_connected:
                break
            await asyncio.sleep(0.1)
        outputs = await asyncio.gather(*(generate(stub, p, MAX_TOKENS) for p in PROMPTS))
        assert outputs == references
        stats = await stub.GetStats(verifier_pb2.VerifierGetStatsRequest())
        assert stats.tensor_parallel_size == 2
        assert 0 < stats.stats.accepted_tokens < stats.stats.drafted_tokens  # the TP-2 proposer drafted

        # The proposer's rank 1 dies: the proposer fails over to exiting; the verifier decodes at k = 0.
        os.kill(proposer.tp_runner.group.worker_pids[0], signal.SIGKILL)
        await asyncio.wait_for(proposer.failed.wait(), 15)
        assert proposer.failure_reason is not None and "rank 1" in proposer.failure_reason
        assert await generate(stub, PROMPTS[0], MAX_TOKENS) == references[0]

        # The verifier's rank 1 dies during a request: UNAVAILABLE, and the verifier exits non-zero.
        call = stub.Generate(
            verifier_pb2.VerifierGenerateRequest(prompt_token_ids=PROMPTS[1], max_tokens=200, ignore_eos=True),
            timeout=60,
        )
        await call.read()
        os.kill(worker_pid, signal.SIGKILL)
        try:
            while await call.read() is not grpc.aio.EOF:
                pass
            raise AssertionError("the request finished although the verifier's rank died")
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err
    code = await asyncio.to_thread(verifier.proc.wait, 30)
    assert code != 0
    assert verifier.find(r"the verifier stops serving: tensor-parallel rank 1 .* exited with code -9")
