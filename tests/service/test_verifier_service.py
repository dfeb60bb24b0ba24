"""The verifier service over real grpc.aio on loopback: tiny random-weight target, the same weights as draft.

Greedy output over gRPC must equal plain greedy decoding with our runner at k = 0 (an in-process Engine
without a drafter), whatever the proposer does: agree, disappear, answer late, stale or with garbage.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import math
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proposer_service.builder import ProposerInfo
from proposer_service.config import ProposerConfig
from proposer_service.server import ProposerServer
from shared.config import load_config
from shared.model.build import CacheConfig
from shared.model.loader import build_model
from shared.proto_gen.specdec.v1 import common_pb2, proposer_pb2, proposer_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from shared.sampling import SamplingParams
from tests.service.test_proposer_service import MAX_LEN, VOCAB, make_drafter, tiny_llama
from verifier_service.builder import build_engine
from verifier_service.config import VerifierConfig
from verifier_service.engine import EngineConfig
from verifier_service.server import VerifierServer

PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7], [100, 50, 25, 12, 6, 3, 1, 0, 127]]
G = common_pb2


@functools.cache
def reference(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """Plain greedy decoding with our runner, target alone (k = 0), one request at a time."""
    arch, state = tiny_llama()
    engine = build_engine(
        (build_model(arch, state), arch), None, EngineConfig(max_model_len=MAX_LEN), CacheConfig(block_size=8)
    )
    engine.add_request("ref", list(prompt), SamplingParams(max_tokens=max_tokens))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
    return out


def vconfig(proposers=(), **kw) -> VerifierConfig:
    kw.setdefault("max_model_len", MAX_LEN)
    kw.setdefault("block_size", 8)
    kw.setdefault("proposer_timeout_ms", 2000)
    kw.setdefault("proposer_reconnect_max_s", 0.3)
    kw.setdefault("adaptive_k", False)  # the draft here is as costly as the target: adaptive k would stop drafting
    kw.setdefault("warm_up", False)  # the tests count every step, draft and proposer message
    return VerifierConfig(host="127.0.0.1", port=0, proposer=tuple(proposers), **kw)


async def start_verifier(proposers=(), wait=True, step_delay_s=0.0, **kw) -> VerifierServer:
    arch, state = tiny_llama()
    server = await VerifierServer.start(
        vconfig(proposers, **kw), target=(build_model(arch, state), arch), model_name="tiny"
    )
    if proposers and server.proposer is not None and wait:
        await server.proposer.wait_connected(5)
    if step_delay_s:  # a slower engine, so that timing-dependent states last long enough to observe
        engine = server.loop.engine
        step = engine.step

        def slow_step():
            time.sleep(step_delay_s)
            return step()

        engine.step = slow_step  # type: ignore[method-assign]
    return server


async def start_proposer(port: int = 0) -> ProposerServer:
    info = ProposerInfo("draft-model", "tiny", VOCAB, "", 8, MAX_LEN)
    return await ProposerServer.start(ProposerConfig(host="127.0.0.1", port=port), make_drafter(), info)


def request(prompt, max_tokens=None, **kw) -> verifier_pb2.VerifierGenerateRequest:
    params = kw.pop("params", {})
    return verifier_pb2.VerifierGenerateRequest(
        prompt_token_ids=prompt, max_tokens=max_tokens, sampling_params=G.SamplingParams(**params), **kw
    )


async def collect(stub, req) -> tuple[list[int], list[verifier_pb2.VerifierGenerateResponse]]:
    tokens, messages = [], []
    async for msg in stub.Generate(req, timeout=60):
        tokens += msg.token_ids
        messages.append(msg)
    return tokens, messages


async def greedy_equals_reference(stub, prompts, max_tokens: int) -> None:
    """The prompts generated side by side, each equal to plain greedy decoding's (`reference`)."""
    results = await asyncio.gather(*(collect(stub, request(p, max_tokens)) for p in prompts))
    for prompt, (tokens, _) in zip(prompts, results, strict=True):
        assert tokens == reference(tuple(prompt), max_tokens)


async def rest(call) -> list[verifier_pb2.VerifierGenerateResponse]:
    """The remaining messages of a call already read with read() (grpc forbids mixing in async for)."""
    messages = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        messages.append(msg)
    return messages


async def kill_the_proposer_mid_generation(stub, proposer, before_kill=None) -> None:
    """Two 60-token streams of PROMPTS[:2]; once each has its first message (and `before_kill` has returned) the
    proposer stops; both streams must still finish with target-only decoding's tokens."""
    calls = [stub.Generate(request(p, 60), timeout=60) for p in PROMPTS[:2]]
    outputs: list[list[int]] = [[], []]
    for i, call in enumerate(calls):
        outputs[i] += (await call.read()).token_ids
    if before_kill is not None:
        await before_kill()
    await proposer.server.stop(0)
    for i, call in enumerate(calls):
        for msg in await rest(call):
            outputs[i] += msg.token_ids
    for prompt, out in zip(PROMPTS[:2], outputs, strict=True):
        assert out == reference(tuple(prompt), 60)


