"""The eagle proposer over real grpc.aio on loopback with a tiny target: features travel only to it, equal
the target's own hidden states, and greedy output stays exact (batches, k, a killed proposer, a head made
for another target)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from proposer_service.builder import ProposerInfo
from proposer_service.config import ProposerConfig
from proposer_service.eagle import make_eagle_drafter
from proposer_service.server import ProposerServer
from shared.kv.cache import KVCache
from shared.model.eagle import arch_from_config, head_config, init_head_state, save_head
from shared.model.loader import build_model
from shared.model.runner import ForwardItem, ModelRunner
from shared.proto_gen.specdec.v1 import proposer_pb2, proposer_pb2_grpc, verifier_pb2_grpc
from tests.service.test_proposer_service import MAX_LEN, VOCAB, tiny_llama
from tests.service.test_verifier_service import (
    PROMPTS,
    collect,
    reference,
    request,
    rest,
    start_proposer,
    start_verifier,
    stats,
)

MIXED = [PROMPTS[i % 3] + [i + 1] * (i % 4) for i in range(8)]


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    arch, _ = tiny_llama()
    folder = tmp_path_factory.mktemp("head")
    config = head_config(arch, 1, 96)
    save_head(folder, config, init_head_state(arch_from_config(config), torch.arange(96) + 16, seed=3))
    return str(folder)


class Recording:
    """The eagle drafter, keeping every request it is given."""

    def __init__(self, inner) -> None:
        self.inner, self.requests = inner, []
        self.needs_target_features = True

    def propose(self, requests):
        self.requests += requests
        return self.inner.propose(requests)

    def release(self, seq_ids):
        self.inner.release(seq_ids)


async def start_eagle(head_dir: str, port: int = 0, hidden_size: int | None = None) -> ProposerServer:
    arch, state = tiny_llama()
    drafter = Recording(
        make_eagle_drafter(head_dir, state["model.embed_tokens.weight"], state["lm_head.weight"], 512, 8)
    )
    info = ProposerInfo("eagle", head_dir, VOCAB, "", 8, MAX_LEN, hidden_size or arch.hidden_size)
    return await ProposerServer.start(ProposerConfig(host="127.0.0.1", port=port, kind="eagle"), drafter, info)


def target_hidden(tokens: list[int]) -> torch.Tensor:
    """The target's final hidden states over a whole sequence, one prefill."""
    arch, state = tiny_llama()
    runner = ModelRunner(build_model(arch, state), KVCache(arch.num_layers, 64, 8, arch.num_kv_heads, arch.head_dim))
    _, hidden = runner.forward_with_hidden([ForwardItem(list(range(64)), 0, tokens, 1)])
    return hidden[0]


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 120))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_mixed_batch_greedy_is_exact_and_features_are_the_targets(head_dir, k):
    async def body():
        proposer = await start_eagle(head_dir)
        verifier = await start_verifier([f"127.0.0.1:{proposer.port}"], num_speculative_tokens=k, max_num_seqs=8)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                results = await asyncio.gather(*(collect(stub, request(p, 40)) for p in MIXED))
                for prompt, (tokens, _) in zip(MIXED, results, strict=True):
                    assert tokens == reference(tuple(prompt), 40)
                assert (await stats(stub)).drafted_tokens > 0
        finally:
            await verifier.shutdown(0.5)
            await proposer.shutdown(0.1)
        # Every block of features that arrived equals the target's hidden states at its positions (fp16).
        recorded = [r for r in proposer.servicer.drafter.requests if r.features is not None]
        assert recorded and all(r.features.shape[1] == 32 for r in recorded)
        history: dict[str, list[int]] = {}
        for r in proposer.servicer.drafter.requests:
            start = r.committed_len - len(r.new_token_ids)
            history[r.seq_id] = history.get(r.seq_id, [])[:start] + list(r.new_token_ids)
            if r.features is not None:
                expected = target_hidden(history[r.seq_id])[r.feature_start : r.feature_start + len(r.features)]
                torch.testing.assert_close(r.features, expected.half().float(), atol=1e-3, rtol=1e-3)

    run(body())


def test_proposer_killed_mid_stream_falls_back_exactly(head_dir):
    async def body():
        proposer = await start_eagle(head_dir)
        port = proposer.port
        verifier = await start_verifier([f"127.0.0.1:{port}"], step_delay_s=0.02)
        remote = verifier.proposer
        assert remote is not None and remote.needs_target_features
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                calls = [stub.Generate(request(p, 60), timeout=60) for p in PROMPTS[:2]]
                outputs: list[list[int]] = [[], []]
                for i, call in enumerate(calls):
                    outputs[i] += (await call.read()).token_ids
                await proposer.server.stop(0)
                for i, call in enumerate(calls):
                    for msg in await rest(call):
                        outputs[i] += msg.token_ids
                for prompt, out in zip(PROMPTS[:2], outputs, strict=True):
                    assert out == reference(tuple(prompt), 60)
                assert remote.fallback_steps > 0
                proposer = await start_eagle(head_dir, port)  # back on the same port: drafting resumes
                assert await remote.wait_connected(10)
                tokens, messages = await collect(stub, request(PROMPTS[2], 24))
                assert tokens == reference(tuple(PROMPTS[2]), 24)
                assert messages[-1].usage.drafted_tokens > 0
        finally:
            await verifier.shutdown(0.5)
            await proposer.shutdown(0.1)

    run(body())


def test_head_for_another_target_is_refused_and_decoding_goes_on(head_dir):
    async def body():
        proposer = await start_eagle(head_dir, hidden_size=16)
        verifier = await start_verifier([f"127.0.0.1:{proposer.port}"], wait=False)
        try:
            assert not await verifier.proposer.wait_connected(1.0)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                tokens, _ = await collect(verifier_pb2_grpc.VerifierStub(channel), request(PROMPTS[0], 16))
            assert tokens == reference(tuple(PROMPTS[0]), 16)
        finally:
            await verifier.shutdown(0.5)
            await proposer.shutdown(0.1)

    run(body())


def test_getinfo_asks_for_features_and_other_kinds_get_none(head_dir):
    async def body():
        proposer = await start_eagle(head_dir)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{proposer.port}") as channel:
                info = await proposer_pb2_grpc.ProposerStub(channel).GetInfo(proposer_pb2.GetInfoRequest())
            assert info.kind == proposer_pb2.PROPOSER_KIND_EAGLE and info.needs_target_features
            assert info.target_hidden_size == 32 and info.feature_dtype == proposer_pb2.FEATURE_DTYPE_FLOAT16
        finally:
            await proposer.shutdown(0.1)
        draft_model = await start_proposer()  # a proposer that does not ask: no features kept or sent
        verifier = await start_verifier([f"127.0.0.1:{draft_model.port}"])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                await collect(verifier_pb2_grpc.VerifierStub(channel), request(PROMPTS[0], 16))
            assert not verifier.loop.engine.keeps_features
            assert all(s.features is None for s in verifier.loop.engine.seqs.values())
        finally:
            await verifier.shutdown(0.5)
            await draft_model.shutdown(0.1)

    run(body())
