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
    kill_the_proposer_mid_generation,
    reference,
    request,
    start_proposer,
    start_verifier,
    stats,
)

MIXED = [PROMPTS[i % 3] + [i + 1] * (i % 4) for i in range(8)]
# An EAGLE-3 head reads these layers of the 2-layer target, in this order (not sorted: the order is the wire's).
FUSED_LAYERS = (1, 0, -1)


def make_head(folder, layers: tuple[int, ...] = (-1,)) -> str:
    arch, _ = tiny_llama()
    config = head_config(arch, 1, 96, layers)
    save_head(folder, config, init_head_state(arch_from_config(config), torch.arange(96) + 16, 3, layers))
    return str(folder)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return make_head(tmp_path_factory.mktemp("head"))


@pytest.fixture(scope="module")
def fused_head_dir(tmp_path_factory):
    return make_head(tmp_path_factory.mktemp("fused-head"), FUSED_LAYERS)


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
    inner = make_eagle_drafter(head_dir, state["model.embed_tokens.weight"], state["lm_head.weight"], 512, 8)
    drafter = Recording(inner)
    layers = inner.head.feature_layers
    info = ProposerInfo("eagle", head_dir, VOCAB, "", 8, MAX_LEN, hidden_size or arch.hidden_size, layers)
    return await ProposerServer.start(ProposerConfig(host="127.0.0.1", port=port, kind="eagle"), drafter, info)


def target_hidden(tokens: list[int], layers: tuple[int, ...] = (-1,)) -> torch.Tensor:
    """The target's hidden states of `layers` over a whole sequence, one prefill [len(tokens), n * hidden]."""
    arch, state = tiny_llama()
    runner = ModelRunner(build_model(arch, state), KVCache(arch.num_layers, 64, 8, arch.num_kv_heads, arch.head_dim))
    _, hidden = runner.forward_with_hidden([ForwardItem(list(range(64)), 0, tokens, 1)], layers)
    return hidden[0]


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 120))