async def stats(stub) -> G.EngineStats:
    return (await stub.GetStats(verifier_pb2.VerifierGetStatsRequest())).stats


async def eventually(check, timeout=5.0):
    for _ in range(int(timeout / 0.02)):
        result = check() if not asyncio.iscoroutinefunction(check) else await check()
        if result:
            return result
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 60))


# ---- tests --------------------------------------------------------------------------------------


def test_greedy_over_grpc_with_the_target_as_draft_matches_plain_greedy():
    async def body():
        proposer = await start_proposer()
        verifier = await start_verifier([f"127.0.0.1:{proposer.port}"])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                results = await asyncio.gather(
                    *(collect(stub, request(p, 24, request_id=f"r{i}")) for i, p in enumerate(PROMPTS))
                )
                for prompt, (tokens, messages) in zip(PROMPTS, results, strict=True):
                    assert tokens == reference(tuple(prompt), 24)
                    last = messages[-1]
                    assert last.finish_reason == G.FINISH_REASON_LENGTH
                    assert all(m.finish_reason == G.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
                    assert not any(m.HasField("usage") for m in messages[:-1])
                    u = last.usage
                    assert (u.prompt_tokens, u.completion_tokens) == (len(prompt), 24)
                    assert u.num_steps == len([m for m in messages if m.token_ids]) < 24  # several tokens a step
                    assert u.accepted_tokens >= 0.9 * u.drafted_tokens > 0  # draft == target: (nearly) all accepted
                    assert math.isclose(u.tokens_per_step, 24 / u.num_steps)
                    assert u.mean_accepted_length == u.tokens_per_step  # the deprecated name, still filled
                    # Every message carries the running counts (the gateway's share of a segment cut by a crash).
                    drafted = [m.drafted_tokens for m in messages]
                    assert drafted == sorted(drafted) and drafted[0] < drafted[-1] == u.drafted_tokens
                    assert messages[-1].accepted_tokens == u.accepted_tokens
                s = await stats(stub)
                assert s.proposer_connected and s.acceptance_rate >= 0.9 and s.drafted_tokens > 0
                assert s.emitted_tokens == 72 and s.finished_requests == 3 and s.aborted_requests == 0
                assert math.isclose(s.tokens_per_step, s.emitted_tokens / s.sequence_steps)
                assert s.mean_accepted_length == s.tokens_per_step  # the deprecated name, still filled
                assert 0 < s.draft_rounds <= s.sequence_steps
                assert math.isclose(s.tokens_per_draft_round, 1 + s.accepted_tokens / s.draft_rounds)
                assert s.kv_blocks_free == s.kv_blocks_total and s.kv_blocks_used == 0 and s.kv_block_size == 8
                info = await stub.GetStats(verifier_pb2.VerifierGetStatsRequest())
                assert (info.model, info.max_model_len, info.vocab_size, info.tensor_parallel_size) == (
                    "tiny",
                    MAX_LEN,
                    VOCAB,
                    1,
                )
                # max_draft_tokens = 0 turns speculation off for one request; the output is the same.
                tokens, messages = await collect(stub, request(PROMPTS[0], 10, max_draft_tokens=0))
                assert tokens == reference(tuple(PROMPTS[0]), 10) and messages[-1].usage.drafted_tokens == 0
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="specdec.v1.Verifier")
                )
                assert health.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await verifier.shutdown(0.5)
            await proposer.shutdown(0.1)

    run(body())


def test_without_a_proposer_the_target_decodes_alone():
    async def body():
        verifier = await start_verifier()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                tokens, messages = await collect(stub, request(PROMPTS[2], 12))
                assert tokens == reference(tuple(PROMPTS[2]), 12)
                assert len(messages) == 12 and messages[-1].usage.drafted_tokens == 0
                # a stop token ends the request with STOP and names it
                stop = reference(tuple(PROMPTS[2]), 12)[4]
                tokens, messages = await collect(stub, request(PROMPTS[2], 12, stop_token_ids=[stop]))
                assert tokens[-1] == stop and messages[-1].finish_reason == G.FINISH_REASON_STOP
                assert messages[-1].stop_token_id == stop
                s = await stats(stub)
                assert not s.proposer_connected and s.drafted_tokens == 0
        finally:
            await verifier.shutdown(0.5)

    run(body())


