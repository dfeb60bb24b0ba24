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
import pytest
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
        self.kinds_sent: set[str] = set()
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
                elif s.k:  # kinds take turns per draft: a sequence's resync budget ends its drafting early
                    kind = BAD_KINDS[self.sent_bad % len(BAD_KINDS)]
                    drafts.append(bad_draft(kind, s))
                    self.kinds_sent.add(kind)
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
                assert hostile.kinds_sent == set(BAD_KINDS)  # every kind was sent at least once
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


# ---- size: issue 26, point 3 ----------------------------------------------------------------------


class WideProposer(HostileProposer):
    """Answers the first sequence of each step with a draft whose one position has `width` entries: valid in
    value (ids in the vocabulary, repeated; probabilities summing to 1, the drafted token covered), unbounded
    in size; the others with a valid one-hot draft. Records the max_draft_support each handshake stated."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.stated: list[int] = []
        # built once: the proposer's own side of this in-process test costs the same each step
        self.wide = proposer_pb2.Draft(
            draft_token_ids=[5], draft_prob_counts=[width], draft_prob_token_ids=[5] * width,
            draft_probs=[1.0 / width] * width,
        )  # fmt: skip

    async def GetInfo(self, request, context):
        self.stated.append(request.max_draft_support)
        return await super().GetInfo(request, context)

    async def Propose(self, request_iterator, context):
        async for req in request_iterator:
            self.steps += 1
            drafts = []
            wide_sent = False
            for s in req.sequences:
                draft = proposer_pb2.Draft(seq_id=s.seq_id, committed_len=s.committed_len)
                if s.k and not wide_sent:
                    draft.MergeFrom(self.wide)
                    self.sent_bad += 1
                    wide_sent = True
                elif s.k:
                    draft.draft_token_ids.append(5)
                drafts.append(draft)
            yield proposer_pb2.ProposeResponse(step_id=req.step_id, drafts=drafts)


class PeakRss:
    """The process's resident memory sampled every 5 ms in a thread: the peak above the start, in MB."""

    def __init__(self) -> None:
        import threading

        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return (self.peak - self.start) / 2**20


WIDE = 400_000  # entries at one draft position: a 2 MB reply
WIDE_BATCH = [[(7 * i + j) % VOCAB for j in range(5 + i)] for i in range(8)]


