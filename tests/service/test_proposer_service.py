"""The proposer service over real grpc.aio on loopback, with a tiny random-weight draft model."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from proposer_service.builder import ProposerInfo, build_drafter
from proposer_service.config import ProposerConfig
from proposer_service.draft_model import DraftModelDrafter
from proposer_service.ngram import NgramDrafter
from proposer_service.server import ProposerServer
from shared.config import load_config
from shared.draft_codec import unpack_draft
from shared.drafting import Draft, DraftRequest
from shared.grammar import GrammarCompiler, StructuredOutput, allowed_tokens
from shared.kv.block_manager import BlockManager
from shared.model.build import CacheConfig, make_runner
from shared.model.config import ModelArch
from shared.model.loader import build_model
from shared.proto_convert import sampling_params_to_proto
from shared.proto_gen.specdec.v1 import common_pb2, proposer_pb2, proposer_pb2_grpc
from shared.sampling import SamplingParams
from specdec_local.builder import make_draft_model_drafter
from tests.draft_forms import sparse_to_dense_draft_probs
from verifier_service.engine import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 128
MAX_LEN = 256


@functools.cache
def tiny_llama(seed: int = 0, vocab: int = VOCAB) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    """A random-weight Llama in transformers' parameter names (no transformers import: it is slow here)."""
    arch = ModelArch(
        vocab_size=vocab,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        rms_norm_eps=1e-6,
        max_position_embeddings=MAX_LEN,
        tie_word_embeddings=False,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    )
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.2  # spread-out logits: no near-ties in greedy checks

    h, q, kv, f = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    state = {
        "model.embed_tokens.weight": rand(vocab, h),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": rand(vocab, h),
    }
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": (q, h),
            "self_attn.k_proj": (kv, h),
            "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q),
            "mlp.gate_proj": (f, h),
            "mlp.up_proj": (f, h),
            "mlp.down_proj": (h, f),
        }
        state.update({f"{p}{name}.weight": rand(*shape) for name, shape in shapes.items()})
        state[f"{p}input_layernorm.weight"] = torch.ones(h)
        state[f"{p}post_attention_layernorm.weight"] = torch.ones(h)
    return arch, state


def make_drafter(seed: int = 0) -> DraftModelDrafter:
    arch, state = tiny_llama(seed)
    sizing = EngineConfig(num_speculative_tokens=8, max_num_seqs=8, max_model_len=MAX_LEN)
    return make_draft_model_drafter(build_model(arch, state), arch, sizing, CacheConfig(block_size=8), top_n=16)


def make_grammar_drafter(compiler: GrammarCompiler) -> DraftModelDrafter:
    """The tiny draft over the real tokenizer's vocabulary, with the format compiler build_drafter gives it."""
    arch, state = tiny_llama(0, compiler.vocab_size)
    runner = make_runner(build_model(arch, state), arch, 64, CacheConfig(block_size=8))
    return DraftModelDrafter(runner, BlockManager(64, 8), top_n=16, grammar=compiler)


def draft_info(max_k: int = 8, vocab: int = VOCAB) -> ProposerInfo:
    return ProposerInfo("draft-model", "tiny", vocab, "", max_k, MAX_LEN)


def config(**kw) -> ProposerConfig:
    return ProposerConfig(host="127.0.0.1", port=0, **kw)


def seq(seq_id, committed, new, k, full=False, **params) -> proposer_pb2.ProposeSequence:
    return proposer_pb2.ProposeSequence(
        seq_id=seq_id,
        committed_len=committed,
        new_token_ids=new,
        full_sequence=full,
        k=k,
        sampling_params=common_pb2.SamplingParams(**params),
    )