def test_proposer_killed_mid_generation_requests_finish_exactly_and_it_reconnects():
    async def body():
        proposer = await start_proposer()
        port = proposer.port
        verifier = await start_verifier([f"127.0.0.1:{port}"], step_delay_s=0.02)
        remote = verifier.proposer
        assert remote is not None
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                await kill_the_proposer_mid_generation(stub, proposer)
                assert remote.fallback_steps > 0 and not (await stats(stub)).proposer_connected
                # it comes back on the same port: the verifier reconnects and speculates again
                proposer = await start_proposer(port)
                assert await remote.wait_connected(10)
                tokens, messages = await collect(stub, request(PROMPTS[2], 16))
                assert tokens == reference(tuple(PROMPTS[2]), 16)
                assert messages[-1].usage.accepted_tokens > 0
        finally:
            await verifier.shutdown(0.5)
            await proposer.shutdown(0.1)

    run(body())


def test_one_late_reply_keeps_the_stream_and_the_proposers_state():
    """A reply past the deadline costs that step its drafts (k = 0), nothing more: the stream stays, the late
    reply is discarded by step id, and no sequence is resent in full (a resend would make a long prompt's
    catch-up time out again)."""

    async def body():
        drafter = make_drafter()
        seen: list[tuple[str, int, int]] = []  # (seq_id, committed_len, new tokens) as the proposer got them
        propose = drafter.propose
        calls = {"n": 0}

        def slow_once(requests):
            calls["n"] += 1
            seen.extend((r.seq_id, r.committed_len, len(r.new_token_ids)) for r in requests)
            if calls["n"] == 4:
                # Past the verifier's 1 s deadline, once, and done long before the next step's: on CI's loaded
                # 2-core machine a 300 ms deadline against a 450 ms sleep once timed out twice.
                time.sleep(1.2)
            return propose(requests)

        drafter.propose = slow_once  # type: ignore[method-assign]
        info = ProposerInfo("draft-model", "tiny", VOCAB, "", 8, MAX_LEN)
        proposer = await ProposerServer.start(ProposerConfig(host="127.0.0.1", port=0), drafter, info)
        verifier = await start_verifier([f"127.0.0.1:{proposer.port}"], proposer_timeout_ms=1000)
        remote = verifier.proposer
        assert remote is not None
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                tokens, messages = await collect(stub, request(PROMPTS[2], 40))
                assert tokens == reference(tuple(PROMPTS[2]), 40)
                assert remote.timeouts == 1 and remote.connections == 1 and remote.connected
                full_sends = [s for s in seen if s[2] == s[1]]  # every committed token sent again
                assert len(full_sends) == 1, seen  # only the first, never after the late reply
                assert messages[-1].usage.accepted_tokens > 0  # drafting went on after it
        finally:
            await verifier.shutdown(0.5)
            await proposer.shutdown(0.1)

    run(body())


class FakeProposer(proposer_pb2_grpc.ProposerServicer):
    """Misbehaves in turn: stale committed_len, out-of-vocabulary ids, wrong (valid) drafts, late answers."""

    def __init__(self, vocab_size=VOCAB) -> None:
        self.vocab_size = vocab_size
        self.steps = 0

    async def GetInfo(self, request, context):
        return proposer_pb2.GetInfoResponse(
            kind=proposer_pb2.PROPOSER_KIND_DRAFT_MODEL, vocab_size=self.vocab_size, max_k=8
        )

    async def Propose(self, request_iterator, context):
        async for req in request_iterator:
            self.steps += 1
            mode = self.steps % 4
            if mode == 3 and self.steps < 8:
                await asyncio.sleep(0.5)  # past the verifier's deadline
            drafts = []
            for s in req.sequences:
                ids = [(s.committed_len * 7 + i) % VOCAB for i in range(s.k)]
                if mode == 0:
                    drafts.append(
                        proposer_pb2.Draft(seq_id=s.seq_id, committed_len=s.committed_len - 1, draft_token_ids=ids)
                    )
                elif mode == 1:
                    drafts.append(
                        proposer_pb2.Draft(
                            seq_id=s.seq_id, committed_len=s.committed_len, draft_token_ids=[VOCAB + 5] * s.k
                        )
                    )
                else:
                    drafts.append(
                        proposer_pb2.Draft(seq_id=s.seq_id, committed_len=s.committed_len, draft_token_ids=ids)
                    )
            yield proposer_pb2.ProposeResponse(step_id=req.step_id, drafts=drafts)