def serve_wide_proposer(port: int, width: int) -> None:
    """Entry point of the hostile proposer's own process (so that its memory is not the verifier's)."""

    async def serve() -> None:
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
        proposer_pb2_grpc.add_ProposerServicer_to_server(WideProposer(width), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def test_a_wide_draft_from_a_proposer_process_is_dropped_and_counted_and_the_rest_goes_on():
    """One position with 400,000 entries (a 2 MB reply) from a proposer in its own process, beside valid
    drafts of the other 7 sequences of the batch: main accepted it (and padded every row of the batch to it);
    now it is dropped and counted while the valid drafts are used and every output stays exact. That nothing
    of it is read is test_unpack_draft_reads_no_entry_of_an_over_wide_draft's; what receiving it costs is
    bounded by the channel's 64 MiB."""
    import subprocess
    import sys

    from tests.service.test_gateway import free_port

    port = free_port()
    code = f"from tests.service.test_untrusted_proposer import serve_wide_proposer; serve_wide_proposer({port}, {WIDE})"
    proposer = subprocess.Popen([sys.executable, "-c", code])

    async def body():
        verifier = await start_verifier([f"127.0.0.1:{port}"], wait=False)
        try:
            await verifier.proposer.wait_connected(30)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                rss = PeakRss()  # printed only: in-process RSS mixes in the batch's own work and gRPC's buffers
                results = await asyncio.gather(*(collect(stub, request(p, MAX_TOKENS)) for p in WIDE_BATCH))
                grew_mb = rss.stop()
                for prompt, (tokens, _) in zip(WIDE_BATCH, results, strict=True):
                    assert tokens == reference(tuple(prompt), MAX_TOKENS)
                engine_stats = await stats(stub)
                print(f"peak RSS growth {grew_mb:.0f} MB, invalid drafts {engine_stats.invalid_drafts}")  # -s shows it
                assert engine_stats.invalid_drafts > 0 and engine_stats.drafted_tokens > 0  # the valid ones ran
        finally:
            await verifier.shutdown(0.5)

    try:
        run(body())
    finally:
        proposer.kill()
        proposer.wait()


class _Untouchable:
    """A repeated field that may be measured but not read."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        raise AssertionError("an entry of an over-wide draft was read")

    __getitem__ = __iter__


def test_unpack_draft_reads_no_entry_of_an_over_wide_draft():
    """13,000,000 entries at one position (a 64 MiB reply): refused from the counts alone, so nothing is
    converted or allocated for them (main built [k, 13M] tensors, then padded the batch to them)."""

    class Wire:
        seq_id, committed_len, needs_resync = "s", 10, False
        draft_token_ids = [5, 6]
        draft_parents: list[int] = []  # a chain
        draft_prob_counts = [13_000_000, 1]
        draft_prob_token_ids = _Untouchable(13_000_001)
        draft_probs = _Untouchable(13_000_001)

    for support in (None, 1024):
        try:
            unpack_draft(Wire(), VOCAB, max_k=2, max_support=support)  # type: ignore[arg-type]
        except ValueError as err:
            assert "entries; at most" in str(err)
        else:
            raise AssertionError("an over-wide draft was accepted")


def test_the_max_draft_support_is_stated_at_the_handshake():
    async def body():
        wide = WideProposer(4)
        fake_server, port = await start_fake(wide)
        verifier = await start_verifier([f"127.0.0.1:{port}"])
        try:
            assert wide.stated == [VOCAB]  # the default 1,024, capped by the tiny target's 128 ids
        finally:
            await verifier.shutdown(0.5)
            await fake_server.stop(0)

    run(body())


def test_unpack_draft_bounds_widths_by_the_vocabulary_and_the_stated_support():
    def draft(width: int) -> proposer_pb2.Draft:
        return proposer_pb2.Draft(
            draft_token_ids=[5], draft_prob_counts=[width], draft_prob_token_ids=[5] * width,
            draft_probs=[1.0 / width] * width,
        )  # fmt: skip

    assert unpack_draft(draft(VOCAB), VOCAB, max_k=1).probs is not None  # repeated ids, as wide as the vocabulary
    for width, support in ((VOCAB + 1, None), (17, 16)):
        try:
            unpack_draft(draft(width), VOCAB, max_k=1, max_support=support)
        except ValueError as err:
            assert "entries; at most" in str(err)
        else:
            raise AssertionError(f"a width of {width} passed (support {support})")
    assert unpack_draft(draft(16), VOCAB, max_k=1, max_support=16).probs is not None


class ResyncProposer(HostileProposer):
    """Answers needs_resync for every sequence on every step, and counts the whole histories it was sent."""

    def __init__(self) -> None:
        super().__init__()
        self.full_resends: dict[str, int] = {}

    async def Propose(self, request_iterator, context):
        async for req in request_iterator:
            self.steps += 1
            for s in req.sequences:
                if s.full_sequence:
                    self.full_resends[s.seq_id] = self.full_resends.get(s.seq_id, 0) + 1
            drafts = [
                proposer_pb2.Draft(seq_id=s.seq_id, committed_len=s.committed_len, needs_resync=True)
                for s in req.sequences
            ]
            yield proposer_pb2.ProposeResponse(step_id=req.step_id, drafts=drafts)


def test_a_proposer_asking_for_resync_every_step_gets_a_few_then_k_0_for_that_sequence():
    async def body():
        resyncing = ResyncProposer()
        fake_server, port = await start_fake(resyncing)
        verifier = await start_verifier([f"127.0.0.1:{port}"])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                results = await asyncio.gather(*(collect(stub, request(p, 48)) for p in PROMPTS))
                for prompt, (tokens, _) in zip(PROMPTS, results, strict=False):
                    assert tokens == reference(tuple(prompt), 48)
            # first contact plus at most the burst of 3 resends (48 tokens refill less than one more), where
            # main resent every sequence's whole history on each of its ~48 steps
            assert len(resyncing.full_resends) == len(PROMPTS)
            assert all(n <= 4 for n in resyncing.full_resends.values()), resyncing.full_resends
            assert verifier.loop.engine.stats.resyncs_refused == len(PROMPTS)
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


def test_a_proposer_drafts_from_no_more_top_tokens_than_the_verifier_accepts():
    from tests.service.test_verifier_service import start_proposer

    async def body():
        proposer = await start_proposer()  # its drafter's top-n is 16
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{proposer.port}") as channel:
                stub = proposer_pb2_grpc.ProposerStub(channel)
                await stub.GetInfo(proposer_pb2.GetInfoRequest(max_draft_support=64))
                assert proposer.servicer.drafter.top_n == 16  # already within it
                await stub.GetInfo(proposer_pb2.GetInfoRequest(max_draft_support=6))
                assert proposer.servicer.drafter.top_n == 6
        finally:
            await proposer.shutdown(0.1)

    run(body())


def bad_tree(kind: str, s: proposer_pb2.ProposeSequence) -> proposer_pb2.Draft:
    """One malformed token tree for sequence `s` (the verifier asked for up to s.max_tree_nodes nodes, s.k deep)."""
    n = max(2, min(s.max_tree_nodes, 4))
    parents = {
        "cycle": [-1, *range(1, n)],  # node i names itself as its parent
        "out_of_order": [1, -1, *range(1, n - 1)],  # a parent after its child
        "too_big": [-1] * (s.max_tree_nodes + 1),
        "too_deep": list(range(-1, s.k)),  # a chain of k + 1 nodes
        "parent_count": [-1] * (n - 1),
        "below_root": [-2, *([-1] * (n - 1))],
        "not_asked": [-1] * n,  # only when no tree was asked for: sent to a chain-only verifier below
    }[kind]
    tokens = [(s.committed_len * 7 + i) % VOCAB for i in range(max(n, len(parents) if kind != "parent_count" else n))]
    return proposer_pb2.Draft(
        seq_id=s.seq_id, committed_len=s.committed_len, draft_token_ids=tokens, draft_parents=parents
    )


TREE_KINDS = ("cycle", "out_of_order", "too_big", "too_deep", "parent_count", "below_root")


class HostileTrees(HostileProposer):
    """Answers every step with one kind of malformed tree for every sequence, kinds taking turns."""

    def __init__(self, kinds: tuple[str, ...]) -> None:
        super().__init__()
        self.kinds = kinds

    async def Propose(self, request_iterator, context):
        async for req in request_iterator:
            self.steps += 1
            drafts = []
            for s in req.sequences:
                if s.k:  # kinds take turns per draft: a sequence's resync budget ends its drafting early
                    kind = self.kinds[self.sent_bad % len(self.kinds)]
                    drafts.append(bad_tree(kind, s))
                    self.kinds_sent.add(kind)
                    self.sent_bad += 1
                else:
                    drafts.append(proposer_pb2.Draft(seq_id=s.seq_id, committed_len=s.committed_len))
            yield proposer_pb2.ProposeResponse(step_id=req.step_id, drafts=drafts)


@pytest.mark.parametrize(("kinds", "nodes"), [(TREE_KINDS, 6), (("not_asked",), 0)], ids=["malformed", "unasked"])
def test_malformed_trees_are_dropped_counted_and_change_nothing(kinds, nodes):
    async def body():
        hostile = HostileTrees(kinds)
        fake_server, port = await start_fake(hostile)
        verifier = await start_verifier([f"127.0.0.1:{port}"], max_tree_nodes=nodes)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                sampled = request(PROMPTS[0], MAX_TOKENS, params={"temperature": 0.9})
                results = await asyncio.gather(
                    *(collect(stub, request(p, MAX_TOKENS)) for p in PROMPTS), collect(stub, sampled)
                )
                for prompt, (tokens, _) in zip(PROMPTS, results, strict=False):
                    assert tokens == reference(tuple(prompt), MAX_TOKENS)
                assert len(results[-1][0]) == MAX_TOKENS
                engine_stats = await stats(stub)
                assert hostile.kinds_sent == set(kinds)  # every kind was sent at least once
                assert engine_stats.invalid_drafts == hostile.sent_bad > 0
                assert engine_stats.drafted_tokens == 0  # not one node of a malformed tree was scored
        finally:
            await verifier.shutdown(0.5)
            await fake_server.stop(0)

    run(body())