class Stream:
    """One bidi Propose stream driven message by message."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = proposer_pb2_grpc.ProposerStub(channel).Propose()
        self.step = 0

    async def send(self, sequences, releases=()) -> proposer_pb2.ProposeResponse:
        self.step += 1
        await self.call.write(
            proposer_pb2.ProposeRequest(step_id=self.step, sequences=sequences, release_seq_ids=list(releases))
        )
        response = await asyncio.wait_for(self.call.read(), 10)
        assert response.step_id == self.step
        return response


async def with_proposer(test, drafter=None, info=None, **cfg):
    drafter = drafter if drafter is not None else make_drafter()
    server = await ProposerServer.start(config(**cfg), drafter, info or draft_info())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            await test(server, channel)
    finally:
        await server.shutdown(0.1)


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 60))


# ---- tests --------------------------------------------------------------------------------------


def test_get_info_and_health_and_reflection():
    async def body(server, channel):
        info = await proposer_pb2_grpc.ProposerStub(channel).GetInfo(proposer_pb2.GetInfoRequest())
        assert info.kind == proposer_pb2.PROPOSER_KIND_DRAFT_MODEL
        assert (info.model, info.vocab_size, info.max_k, info.max_model_len) == ("tiny", VOCAB, 8, MAX_LEN)
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "specdec.v1.Proposer"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
        await reflection.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        names = {s.name for s in (await reflection.read()).list_services_response.service}
        await reflection.done_writing()
        assert {"specdec.v1.Proposer", "grpc.health.v1.Health"} <= names

    run(with_proposer(body))

    async def ngram(server, channel):
        info = await proposer_pb2_grpc.ProposerStub(channel).GetInfo(proposer_pb2.GetInfoRequest())
        assert info.kind == proposer_pb2.PROPOSER_KIND_NGRAM and info.vocab_size == 0 and info.max_model_len == 0

    run(with_proposer(ngram, NgramDrafter(), ProposerInfo("ngram", "", 0, "", 8, 0)))


def test_greedy_drafts_match_in_process_drafter_and_state_follows_deltas():
    reference = make_drafter()

    def ref(*requests: DraftRequest) -> list[Draft]:
        return reference.propose(list(requests))

    async def body(server, channel):
        stream = Stream(channel)
        a, b = [5, 9, 17, 3], [1, 2, 3, 4, 5, 6, 7]
        response = await stream.send([seq("a", 4, a, 3, full=True), seq("b", 7, b, 2, full=True)])
        expected = ref(DraftRequest("a", 4, a, 3), DraftRequest("b", 7, b, 2))
        assert [list(d.draft_token_ids) for d in response.drafts] == [e.token_ids for e in expected]
        assert [d.committed_len for d in response.drafts] == [4, 7]
        assert all(len(d.draft_token_ids) == k for d, k in zip(response.drafts, (3, 2), strict=True))
        assert not any(d.draft_prob_counts for d in response.drafts)  # greedy: one-hot, ids only
        # "a" accepts one draft then commits another token (a rejection); "b" only updates (k = 0).
        new_a = [expected[0].token_ids[0], (expected[0].token_ids[1] + 1) % VOCAB]
        response = await stream.send([seq("a", 6, new_a, 4), seq("b", 8, [42], 0)])
        expected = ref(DraftRequest("a", 6, new_a, 4), DraftRequest("b", 8, [42], 0))
        assert [list(d.draft_token_ids) for d in response.drafts] == [e.token_ids for e in expected]
        assert list(response.drafts[1].draft_token_ids) == []
        # A delta that does not fit (unknown sequence, or a gap) asks for a resync.
        response = await stream.send([seq("c", 10, [1, 2], 3), seq("b", 20, [1], 2)])
        assert [d.needs_resync for d in response.drafts] == [True, True]
        # Released state is gone; the same id sent in full in the same message starts over.
        response = await stream.send([seq("a", 2, [7, 8], 2, full=True)], releases=["a", "b"])
        expected = ref(DraftRequest("a", 2, [7, 8], 2))
        assert list(response.drafts[0].draft_token_ids) == expected[0].token_ids
        response = await stream.send([seq("b", 9, [1], 1)])
        assert response.drafts[0].needs_resync
        assert server.servicer.drafter_calls == server.servicer.messages == 5  # one batched call per message
        stream.call.cancel()

    run(with_proposer(body))


def test_sampled_drafts_send_the_exact_sparse_distribution():
    reference = make_drafter()
    params = SamplingParams(temperature=0.9, top_k=10)  # unseeded: sampled from the drafter's own stream

    async def body(server, channel):
        stream = Stream(channel)
        prompt = [3, 1, 4, 1, 5, 9, 2, 6]
        response = await stream.send(
            [
                proposer_pb2.ProposeSequence(
                    seq_id="s",
                    committed_len=8,
                    new_token_ids=prompt,
                    full_sequence=True,
                    k=4,
                    sampling_params=sampling_params_to_proto(params),
                )
            ]
        )
        got = unpack_draft(response.drafts[0], VOCAB)
        want = reference.propose([DraftRequest("s", 8, prompt, 4, params)])[0]
        assert len(got.token_ids) == 4
        msg = response.drafts[0]
        assert len(msg.draft_prob_counts) == 4 and all(0 < c <= 10 for c in msg.draft_prob_counts)  # zeros dropped
        assert got.probs is not None and want.probs is not None
        dense_got = sparse_to_dense_draft_probs(got.probs.token_ids[None], got.probs.probs[None], VOCAB)[0]
        dense_want = sparse_to_dense_draft_probs(want.probs.token_ids[None], want.probs.probs[None], VOCAB)[0]
        # The first position's distribution depends on the prompt only: the same computation, bit-exact.
        assert torch.equal(dense_got[0], dense_want[0])  # bit-exact float32 over the wire
        # Each later one is the draft model's (truncated) distribution after the tokens it drew before it: the
        # first-position distribution of a fresh sequence whose prompt ends with them (one longer prefill, so
        # float rounding may differ in the last bits).
        for i in range(1, 4):
            after = reference.propose([DraftRequest(f"r{i}", 8 + i, prompt + got.token_ids[:i], 1, params)])[0]
            assert after.probs is not None
            dense_after = sparse_to_dense_draft_probs(after.probs.token_ids[None], after.probs.probs[None], VOCAB)[0]
            assert torch.allclose(dense_got[i], dense_after[0], atol=1e-5), i
        assert torch.allclose(dense_got.sum(-1), torch.ones(4))
        assert all(dense_got[i, t] > 0 for i, t in enumerate(got.token_ids))
        stream.call.cancel()

    run(with_proposer(body))


def test_seeded_drafts_follow_the_draft_position_sent_on_the_wire():
    reference = make_drafter()
    params = SamplingParams(temperature=0.9, top_k=10, seed=123)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    at = {p: reference.propose([DraftRequest(f"s{p}", 8, prompt, 4, params, draft_position=p)])[0] for p in (0, 5)}
    assert at[0].token_ids != at[5].token_ids  # so the check below sees whether the position arrived

    async def body(server, channel):
        stream = Stream(channel)
        sequence = seq("s", 8, prompt, 4, full=True, temperature=0.9, top_k=10, seed=123)
        sequence.draft_position = 5
        got = unpack_draft((await stream.send([sequence])).drafts[0], VOCAB)
        assert got.token_ids == at[5].token_ids and got.probs is None  # seeded drafts send ids only
        stream.call.cancel()

    run(with_proposer(body))


def test_drafts_under_a_format_hold_only_tokens_it_allows(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (2,))
    schema = '{"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}, "required": ["n"]}'
    constrained = SamplingParams(temperature=0.9, structured_output=StructuredOutput("json_schema", schema))
    prompt = [21350, 281, 20110, 42, 216]  # "Answer in JSON: "

    async def body(server, channel):
        stream = Stream(channel)
        output: list[int] = []
        drafted = sent = 0
        for _ in range(6):
            committed = prompt + output
            sequences = [
                proposer_pb2.ProposeSequence(
                    seq_id=seq_id,
                    committed_len=len(committed),
                    new_token_ids=committed[sent:],
                    full_sequence=sent == 0,
                    k=4,
                    sampling_params=sampling_params_to_proto(params),
                    draft_position=len(output),
                )
                for seq_id, params in (("json", constrained), ("free", SamplingParams()))
            ]
            response = await stream.send(sequences)
            sent = len(committed)
            draft = unpack_draft(response.drafts[0], compiler.vocab_size)
            assert len(response.drafts[1].draft_token_ids) == 4  # the unconstrained one beside it is drafted
            matcher = compiler.matcher(constrained.structured_output)  # type: ignore[arg-type]
            matcher.consume(output)
            assert matcher.num_valid(draft.token_ids) == len(draft.token_ids)
            if draft.token_ids:
                assert draft.probs is not None
                bitmask = compiler.new_bitmask(len(draft.token_ids) + 1)
                matcher.fill_masks(draft.token_ids, bitmask)
                allowed = allowed_tokens(bitmask, compiler.vocab_size)
                for pos in range(len(draft.token_ids)):
                    support = draft.probs.token_ids[pos][draft.probs.probs[pos] > 0]
                    assert bool(allowed[pos, support].all())
            drafted += len(draft.token_ids)
            if any(t in compiler.eos_token_ids for t in draft.token_ids):
                break
            output += draft.token_ids  # all accepted, then the target's token: its first allowed one
            matcher.consume(draft.token_ids)
            bitmask = compiler.new_bitmask(1)
            matcher.fill_masks([], bitmask)
            nxt = int(allowed_tokens(bitmask, compiler.vocab_size)[0].nonzero()[0])
            if nxt in compiler.eos_token_ids:
                break
            output.append(nxt)
        assert drafted >= 6
        stream.call.cancel()

    run(with_proposer(body, make_grammar_drafter(compiler), draft_info(vocab=compiler.vocab_size)))


def test_the_drafter_gets_a_format_compiler_from_the_target_tokenizer_or_none(tmp_path, caplog):
    drafter, _ = build_drafter(config(kind="ngram"))
    assert isinstance(drafter, NgramDrafter) and drafter.grammar.compiler is not None
    assert drafter.grammar.compiler.vocab_size == 49152 and 2 in drafter.grammar.compiler.eos_token_ids
    with caplog.at_level(logging.WARNING, logger="specdec.proposer"):
        drafter, _ = build_drafter(config(kind="ngram", target_model=str(tmp_path / "missing")))
    assert isinstance(drafter, NgramDrafter) and drafter.grammar.compiler is None
    assert "sequences with a format are not drafted" in caplog.text


def test_each_sequence_reaches_the_drafter_with_its_tenant():
    class Recording(NgramDrafter):
        def __init__(self) -> None:
            super().__init__()
            self.requests: list[DraftRequest] = []

        def propose(self, requests: list[DraftRequest]) -> list[Draft]:
            self.requests += requests
            return super().propose(requests)

    drafter = Recording()

    async def body(server, channel):
        stream = Stream(channel)
        alice, anonymous = seq("a", 3, [1, 2, 3], 2, full=True), seq("b", 2, [4, 5], 2, full=True)
        alice.tenant = "alice"
        await stream.send([alice, anonymous])
        assert [(r.seq_id.rsplit("/", 1)[-1], r.tenant) for r in drafter.requests] == [("a", "alice"), ("b", "")]
        stream.call.cancel()

    run(with_proposer(body, drafter, ProposerInfo("ngram", "", 0, "", 8, 0)))


def test_a_new_stream_starts_clean_and_a_closed_stream_frees_its_state():
    drafter = make_drafter()

    async def body(server, channel):
        first = Stream(channel)
        await first.send([seq("x", 4, [1, 2, 3, 4], 2, full=True), seq("y", 3, [4, 5, 6], 2, full=True)])
        second = Stream(channel)
        response = await second.send([seq("x", 5, [9], 2)])
        assert response.drafts[0].needs_resync  # stream 2 knows nothing of stream 1's "x"
        response = await second.send([seq("x", 5, [1, 2, 3, 4, 9], 2, full=True)])
        assert len(response.drafts[0].draft_token_ids) == 2
        first.call.cancel()
        for _ in range(100):
            if server.servicer.open_streams == 1:
                break
            await asyncio.sleep(0.02)
        await second.send([])  # applies pending releases under the drafter lock
        assert server.servicer.open_streams == 1, server.servicer.open_streams
        assert all(key.startswith("s2/") for key in drafter.history.tokens), list(drafter.history.tokens)
        assert not any(key.startswith("s1/") for key in drafter.states)
        second.call.cancel()

    run(with_proposer(body, drafter))


def test_k_is_clamped_and_bad_messages_are_handled():
    async def body(server, channel):
        stream = Stream(channel)
        response = await stream.send(
            [
                seq("big-k", 3, [1, 2, 3], 50, full=True),
                seq("oov", 2, [1, 500], 3, full=True),  # outside the draft vocabulary: never drafted
                seq("bad-full", 5, [1, 2], 3, full=True),  # full_sequence with a wrong length
                seq("near-limit", MAX_LEN - 1, [i % VOCAB for i in range(MAX_LEN - 1)], 5, full=True),
                seq("bad-params", 2, [1, 2], 3, full=True, temperature=-1.0),
            ]
        )
        lengths = [len(d.draft_token_ids) for d in response.drafts]
        assert lengths == [3, 0, 0, 1, 0]  # max_k 3; the context limit leaves room for one
        assert [d.needs_resync for d in response.drafts] == [False, False, True, False, False]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream.send([seq("d", 1, [1], 1, full=True), seq("d", 1, [1], 1, full=True)])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "appear once" in (err.value.details() or "")

    run(with_proposer(body, info=draft_info(max_k=3)))


def test_ngram_kind_drafts_the_continuation():
    async def body(server, channel):
        stream = Stream(channel)
        tokens = [10, 11, 12, 13, 14, 10, 11]
        response = await stream.send([seq("n", 7, tokens, 3, full=True)])
        assert list(response.drafts[0].draft_token_ids) == [12, 13, 14]
        response = await stream.send([seq("n", 8, [12], 2)])
        assert list(response.drafts[0].draft_token_ids) == [13, 14]
        stream.call.cancel()

    run(with_proposer(body, NgramDrafter(), ProposerInfo("ngram", "", 0, "", 8, 0)))


def test_config_reads_flags_and_env(monkeypatch):
    monkeypatch.setenv("SPECDEC_MAX_K", "5")
    monkeypatch.setenv("SPECDEC_PORT", "7000")
    cfg = load_config(ProposerConfig, ["--kind", "ngram", "--port", "1234", "--model", "m"])
    assert (cfg.kind, cfg.port, cfg.max_k, cfg.model, cfg.tensor_parallel_size) == ("ngram", 1234, 5, "m", 1)
    assert load_config(ProposerConfig, []).port == 7000
    assert load_config(ProposerConfig, ["--tensor-parallel-size", "2"]).tensor_parallel_size == 2
    eagle = load_config(ProposerConfig, ["--kind", "eagle", "--model", "head", "--target-model", "t"])
    assert (eagle.kind, eagle.model, eagle.target_model) == ("eagle", "head", "t")
    for argv in (
        ["--tensor-parallel-size", "0"],
        ["--kind", "ngram", "--tensor-parallel-size", "2"],
        ["--kind", "eagle", "--tensor-parallel-size", "2"],  # a one-layer head runs at TP 1
    ):
        with pytest.raises(SystemExit):
            load_config(ProposerConfig, argv)
    with pytest.raises(SystemExit):
        load_config(ProposerConfig, ["--kind", "medusa"])


def test_cli_serves_and_exits_cleanly_on_sigterm():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proposer_service.server",
            "--kind",
            "ngram",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--grace-period-s",
            "1",
        ],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = None
        deadline = time.monotonic() + 30
        assert proc.stderr is not None
        while port is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            match = re.search(r"proposer serving .*port=(\d+)", line)
            port = int(match.group(1)) if match else None
        assert port, "the proposer did not report its port"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