async def start_fake(fake) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    proposer_pb2_grpc.add_ProposerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def test_stale_garbage_and_late_drafts_never_change_the_output():
    async def body():
        fake_server, port = await start_fake(FakeProposer())
        verifier = await start_verifier([f"127.0.0.1:{port}"], proposer_timeout_ms=200)
        remote = verifier.proposer
        assert remote is not None
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                await greedy_equals_reference(stub, PROMPTS, 30)
                assert verifier.loop.engine.stats.stale_drafts > 0  # wrong committed_len: discarded
                assert remote.invalid_drafts > 0  # ids outside the vocabulary: discarded
                assert remote.timeouts > 0 and remote.fallback_steps > 0  # late: k = 0 for that step
                assert (await stats(stub)).drafted_tokens > 0  # wrong but valid drafts were scored (and rejected)
        finally:
            await verifier.shutdown(0.5)
            await fake_server.stop(0)

    run(body())


class PlacedProposer(FakeProposer):
    """States where it runs (host id, cores) and records every sequence it is sent; drafts nothing."""

    def __init__(self, host: str, cpus: list[int]) -> None:
        super().__init__()
        self.host, self.cpus = host, cpus
        self.sent: list[int] = []  # new tokens per sequence message

    async def GetInfo(self, request, context):
        info = await super().GetInfo(request, context)
        info.host_id, info.cpus[:] = self.host, self.cpus
        return info

    async def Propose(self, request_iterator, context):
        async for req in request_iterator:
            self.sent += [len(s.new_token_ids) for s in req.sequences]
            yield proposer_pb2.ProposeResponse(step_id=req.step_id)


def test_a_proposer_sharing_the_verifiers_cores_does_not_follow_plain_sequences():
    """Co-located on a CPU host, what the proposer does beside the verifier's forward slows it: a verifier whose
    proposer states this machine and overlapping cores does not send it the sequences that decode with k = 0
    (a later draft request carries the catch-up); one on other cores, or another machine, follows them k
    tokens at a time as before. The output is the target's either way."""
    from shared.placement import cpu_set, host_id

    mine = sorted(cpu_set())
    elsewhere = [("other-machine", mine), ("", mine)]
    if mine:
        elsewhere.append((host_id(), [max(mine) + 1]))  # this machine, other cores (taskset)

    async def followed(host: str, cpus: list[int]) -> tuple[bool, list[int]]:
        fake = PlacedProposer(host, cpus)
        fake_server, port = await start_fake(fake)
        verifier = await start_verifier([f"127.0.0.1:{port}"], num_speculative_tokens=4)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                tokens, _ = await collect(stub, request(PROMPTS[1], 21, max_draft_tokens=0))
                assert tokens == reference(tuple(PROMPTS[1]), 21)
            assert verifier.proposer is not None
            return verifier.proposer.follows_plain, fake.sent
        finally:
            await verifier.shutdown(0.5)
            await fake_server.stop(0)

    async def body():
        follows, sent = await followed(host_id(), mine)
        assert not follows and sent == []
        for host, cpus in elsewhere:
            follows, sent = await followed(host, cpus)
            assert follows and len(sent) >= 21 // 4 and all(n == 4 for n in sent[1:]), (host, cpus, sent)

    run(body())


class SlowIngestProposer(PlacedProposer):
    """Takes a second to answer a message that drafts nothing (a prompt's chunk, a followed sequence)."""

    async def Propose(self, request_iterator, context):
        async for req in request_iterator:
            self.sent += [len(s.new_token_ids) for s in req.sequences]
            if not any(s.k for s in req.sequences):
                await asyncio.sleep(1.0)
            yield proposer_pb2.ProposeResponse(step_id=req.step_id)


def test_a_prompts_chunks_go_to_a_proposer_without_waiting_and_not_to_one_on_our_cores():
    """A prompt prefilled in chunks: the proposer ingests the chunks alongside the target, but the verifier does
    not wait for it (it waited for every chunk's reply, on the time to first token), and a proposer on this
    machine's cores is sent none (the first draft request carries the prompt)."""
    from shared.placement import cpu_set, host_id

    prompt = PROMPTS[2]  # 9 tokens: chunks of 4, 4 and the last one, which samples

    async def chunks_sent(host: str, cpus: list[int]) -> tuple[list[int], float]:
        fake = SlowIngestProposer(host, cpus)
        fake_server, port = await start_fake(fake)
        verifier = await start_verifier([f"127.0.0.1:{port}"], num_speculative_tokens=4, max_num_batched_tokens=4)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                started = time.monotonic()
                tokens, _ = await collect(stub, request(prompt, 2, max_draft_tokens=0))
                elapsed = time.monotonic() - started
                assert tokens == reference(tuple(prompt), 2)
            await asyncio.sleep(2.5)  # what was sent without waiting has arrived (a second a message)
            return fake.sent, elapsed
        finally:
            await verifier.shutdown(0.5)
            await fake_server.stop(0)

    async def body():
        sent, elapsed = await chunks_sent("other-machine", sorted(cpu_set()))
        assert sent[:2] == [4, 4] and elapsed < 1.0, (sent, elapsed)  # two chunks sent, neither waited for
        sent, _ = await chunks_sent(host_id(), sorted(cpu_set()))
        assert sent == []

    run(body())


