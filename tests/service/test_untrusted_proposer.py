"""The proposer is untrusted input to the verifier (issue 12, point 4).

Every malformed draft is dropped and counted (GetStats, metric, span event) and that sequence decodes with
k = 0 for the step: never an exception, never a changed token. Checked three ways: each documented kind of
bad draft in turn through a real verifier; a fuzzing proposer that answers seeded random garbage while
greedy streams stay exact and health stays SERVING; and hypothesis over `unpack_draft` itself.
"""

from __future__ import annotations

import asyncio
import math
import random

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.draft_codec import PROB_SUM_TOLERANCE, unpack_draft
from shared.proto_gen.specdec.v1 import proposer_pb2, proposer_pb2_grpc, verifier_pb2_grpc
from tests.draft_forms import sparse_to_dense_draft_probs
from tests.service.test_proposer_service import VOCAB
from tests.service.test_verifier_service import (
    PROMPTS,
    collect,
    reference,
    request,
    run,
    start_fake,
    start_verifier,
    stats,
)

MAX_TOKENS = 24


def bad_draft(kind: str, s: proposer_pb2.ProposeSequence) -> proposer_pb2.Draft:
    """One draft of the named kind for sequence `s` (which asked for s.k >= 1 tokens)."""
    k = max(1, s.k)
    ids = [(s.committed_len * 5 + i) % VOCAB for i in range(k)]
    draft = proposer_pb2.Draft(seq_id=s.seq_id, committed_len=s.committed_len, draft_token_ids=ids)
    uniform = [ids[i // 2] if i % 2 == 0 else (ids[i // 2] + 1) % VOCAB for i in range(2 * k)]
    if kind == "oov_ids":
        draft.draft_token_ids[:] = [VOCAB + 3] * k
    elif kind == "too_many":
        draft.draft_token_ids.extend([1] * 2)  # s.k + 2 tokens
    elif kind in ("nan", "negative", "not_normalised", "token_not_covered", "counts_mismatch"):
        value = {"nan": math.nan, "negative": -0.5, "not_normalised": 0.2}.get(kind, 0.5)
        draft.draft_prob_token_ids.extend(uniform)
        draft.draft_probs.extend([value, 1 - value if kind == "negative" else value] * k)
        draft.draft_prob_counts.extend([2] * k)
        if kind == "token_not_covered":
            draft.draft_prob_token_ids[:] = [(t + 7) % VOCAB for t in uniform]  # drafted ids carry no mass
        if kind == "counts_mismatch":
            draft.draft_prob_counts[:] = [3] * k
    else:
        raise ValueError(kind)
    return draft


BAD_KINDS = ("oov_ids", "too_many", "nan", "negative", "not_normalised", "token_not_covered", "counts_mismatch")


class HostileProposer(proposer_pb2_grpc.ProposerServicer):
    """Answers every step with one kind of malformed draft for every sequence, kinds taking turns; or, with
    `fuzz_seed`, with seeded random garbage in every field."""

    def __init__(self, fuzz_seed: int | None = None) -> None:
        self.sent_bad = 0
        self.steps = 0
        self.rng = random.Random(fuzz_seed) if fuzz_seed is not None else None

    async def GetInfo(self, request, context):
        return proposer_pb2.GetInfoResponse(kind=proposer_pb2.PROPOSER_KIND_DRAFT_MODEL, vocab_size=VOCAB, max_k=8)

    async def Propose(self, request_iterator, context):
        async for req in request_iterator:
            self.steps += 1
            drafts = []
            for s in req.sequences:
                if self.rng is not None:
                    drafts.append(self._garbage(s))
                elif s.k:
                    drafts.append(bad_draft(BAD_KINDS[self.steps % len(BAD_KINDS)], s))
                    self.sent_bad += 1
                else:
                    drafts.append(proposer_pb2.Draft(seq_id=s.seq_id, committed_len=s.committed_len))
            yield proposer_pb2.ProposeResponse(step_id=req.step_id, drafts=drafts)

    def _garbage(self, s: proposer_pb2.ProposeSequence) -> proposer_pb2.Draft:
        rng = self.rng
        assert rng is not None
        k = rng.choice([0, 1, s.k, s.k + 3])
        draft = proposer_pb2.Draft(
            seq_id=s.seq_id if rng.random() < 0.9 else "someone-else",
            committed_len=max(0, s.committed_len + rng.choice([0, 0, 0, -1, 1, 1 << 20])),
            draft_token_ids=[rng.choice([rng.randrange(VOCAB), -1, VOCAB, 2**31 - 1]) for _ in range(k)],
            needs_resync=rng.random() < 0.1,
        )
        if rng.random() < 0.6:
            counts = [rng.choice([1, 2, 3]) for _ in range(k + rng.choice([0, 0, 1, -1]))]
            total = sum(max(0, c) for c in counts)
            draft.draft_prob_counts.extend(max(0, c) for c in counts)
            draft.draft_prob_token_ids.extend(rng.randrange(-2, VOCAB + 2) for _ in range(total))
            values = [1.0, 0.5, 0.0, -0.1, math.nan, math.inf, 1e-30, 3.0]
            draft.draft_probs.extend(rng.choice(values) for _ in range(total + rng.choice([0, 0, 1])))
        return draft


def test_each_kind_of_malformed_draft_is_dropped_counted_and_changes_nothing():
    async def body():
        hostile = HostileProposer()
        fake_server, port = await start_fake(hostile)
        verifier = await start_verifier([f"127.0.0.1:{port}"])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                sampled = request(PROMPTS[0], MAX_TOKENS, params={"temperature": 0.9, "seed": 3})
                results = await asyncio.gather(
                    *(collect(stub, request(p, MAX_TOKENS)) for p in PROMPTS), collect(stub, sampled)
                )
                for prompt, (tokens, _) in zip(PROMPTS, results, strict=False):
                    assert tokens == reference(tuple(prompt), MAX_TOKENS)
                assert len(results[-1][0]) == MAX_TOKENS  # the sampled stream ran to its end, too
                engine_stats = await stats(stub)
                assert hostile.steps > len(BAD_KINDS)  # every kind was sent at least once
                assert engine_stats.invalid_drafts == hostile.sent_bad == verifier.proposer.invalid_drafts
                assert engine_stats.drafted_tokens == 0  # not one bad draft token reached the target
        finally:
            await verifier.shutdown(0.5)
            await fake_server.stop(0)

    run(body())


def test_a_fuzzing_proposer_never_breaks_a_greedy_stream_or_the_service():
    async def body():
        fuzzer = HostileProposer(fuzz_seed=12)
        fake_server, port = await start_fake(fuzzer)
        verifier = await start_verifier([f"127.0.0.1:{port}"])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                health = health_pb2_grpc.HealthStub(channel)
                for _ in range(2):  # two rounds: a reconnect after a dropped stream is exercised too
                    sampled = request(PROMPTS[1], MAX_TOKENS, params={"temperature": 1.0, "top_p": 0.9, "seed": 5})
                    results = await asyncio.gather(
                        *(collect(stub, request(p, MAX_TOKENS)) for p in PROMPTS), collect(stub, sampled)
                    )
                    for prompt, (tokens, _) in zip(PROMPTS, results, strict=False):
                        assert tokens == reference(tuple(prompt), MAX_TOKENS)
                    assert len(results[-1][0]) == MAX_TOKENS
                    check = await health.Check(health_pb2.HealthCheckRequest(service=""))
                    assert check.status == health_pb2.HealthCheckResponse.SERVING
                engine_stats = await stats(stub)
                assert fuzzer.steps > 10 and engine_stats.invalid_drafts > 0
                assert engine_stats.running_requests == 0 and engine_stats.kv_blocks_used == 0
        finally:
            await verifier.shutdown(0.5)
            await fake_server.stop(0)

    run(body())


# ---- unpack_draft under hypothesis ---------------------------------------------------------------

PROB_VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, 1.0, 0.5, 0.25, -0.0, 1e-30]),
)