@pytest.mark.parametrize("fused", [False, True], ids=["eagle1", "eagle3"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_mixed_batch_greedy_is_exact_and_features_are_the_targets(head_dir, fused_head_dir, k, fused):
    layers = FUSED_LAYERS if fused else (-1,)

    async def body():
        proposer = await start_eagle(fused_head_dir if fused else head_dir)
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
        # Every block of features that arrived equals the target's hidden states of the head's layers at its
        # positions (fp16), the layers side by side in the head's order.
        recorded = [r for r in proposer.servicer.drafter.requests if r.features is not None]
        assert recorded and all(r.features.shape[1] == 32 * len(layers) for r in recorded)
        history: dict[str, list[int]] = {}
        for r in proposer.servicer.drafter.requests:
            start = r.committed_len - len(r.new_token_ids)
            history[r.seq_id] = history.get(r.seq_id, [])[:start] + list(r.new_token_ids)
            if r.features is not None:
                expected = target_hidden(history[r.seq_id], layers)[r.feature_start : r.feature_start + len(r.features)]
                torch.testing.assert_close(r.features, expected.half().float(), atol=1e-3, rtol=1e-3)

    run(body())


@pytest.mark.parametrize(
    ("k", "nodes", "prompts", "fused"),
    [(3, 8, PROMPTS[:1], False), (4, 10, MIXED, False), (4, 10, MIXED, True)],
    ids=["batch-1", "mixed-8", "eagle3-mixed-8"],
)
def test_token_trees_over_grpc_are_exact(head_dir, fused_head_dir, k, nodes, prompts, fused):
    """The verifier asks for trees; the head (EAGLE-1 or EAGLE-3) drafts them (EAGLE-2's dynamic tree); the
    output is the target's."""

    async def body():
        proposer = await start_eagle(fused_head_dir if fused else head_dir)
        verifier = await start_verifier(
            [f"127.0.0.1:{proposer.port}"], num_speculative_tokens=k, max_num_seqs=8, max_tree_nodes=nodes
        )
        drafted = []
        drafter = proposer.servicer.drafter.inner
        propose = drafter.propose

        def spy(requests):
            drafts = propose(requests)
            drafted.extend(d for d in drafts if d.token_ids)
            return drafts

        drafter.propose = spy
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                results = await asyncio.gather(*(collect(stub, request(p, 40)) for p in prompts))
                for prompt, (tokens, _) in zip(prompts, results, strict=True):
                    assert tokens == reference(tuple(prompt), 40)
                s = await stats(stub)
                assert s.drafted_tokens > 0 and s.invalid_drafts == 0
        finally:
            await verifier.shutdown(0.5)
            await proposer.shutdown(0.1)
        assert drafted and all(d.parents is not None and len(d.token_ids) <= nodes for d in drafted)
        assert any(d.parents.count(-1) > 1 for d in drafted)  # branches under the root travelled

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
                await kill_the_proposer_mid_generation(stub, proposer)
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


def test_getinfo_asks_for_features_and_other_kinds_get_none(head_dir, fused_head_dir):
    async def body():
        for folder, layers in ((head_dir, [-1]), (fused_head_dir, list(FUSED_LAYERS))):
            proposer = await start_eagle(folder)
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{proposer.port}") as channel:
                    info = await proposer_pb2_grpc.ProposerStub(channel).GetInfo(proposer_pb2.GetInfoRequest())
                assert info.kind == proposer_pb2.PROPOSER_KIND_EAGLE and info.needs_target_features
                assert info.target_hidden_size == 32 and info.feature_dtype == proposer_pb2.FEATURE_DTYPE_FLOAT16
                assert list(info.target_feature_layers) == layers
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


def test_fused_head_batch_1_prefix_cache_and_preemption_stay_exact(fused_head_dir):
    """The EAGLE-3 head through gRPC: one sequence at a time, a second turn over the prefix cache (positions
    the verifier never computed, so no features: the head fills them), then 8 sequences in a KV cache too
    small for them (preemption and recompute)."""

    async def body():
        proposer = await start_eagle(fused_head_dir)
        verifier = await start_verifier([f"127.0.0.1:{proposer.port}"], num_speculative_tokens=3, max_num_seqs=1)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                first, _ = await collect(stub, request(PROMPTS[0], 24))
                assert first == reference(tuple(PROMPTS[0]), 24)
                second_turn = PROMPTS[0] + first + PROMPTS[1]
                tokens, messages = await collect(stub, request(second_turn, 24))
                assert tokens == reference(tuple(second_turn), 24)
                assert messages[-1].usage.drafted_tokens > 0
            assert verifier.loop.engine.scheduler.prefix_cache.hit_tokens > 0
        finally:
            await verifier.shutdown(0.5)
        verifier = await start_verifier(
            [f"127.0.0.1:{proposer.port}"], num_speculative_tokens=3, max_num_seqs=8, num_kv_blocks=12, max_model_len=80
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                results = await asyncio.gather(*(collect(stub, request(p, 40)) for p in MIXED))
                for prompt, (tokens, _) in zip(MIXED, results, strict=True):
                    assert tokens == reference(tuple(prompt), 40)
            assert verifier.loop.engine.scheduler.num_preemptions > 0
        finally:
            await verifier.shutdown(0.5)
            await proposer.shutdown(0.1)

    run(body())


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("another target", ["features of size 16", "trained for another target"]),
        ("layers not captured", ["target layers [1, 0, -1]", "--feature-layers"]),
    ],
)
def test_mismatched_head_is_refused_and_decoding_goes_on(head_dir, fused_head_dir, caplog, case, why):
    """A head for another target's hidden size, or an EAGLE-3 head whose layers this verifier does not
    capture (it keeps the final state only), is refused at connection with the reason, and the verifier
    decodes exactly without it."""

    async def body():
        if case == "another target":
            proposer = await start_eagle(head_dir, hidden_size=16)
            verifier = await start_verifier([f"127.0.0.1:{proposer.port}"], wait=False)
        else:
            proposer = await start_eagle(fused_head_dir)
            verifier = await start_verifier([f"127.0.0.1:{proposer.port}"], wait=False, feature_layers="-1")
        try:
            assert not await verifier.proposer.wait_connected(1.0)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                tokens, _ = await collect(verifier_pb2_grpc.VerifierStub(channel), request(PROMPTS[0], 16))
            assert tokens == reference(tuple(PROMPTS[0]), 16)
        finally:
            await verifier.shutdown(0.5)
            await proposer.shutdown(0.1)

    run(body())
    refusals = [r.getMessage() for r in caplog.records if "proposer refused" in r.getMessage()]
    assert refusals and all(part in refusals[0] for part in why), refusals