def test_a_proposer_with_another_vocabulary_is_refused():
    async def body():
        fake_server, port = await start_fake(FakeProposer(vocab_size=VOCAB * 2))
        verifier = await start_verifier([f"127.0.0.1:{port}"], wait=False)
        try:
            assert verifier.proposer is not None and not await verifier.proposer.wait_connected(0.5)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                tokens, _ = await collect(stub, request(PROMPTS[0], 8))
                assert tokens == reference(tuple(PROMPTS[0]), 8)
                assert not (await stats(stub)).proposer_connected
        finally:
            await verifier.shutdown(0.5)
            await fake_server.stop(0)

    run(body())


def test_sampled_requests_are_reproducible_with_a_seed():
    async def body():
        proposer = await start_proposer()
        verifier = await start_verifier([f"127.0.0.1:{proposer.port}"])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                params = {"temperature": 0.8, "top_p": 0.95, "seed": 7}
                first, m1 = await collect(stub, request(PROMPTS[0], 20, params=params))
                second, _ = await collect(stub, request(PROMPTS[0], 20, params=params))
                assert first == second and len(first) == 20
                assert 0 < m1[-1].usage.accepted_tokens <= m1[-1].usage.drafted_tokens
                # A resume (prompt + emitted, output_offset = emitted) continues the same text, drafts or not.
                resumed, _ = await collect(
                    stub, request(PROMPTS[0] + first[:8], 12, params=params, output_offset=8, max_draft_tokens=0)
                )
                assert first[:8] + resumed == first
        finally:
            await verifier.shutdown(0.5)
            await proposer.shutdown(0.1)

    run(body())


def test_the_remote_proposer_sends_the_draft_position_and_the_tenant():
    """Seeded drafts need the output position of the first draft token (ProposeSequence.draft_position); a
    drafter that remembers text across requests needs each sequence's tenant."""
    from shared.drafting import DraftRequest
    from verifier_service.remote_proposer import RemoteProposer

    params = SamplingParams(temperature=0.8, seed=3)
    requests = [
        DraftRequest("s", 3, [1, 2, 3], 2, params, draft_position=7, tenant="alice"),
        DraftRequest("t", 2, [4, 5], 2),
    ]
    msg = RemoteProposer(["127.0.0.1:1"], vocab_size=VOCAB)._build_request(requests)
    assert [s.draft_position for s in msg.sequences] == [7, 0]
    assert [s.tenant for s in msg.sequences] == ["alice", ""]


def test_a_trees_node_price_travels_to_the_proposer_and_a_chain_carries_none():
    """The policy's price of a scored node (DraftRequest.min_node_prob) goes with a tree request
    (ProposeSequence.min_tree_node_prob) and comes out of the proposer's servicer as it went in; a chain's request
    carries none, and a value no drafter could use (negative, NaN) is read as none."""
    from proposer_service.server import ProposerServicer, _StreamState
    from shared.drafting import DraftRequest
    from verifier_service.remote_proposer import RemoteProposer

    requests = [
        DraftRequest("tree", 3, [1, 2, 3], 4, max_tree_nodes=8, min_node_prob=0.0625),
        DraftRequest("chain", 2, [4, 5], 4, min_node_prob=0.0625),
    ]
    msg = RemoteProposer(["127.0.0.1:1"], vocab_size=VOCAB)._build_request(requests)
    assert [s.min_tree_node_prob for s in msg.sequences] == [0.0625, 0.0]
    servicer = ProposerServicer(None, ProposerInfo("eagle", max_k=8))  # type: ignore[arg-type]
    stream = _StreamState(1, set(), set())
    assert servicer._to_domain(msg.sequences[0], stream).min_node_prob == 0.0625
    for bad in (-0.5, float("nan")):
        msg.sequences[0].min_tree_node_prob = bad
        assert servicer._to_domain(msg.sequences[0], stream).min_node_prob == 0.0


BAD_REQUESTS = [
    (request([], 5), "empty"),
    (request(list(range(1, 100)) * 3, 5), "context limit"),
    (request([1, 2], 0), "max_tokens"),
    (request([1, 2], MAX_LEN + 1), "max_tokens"),
    (request([1, 2], 5, params={"temperature": -0.5}), "temperature"),
    (request([1, 2], 5, params={"temperature": float("nan")}), "temperature"),
    (request([1, 2], 5, params={"top_p": 0.0}), "top_p"),
    (request([1, 2], 5, params={"top_p": 1.5}), "top_p"),
    (request([1, 2], 5, params={"top_k": -1}), "top_k"),
    (request([1, 2], 5, params={"min_p": 2.0}), "min_p"),
    (request([1, VOCAB], 5), "vocabulary"),
    (request([-1, 2], 5), "vocabulary"),
    (request([1, 2], 5, stop_token_ids=[VOCAB + 1]), "stop_token_ids"),
    (request([1, 2], 5, request_id="x" * 129), "limit is 128"),
    (request([1, 2], 5, request_id="a\nlevel=ERROR forged=1"), "only letters"),
]