@st.composite
def wire_drafts(draw) -> proposer_pb2.Draft:
    """Honest drafts (normalised rows that cover the drafted token), honest ones with one field broken, and
    random fields, so that both outcomes of `unpack_draft` come up often."""
    k = draw(st.integers(0, 6))
    in_vocab = st.integers(0, VOCAB - 1)
    ids = draw(st.lists(in_vocab, min_size=k, max_size=k))
    if k and draw(st.integers(0, 3)) == 0:  # one drafted id anywhere in int32
        ids[draw(st.integers(0, k - 1))] = draw(st.integers(-(2**31), 2**31 - 1))
    draft = proposer_pb2.Draft(
        seq_id=draw(st.text(max_size=8)), committed_len=draw(st.integers(0, 2**32 - 1)), draft_token_ids=ids
    )
    mode = draw(st.sampled_from(["none", "honest", "broken", "random"]))
    if mode in ("honest", "broken"):
        rows = [[t, *draw(st.lists(in_vocab, max_size=3))] for t in ids]
        weights = [draw(st.lists(st.floats(0.01, 1.0), min_size=len(r), max_size=len(r))) for r in rows]
        draft.draft_prob_counts.extend(len(r) for r in rows)
        draft.draft_prob_token_ids.extend(t for r in rows for t in r)
        draft.draft_probs.extend(w / sum(ws) for ws in weights for w in ws)
        if mode == "broken" and len(draft.draft_probs):
            i = draw(st.integers(0, len(draft.draft_probs) - 1))
            field = draw(st.sampled_from(["prob", "id", "count"]))
            if field == "prob":
                draft.draft_probs[i] = draw(PROB_VALUES)
            elif field == "id":
                draft.draft_prob_token_ids[i] = draw(st.integers(-(2**31), 2**31 - 1))
            else:
                draft.draft_prob_counts[i % k] += draw(st.sampled_from([1, 2]))
    elif mode == "random":
        counts = draw(st.lists(st.integers(0, 4), min_size=max(0, k - 1), max_size=k + 1))
        total = max(0, sum(counts) + draw(st.sampled_from([0, 0, 0, 1, -1])))
        draft.draft_prob_counts.extend(counts)
        draft.draft_prob_token_ids.extend(draw(st.lists(st.integers(-3, VOCAB + 3), min_size=total, max_size=total)))
        draft.draft_probs.extend(draw(st.lists(PROB_VALUES, min_size=total, max_size=total)))
    return draft


@settings(max_examples=400, deadline=None)
@given(msg=wire_drafts(), max_k=st.integers(0, 8))
def test_unpack_draft_either_refuses_or_returns_a_draft_verification_can_use(msg, max_k):
    try:
        draft = unpack_draft(msg, VOCAB, max_k=max_k)
    except ValueError:
        return  # refused with a reason: the verifier counts it and drafts nothing for the step
    k = len(draft.token_ids)
    assert k <= max_k and all(0 <= t < VOCAB for t in draft.token_ids)
    if draft.probs is None:
        return
    dense = sparse_to_dense_draft_probs(draft.probs.token_ids[None], draft.probs.probs[None], VOCAB)[0]  # [k, vocab]
    assert dense.shape == (k, VOCAB) and bool(torch.isfinite(dense).all()) and bool((dense >= 0).all())
    assert bool(((dense.double().sum(-1) - 1).abs() <= PROB_SUM_TOLERANCE).all())
    assert bool((dense[torch.arange(k), torch.tensor(draft.token_ids, dtype=torch.int64)] > 0).all())