def test_bad_input_is_invalid_argument_and_does_not_disturb_a_running_request():
    async def body():
        verifier = await start_verifier()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                long = stub.Generate(request(PROMPTS[1], 40, request_id="long"), timeout=60)
                tokens = list((await long.read()).token_ids)
                for bad, words in BAD_REQUESTS:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await collect(stub, bad)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, words
                    assert words in (err.value.details() or ""), err.value.details()
                # The caller's id is not the engine's key: a second request with the same id is no collision.
                same_id, _ = await collect(stub, request(PROMPTS[0], 6, request_id="long"))
                assert same_id == reference(tuple(PROMPTS[0]), 6)
                for msg in await rest(long):
                    tokens += msg.token_ids
                assert tokens == reference(tuple(PROMPTS[1]), 40)
                s = await stats(stub)
                assert s.kv_blocks_free == s.kv_blocks_total and s.finished_requests == 2
        finally:
            await verifier.shutdown(0.5)

    run(body())


def test_an_internal_failure_is_internal_for_the_client_and_its_traceback_is_in_the_log(caplog):
    async def body():
        verifier = await start_verifier()

        async def broken(*args):
            raise RuntimeError("secret detail /srv/internal")

        verifier.loop._build_grammar = broken
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await collect(verifier_pb2_grpc.VerifierStub(channel), request(PROMPTS[0], 6))
                assert err.value.code() == grpc.StatusCode.INTERNAL and "secret" not in err.value.details()
        finally:
            await verifier.shutdown(0.5)

    run(body())
    assert "secret detail /srv/internal" in caplog.text and "Traceback" in caplog.text  # where the message says


def test_a_queued_request_gets_keepalives_while_the_engine_serves_others():
    """One sequence at a time: the second request waits for the first to finish and, meanwhile, receives empty
    messages (the engine is stepping), so a gateway does not take it for a hung stream; its tokens are unchanged."""

    async def body():
        # Steps of ~25 ms against keep-alives every 150 ms: a running request's gap between steps stays well under
        # the interval even on a slow, shared machine (at 50 ms one step in ~30 crossed it there), while the
        # waiting one, queued behind 30 steps, still sees several.
        verifier = await start_verifier(max_num_seqs=1, keepalive_interval_s=0.15, step_delay_s=0.02)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                first = asyncio.create_task(collect(stub, request(PROMPTS[0], 30)))
                await asyncio.sleep(0.2)  # the first one runs
                tokens, messages = await collect(stub, request(PROMPTS[1], 10))
                running_tokens, running_messages = await first
                assert tokens == reference(tuple(PROMPTS[1]), 10)
                assert running_tokens == reference(tuple(PROMPTS[0]), 30)
                waiting = list(itertools.takewhile(lambda m: not m.token_ids, messages))
                assert len(waiting) >= 2, "no keep-alive while the request waited"
                assert all(m.finish_reason == G.FINISH_REASON_UNSPECIFIED and not m.HasField("usage") for m in waiting)
                assert all(m.token_ids for m in running_messages[:-1]), "a running request got a keep-alive"
        finally:
            await verifier.shutdown(0.5)

    run(body())


def test_queue_full_is_resource_exhausted_and_cancel_frees_kv_blocks():
    async def body():
        verifier = await start_verifier(max_num_seqs=1, max_waiting=1, step_delay_s=0.01)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                running = stub.Generate(request(PROMPTS[0], 200), timeout=60)
                await running.read()
                waiting = stub.Generate(request(PROMPTS[1], 200), timeout=60)
                await eventually(lambda: verifier.loop.engine.scheduler.waiting)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await collect(stub, request(PROMPTS[2], 5))
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                s = await stats(stub)
                assert (s.running_requests, s.waiting_requests) == (1, 1) and s.kv_blocks_free < s.kv_blocks_total
                running.cancel()  # the client goes away: its blocks come back, the waiting one runs
                await waiting.read()
                waiting.cancel()

                async def all_free():
                    s = await stats(stub)
                    return s.kv_blocks_free == s.kv_blocks_total and s.running_requests == s.waiting_requests == 0

                await eventually(all_free)
                s = await stats(stub)
                assert s.aborted_requests == 2 and s.finished_requests == 0
                # the engine still serves correctly afterwards
                tokens, _ = await collect(stub, request(PROMPTS[2], 6))
                assert tokens == reference(tuple(PROMPTS[2]), 6)
        finally:
            await verifier.shutdown(0.5)

    run(body())


def test_shutdown_drains_then_aborts_and_refuses_new_requests():
    async def body():
        verifier = await start_verifier(step_delay_s=0.01)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            long = stub.Generate(request(PROMPTS[0], 200), timeout=60)
            short = stub.Generate(request(PROMPTS[1], 4), timeout=60)
            await long.read()
            shutdown = asyncio.create_task(verifier.shutdown(0.8))
            await asyncio.sleep(0.2)
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, request(PROMPTS[2], 3))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            short_msgs = await rest(short)
            assert short_msgs[-1].finish_reason == G.FINISH_REASON_LENGTH  # finished within the grace period
            # Past the grace period: UNAVAILABLE, which the gateway resumes elsewhere (an ABORT finish would
            # end the client's answer there), after the tokens streamed so far.
            produced = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while (msg := await long.read()) is not grpc.aio.EOF:
                    assert msg.finish_reason == G.FINISH_REASON_UNSPECIFIED
                    produced += msg.token_ids
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "resume" in (err.value.details() or "")
            assert produced  # it was still streaming when the grace period ran out
            await shutdown

    run(body())


def test_the_engine_steps_on_while_the_event_loop_is_busy_streaming():
    """Steps follow one another on the step thread: one waits neither for the event loop to hand it over nor for
    a sleeping thread to wake (about 1 ms a step, measured), and the event loop streams the last step's tokens
    beside the next. Blocking the event loop therefore stops the streaming, not the engine."""

    async def body():
        verifier = await start_verifier(step_delay_s=0.005)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            running = stub.Generate(request(PROMPTS[0], 200), timeout=30)
            await running.read()
            before = verifier.loop.engine.stats.steps
            time.sleep(0.3)  # the event loop is busy: nothing is handed to the step thread meanwhile
            stepped = verifier.loop.engine.stats.steps - before
            assert stepped >= 10, f"{stepped} steps while the event loop was busy for 0.3 s"
            msgs = await rest(running)
            tokens = sum(len(m.token_ids) for m in msgs)
            assert msgs[-1].finish_reason == G.FINISH_REASON_LENGTH and tokens == 199  # every token arrived
        await verifier.shutdown(0.5)

    run(body())


def test_a_dead_engine_loop_fails_its_requests_unavailable_and_stops_serving():
    """A bug outside engine.step (here: in dispatching a step's outputs) must not leave streams hanging behind
    a SERVING health status."""

    async def body():
        verifier = await start_verifier(step_delay_s=0.01)
        loop = verifier.loop

        def broken_dispatch(outputs):
            raise RuntimeError("a bug in dispatch")

        async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            running = stub.Generate(request(PROMPTS[0], 100), timeout=30)
            await running.read()
            loop._dispatch = broken_dispatch  # type: ignore[method-assign]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await rest(running)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            status = (await health.Check(health_pb2.HealthCheckRequest())).status
            for _ in range(100):
                if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.02)
                status = (await health.Check(health_pb2.HealthCheckRequest())).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, request(PROMPTS[1], 3))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert (await stats(stub)).kv_blocks_free == (await stats(stub)).kv_blocks_total
        await verifier.shutdown(0.2)

    run(body())


def test_a_stalled_reader_is_ended_and_its_blocks_freed_while_others_run_on():
    async def body():
        from shared.errors import ReaderStalledError
        from shared.sampling import SamplingParams

        verifier = await start_verifier(step_delay_s=0.005)
        loop = verifier.loop
        loop.max_buffered_updates = 3
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                other = asyncio.create_task(collect(stub, request(PROMPTS[1], 30)))
                updates = loop.generate("slow-reader", list(PROMPTS[0]), SamplingParams(max_tokens=100))
                first = await updates.__anext__()
                assert first.token_ids
                await asyncio.sleep(0.5)  # the reader stops; the engine goes on stepping
                with pytest.raises(ReaderStalledError, match="stopped reading"):
                    async for _ in updates:
                        pass
                tokens, _ = await other
                assert tokens == reference(tuple(PROMPTS[1]), 30)
                s = await stats(stub)
                assert s.kv_blocks_free == s.kv_blocks_total and s.running_requests == 0
        finally:
            await verifier.shutdown(0.2)

    run(body())


def test_config_reads_flags_and_env(monkeypatch):
    monkeypatch.setenv("SPECDEC_NUM_SPECULATIVE_TOKENS", "6")
    monkeypatch.setenv("SPECDEC_PROPOSER", "a:1, b:2")
    cfg = load_config(VerifierConfig, ["--model", "m", "--port", "9", "--max-waiting", "3"])
    assert (cfg.model, cfg.port, cfg.max_waiting, cfg.num_speculative_tokens) == ("m", 9, 3, 6)
    assert cfg.proposer == ("a:1", "b:2")
    assert load_config(VerifierConfig, ["--proposer", "h:50053", "--num-speculative-tokens", "2"]).proposer == (
        "h:50053",
    )
    assert load_config(VerifierConfig, ["--proposer", ""]).proposer == ()
    assert load_config(VerifierConfig, ["--no-adaptive-k"]).adaptive_k is False
    for argv in (["--tensor-parallel-size", "0"], ["--proposer", "nohost"], ["--max-model-len", "0"]):
        with pytest.raises(SystemExit):
            load_config(VerifierConfig, argv)


def test_serve_loads_the_model_from_disk_and_exits_on_sigterm(tmp_path):
    """The CLI path: load_config -> serve(): loads --model from a folder, serves, drains on SIGTERM."""
    import json
    import os
    import signal

    from safetensors.torch import save_file

    from verifier_service.server import serve

    arch, state = tiny_llama()
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": VOCAB,
                "hidden_size": arch.hidden_size,
                "intermediate_size": arch.intermediate_size,
                "num_hidden_layers": arch.num_layers,
                "num_attention_heads": arch.num_heads,
                "num_key_value_heads": arch.num_kv_heads,
                "max_position_embeddings": MAX_LEN,
                "rms_norm_eps": arch.rms_norm_eps,
                "tie_word_embeddings": False,
            }
        )
    )
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    config = load_config(
        VerifierConfig,
        [
            "--model",
            str(tmp_path),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--max-model-len",
            str(MAX_LEN),
            "--block-size",
            "8",
            "--grace-period-s",
            "2",
            "--device",
            "cpu",
        ],
    )
    outcome: dict = {}

    def on_ready(server: VerifierServer) -> None:
        outcome["frozen"] = gc.get_freeze_count()  # the start-up heap, frozen before serving (shared/gc_tuning.py)

        async def client() -> None:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                call = stub.Generate(request(PROMPTS[0], 12), timeout=30)
                first = await call.read()
                os.kill(os.getpid(), signal.SIGTERM)  # the running request still finishes within the grace period
                outcome["tokens"] = list(first.token_ids) + [t for m in await rest(call) for t in m.token_ids]

        outcome["task"] = asyncio.get_running_loop().create_task(client())

    async def main() -> None:
        await serve(config, on_ready)
        await outcome["task"]

    try:
        run(main())
    finally:
        gc.unfreeze()  # this test process's heap goes back to the collector
    assert outcome["tokens"] == reference(tuple(PROMPTS[0]), 12)
    assert outcome["frozen"] > 10_000


def test_each_service_builds_and_runs_its_model_on_one_thread(monkeypatch):
    """libgomp keeps a team of OpenMP workers per thread that runs parallel torch work and stops letting them spin
    once a process holds more such threads than CPUs (verifier_service/engine_loop.py): the verifier builds its
    engine and runs every step on one thread, the proposer builds its drafter and drafts on one, in a thread of its
    own (asyncio.to_thread's pool ran steps on two threads in turn: 62 ms a step instead of ~43 on two cores)."""
    import threading

    from proposer_service import server as proposer_server
    from verifier_service import builder

    threads: dict[str, list[int]] = {"build": [], "step": [], "draft build": [], "draft": []}

    def recorded(key, fn):
        def call(*args, **kwargs):
            threads[key].append(threading.get_ident())
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(builder, "build_service_engine", recorded("build", builder.build_service_engine))
    info = ProposerInfo("draft-model", "tiny", VOCAB, "", 8, MAX_LEN)
    build_drafter = recorded("draft build", lambda config: (make_drafter(), info))
    monkeypatch.setattr(proposer_server, "build_drafter", build_drafter)

    async def body():
        proposer = await ProposerServer.start(ProposerConfig(host="127.0.0.1", port=0))
        drafter = proposer.servicer.drafter
        drafter.propose = recorded("draft", drafter.propose)  # type: ignore[method-assign]
        verifier = await start_verifier([f"127.0.0.1:{proposer.port}"])
        engine = verifier.loop.engine
        engine.step = recorded("step", engine.step)  # type: ignore[method-assign]
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                for i in range(2):  # one after the other, so that the step thread idles between them
                    tokens, _ = await collect(stub, request(PROMPTS[i], 12))
                    assert tokens == reference(tuple(PROMPTS[i]), 12)
        finally:
            await verifier.shutdown(0.5)
            await proposer.shutdown(0.5)

    run(body())
    assert len(threads["step"]) > 4 and threads["draft"], threads
    assert set(threads["build"] + threads["step"]) == {threads["build"][0]}
    assert set(threads["draft build"] + threads["draft"]) == {threads["draft build"][0]}
    assert threads["build"][0] != threads["draft build"][0]
