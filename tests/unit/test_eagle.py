"""EAGLE head and drafter on tiny random models: the serving forward against the reference, training's
unrolled steps against drafting, the vocabulary subset, features on the wire, and exactness through the
engine whatever the head or its features are."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from proposer_service.eagle import EagleDrafter, make_eagle_drafter
from shared.drafting import DraftRequest, FeatureStore
from shared.feature_codec import features_from_proto, features_to_proto
from shared.kv.cache import KVCache
from shared.model.attention import SeqSpan, build_metadata
from shared.model.build import CacheConfig
from shared.model.eagle import (
    arch_from_config,
    build_head,
    head_config,
    init_head_state,
    load_head_state,
    reference_forward,
    reference_fuse,
    reference_logits,
    save_head,
)
from shared.proto_gen.specdec.v1 import proposer_pb2
from shared.sampling import SamplingParams
from specdec_local.builder import build_engine
from specdec_train.train import unrolled_forward
from tests.law import WrongDraftLaw, first_two_token_counts, law_pvalue, two_token_law
from tests.tiny import hf_greedy, ours, tiny_hf_model
from verifier_service.engine import EngineConfig

VOCAB = 96
EOS = VOCAB - 1


@pytest.fixture(scope="module")
def target_hf():
    return tiny_hf_model(seed=1, logit_scale=8.0)


@pytest.fixture(scope="module")
def target(target_hf):
    return ours(target_hf)


FUSED = (1, 0, -1)  # an EAGLE-3 head's target layers (the 2-layer target's), in the wire's order


def make_head_dir(tmp_path, target_arch, subset: torch.Tensor, seed: int = 0, scale: float = 1.0, layers=(-1,)):
    config = head_config(target_arch, 1, len(subset), layers)
    state = init_head_state(arch_from_config(config), subset, seed, layers)
    with torch.no_grad():
        for name, t in state.items():
            if name.endswith("proj.weight"):
                t.mul_(scale)
            if "norm" in name:  # non-trivial norms, so the test sees them applied
                t.uniform_(0.5, 1.5)
            if name == "norm.weight":  # a fused head's output norm sets its logits' scale: as sharp as asked
                t.mul_(scale)
    save_head(tmp_path, config, state)
    return tmp_path


def embeddings(target):
    return target[0].embed_tokens.weight, target[0].lm_head_weight


@pytest.mark.parametrize("layers", [(-1,), FUSED], ids=["eagle1", "eagle3"])
def test_paged_head_equals_reference_in_chunks_and_batches(tmp_path, target, layers):
    _, arch = target
    folder = make_head_dir(tmp_path, arch, torch.randperm(VOCAB)[:40], layers=layers)
    embed, lm_head = embeddings(target)
    head, head_arch = build_head(folder, embed, lm_head)
    state = load_head_state(folder)
    gen = torch.Generator().manual_seed(0)
    lengths = [11, 5]
    # the target's layers side by side, at very different scales (as a low and a high layer are)
    scales = torch.tensor([[0.5, 40.0, 3.0][i % 3] for i in range(len(layers)) for _ in range(arch.hidden_size)])
    raw = [torch.randn(n, len(layers) * arch.hidden_size, generator=gen) * scales for n in lengths]
    feats = [head.fuse_features(r) for r in raw]  # the serving fuse: what the drafter feeds the head
    for r, f in zip(raw, feats, strict=True):
        torch.testing.assert_close(f, reference_fuse(state, r), atol=1e-5, rtol=1e-5)
    ids = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    refs = [
        reference_forward(state, head_arch, head.rotary, reference_fuse(state, r)[None], F.embedding(i, embed)[None])[0]
        for r, i in zip(raw, ids, strict=True)
    ]
    cache = KVCache(1, 16, 4, head_arch.num_kv_heads, head_arch.head_dim)
    tables = [[0, 1, 2, 3], [4, 5]]
    # Chunk 1: both sequences together (7 and 2 positions); chunk 2: the rest, again batched.
    outs: list[list[torch.Tensor]] = [[], []]
    for cut in ([7, 2], lengths):
        starts = [sum(len(o) for o in out) for out in outs]
        spans = [SeqSpan(tables[b], starts[b], cut[b] - starts[b]) for b in range(2)]
        meta = build_metadata(spans, 4)
        hidden = head(
            torch.cat([feats[b][starts[b] : cut[b]] for b in range(2)]),
            torch.cat([ids[b][starts[b] : cut[b]] for b in range(2)]),
            cache.layers,
            meta,
        )
        for b, part in enumerate(hidden.split([cut[b] - starts[b] for b in range(2)])):
            outs[b].append(part)
    for b in range(2):
        torch.testing.assert_close(torch.cat(outs[b]), refs[b], atol=1e-5, rtol=1e-5)
    logits = head.compute_logits(refs[0])
    expected = reference_logits(state, refs[0], lm_head[head.vocab_subset], head_arch.rms_norm_eps)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    if layers == (-1,):  # an EAGLE-1 head: the target's LM head on the predicted feature as is
        torch.testing.assert_close(logits, refs[0] @ lm_head[head.vocab_subset].T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layers", [(-1,), FUSED], ids=["eagle1", "eagle3"])
def test_training_unroll_is_what_drafting_sees(tmp_path, target, layers):
    """Steps 2 and 3 of training at position j = drafting one and two tokens past real features 0..j-2."""
    _, arch = target
    folder = make_head_dir(tmp_path, arch, torch.arange(VOCAB), layers=layers)
    embed, lm_head = embeddings(target)
    head, head_arch = build_head(folder, embed, lm_head)
    state = load_head_state(folder)
    feats = torch.randn(1, 9, len(layers) * arch.hidden_size)
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        steps = unrolled_forward(state, head_arch, head.rotary, feats, F.embedding(ids, embed), 3)
    torch.testing.assert_close(
        steps[0],
        reference_forward(state, head_arch, head.rotary, reference_fuse(state, feats), F.embedding(ids, embed)),
    )
    for j in (2, 6):
        cache = KVCache(1, 8, 4, head_arch.num_kv_heads, head_arch.head_dim)
        table = [0, 1, 2, 3]
        real = head(
            head.fuse_features(feats[0, : j - 1]), ids[0, : j - 1], cache.layers,
            build_metadata([SeqSpan(table, 0, j - 1)], 4),
        )  # fmt: skip
        guess = real[-1]  # the head's prediction of feature j - 1
        for pos in (j - 1, j):  # two draft positions on predicted features
            meta = build_metadata([SeqSpan(table, pos, 1)], 4)
            guess = head(guess[None], ids[0, pos : pos + 1], cache.layers, meta)[0]
        torch.testing.assert_close(guess, steps[2][0, j], atol=1e-5, rtol=1e-5)


def test_greedy_drafts_are_subset_ids_of_the_heads_argmax(tmp_path, target):
    _, arch = target
    subset = torch.tensor([7, 3, 50, 11, 94, 20, 61, 33])
    drafter = make_eagle_drafter(
        str(make_head_dir(tmp_path, arch, subset, scale=20.0)), *embeddings(target), num_blocks=32, block_size=4
    )
    tokens = [5, 9, 13, 21, 40]
    features = torch.randn(len(tokens) - 1, arch.hidden_size)
    (draft,) = drafter.propose([DraftRequest("a", len(tokens), tokens, 3, SamplingParams(), features, 0)])
    assert len(draft.token_ids) == 3 and set(draft.token_ids) <= set(subset.tolist())
    # d_1 from the reference forward over the real features
    embed, lm_head = embeddings(target)
    head = drafter.head
    state = load_head_state(tmp_path)
    out = reference_forward(
        state, head.arch, head.rotary, features[None], F.embedding(torch.tensor(tokens[1:]), embed)[None]
    )
    assert draft.token_ids[0] == int(subset[(out[0, -1] @ lm_head[subset].T).argmax()])


def test_sampled_drafts_send_the_heads_distribution_over_the_subset(tmp_path, target):
    _, arch = target
    subset = torch.arange(0, VOCAB, 2)
    drafter = make_eagle_drafter(
        str(make_head_dir(tmp_path, arch, subset)), *embeddings(target), num_blocks=32, block_size=4, top_n=VOCAB
    )
    tokens = [5, 9, 13]
    features = torch.randn(2, arch.hidden_size)
    params = SamplingParams(temperature=1.0)  # unseeded: seeded drafts use the target's noise (below)
    (draft,) = drafter.propose([DraftRequest("a", 3, tokens, 2, params, features, 0)])
    assert draft.probs is not None
    assert set(draft.probs.token_ids.flatten().tolist()) <= set(subset.tolist())
    torch.testing.assert_close(draft.probs.probs.sum(-1), torch.ones(2))
    for pos, token in enumerate(draft.token_ids):
        assert draft.probs.probs[pos][draft.probs.token_ids[pos] == token].item() > 0


def test_features_round_trip_and_bad_blocks_are_refused():
    x = torch.randn(4, 16) * 30
    start, back = features_from_proto(features_to_proto(5, x, proposer_pb2.FEATURE_DTYPE_FLOAT16), 16)
    assert start == 5 and back.shape == (4, 16)
    torch.testing.assert_close(back, x.half().float())
    msg = features_to_proto(0, x, proposer_pb2.FEATURE_DTYPE_FLOAT32)
    assert torch.equal(features_from_proto(msg, 16)[1], x)
    with pytest.raises(ValueError, match="values per row"):
        features_from_proto(msg, 8)
    msg.rows = 5
    with pytest.raises(ValueError, match="bytes"):
        features_from_proto(msg, 16)
    bad = features_to_proto(0, torch.full((1, 16), float("nan")), proposer_pb2.FEATURE_DTYPE_FLOAT32)
    with pytest.raises(ValueError, match="non-finite"):
        features_from_proto(bad, 16)


def test_feature_store_overlaps_and_gaps():
    store = FeatureStore()
    store.add(3, torch.arange(4.0).unsqueeze(1))  # positions 3..6
    assert (store.start, store.end) == (3, 7)
    store.add(5, torch.tensor([[9.0], [9.0], [7.0]]))  # 5, 6 already held: only 7 is new
    assert store.end == 8 and store.get(6, 8).flatten().tolist() == [3.0, 7.0]
    assert store.since(0)[0] == 3 and store.since(8) == (8, None)
    store.add(10, torch.ones(1, 1))  # a gap: what came before cannot be used with it
    assert (store.start, store.end) == (10, 11)


def test_feature_store_trim_keeps_the_rest_and_frees_the_chunk():
    store = FeatureStore()
    store.add(0, torch.arange(6.0).unsqueeze(1))  # one chunk, positions 0..5
    store.add(6, torch.tensor([[6.0], [7.0]]))
    store.trim(4)
    assert (store.start, store.end) == (4, 8) and store.since(0)[0] == 4
    assert store.get(4, 8).flatten().tolist() == [4.0, 5.0, 6.0, 7.0]
    assert store._chunks[0][1]._base is None  # a copy of the kept rows, not a view keeping all six alive
    store.trim(2)  # behind the start: nothing
    assert store.start == 4
    store.trim(100)  # past the end: empty, and the next positions start it again
    assert (store.start, store.end) == (8, 8) and store.since(0) == (8, None)
    store.add(8, torch.ones(2, 1))
    assert (store.start, store.end) == (8, 10)


def test_trimmed_feature_stores_stay_bounded_and_draft_the_same(tmp_path, target_hf, target, monkeypatch):
    """Verifier and head keep features only a window behind what they consumed: nothing read in a normal run
    is lost (the same drafts, the same acceptance), and the stores no longer grow with the sequence."""
    import proposer_service.eagle as eagle_module
    import verifier_service.engine as engine_module

    folder = str(make_head_dir(tmp_path, target[1], torch.arange(VOCAB)))
    ps = prompts(3, seed=21)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    runs = []
    for window in (1 << 20, 2):
        monkeypatch.setattr(engine_module, "FEATURE_WINDOW", window)
        monkeypatch.setattr(eagle_module, "FEATURE_WINDOW", window)
        drafter = make_eagle_drafter(folder, *embeddings(target), num_blocks=256, block_size=4)
        engine = engine_with_eagle(target, drafter, k=3)
        for i, p in enumerate(ps):
            engine.add_request(f"r{i}", p, params)
        outs, longest = {}, 0
        while engine.has_unfinished():
            outs.update({o.request_id: o.output_ids for o in engine.step() if o.finished})
            for seq in engine.scheduler.running:
                if seq.features is not None:
                    assert seq.features.start >= seq.num_features_sent - window
                    longest = max(longest, seq.features.end - seq.features.start)
            for seq_id, state in drafter.states.items():  # behind what its prefix cache was offered, too
                reusable = min(state.num_done, drafter.blocks.num_cached_tokens(seq_id))
                assert state.features.start >= reusable - window
        runs.append((outs, engine.stats.drafted_tokens, engine.stats.accepted_tokens, longest))
    (untrimmed, drafted, accepted, long_store), (trimmed, drafted2, accepted2, short_store) = runs
    assert trimmed == untrimmed == {f"r{i}": hf_greedy(target_hf, p, 60, eos=False) for i, p in enumerate(ps)}
    assert (drafted2, accepted2) == (drafted, accepted) and drafted > 0
    assert long_store > 60 and short_store <= 2 + 3 + 1 + 30  # window + a step's rows (a prompt's at most)


def test_a_sequence_that_never_drafts_keeps_no_features(tmp_path, target):
    """The verifier trims features as it sends them; a sequence never sent (max_draft_tokens = 0) kept them all."""
    folder = str(make_head_dir(tmp_path, target[1], torch.arange(VOCAB)))
    drafter = make_eagle_drafter(folder, *embeddings(target), num_blocks=256, block_size=4)
    engine = engine_with_eagle(target, drafter, k=3)
    p = prompts(1, seed=3)[0]
    engine.add_request("drafts", p, SamplingParams(max_tokens=40, ignore_eos=True))
    engine.add_request("plain", p, SamplingParams(max_tokens=40, ignore_eos=True), max_draft_tokens=0)
    kept = {"drafts": 0, "plain": 0}
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            if seq.features is not None:
                kept[seq.seq_id] = max(kept[seq.seq_id], seq.features.end - seq.features.start)
    assert kept["drafts"] > 0 and kept["plain"] == 0


def engine_with_eagle(target, drafter, k=3, max_num_seqs=4, num_blocks=None, **kw):
    kw.setdefault("adaptive_k", False)
    config = EngineConfig(num_speculative_tokens=k, max_num_seqs=max_num_seqs, max_model_len=128, **kw)
    return build_engine(target, drafter, config, CacheConfig(block_size=4, num_blocks=num_blocks))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, EOS) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def run(engine, ps, params) -> dict[str, list[int]]:
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, params)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o.output_ids for o in engine.step() if o.finished})
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return outs


@pytest.mark.parametrize(
    ("k", "max_num_seqs", "layers", "dtype"),
    [(1, 1, (-1,), "float32"), (3, 4, (-1,), "float32"), (5, 3, (-1,), "float32"), (3, 4, FUSED, "float32")]
    # a head in bf16 (`--dtype auto` with bf16 instructions), and one asked for on a CPU without them, whose
    # packed weights hold fp32 (its fc's bias stays bf16: the product must still take it)
    + [(3, 4, (-1,), "bfloat16"), (3, 4, FUSED, "bfloat16"), (3, 4, FUSED, "bfloat16-no-kernels")],
)
def test_greedy_through_the_engine_equals_transformers(
    tmp_path, target_hf, target, k, max_num_seqs, layers, dtype, monkeypatch
):
    if dtype.endswith("-no-kernels"):
        from shared.model import parallel

        monkeypatch.setattr(parallel, "half_kernels", lambda half: False)
        dtype = dtype.removesuffix("-no-kernels")
    folder = make_head_dir(tmp_path, target[1], torch.arange(VOCAB), layers=layers)
    drafter = make_eagle_drafter(
        str(folder), *embeddings(target), num_blocks=256, block_size=4, dtype=getattr(torch, dtype)
    )
    # the head's dtype whether or not this CPU has bf16 kernels (without them its packed weights hold fp32)
    assert drafter.head.dtype == drafter.kv_cache.layers[0][0].dtype == getattr(torch, dtype)
    engine = engine_with_eagle(target, drafter, k=k, max_num_seqs=max_num_seqs)
    ps = prompts(4, seed=k)
    outs = run(engine, ps, SamplingParams(max_tokens=24, ignore_eos=True))
    for i, p in enumerate(ps):
        assert outs[f"r{i}"] == hf_greedy(target_hf, p, 24, eos=False)
    assert engine.stats.drafted_tokens > 0


def test_seeded_drafts_use_the_targets_noise_and_leave_the_output_unchanged(tmp_path, target):
    _, arch = target
    subset = torch.arange(0, VOCAB, 2)
    drafter = make_eagle_drafter(
        str(make_head_dir(tmp_path, arch, subset)), *embeddings(target), num_blocks=256, block_size=4
    )
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)
    features = torch.randn(2, arch.hidden_size)
    drafts = [
        drafter.propose([DraftRequest(f"a{p}", 3, [5, 9, 13], 2, params, features, 0, draft_position=p)])[0]
        for p in range(6)
    ]
    assert all(d.probs is None and set(d.token_ids) <= set(subset.tolist()) for d in drafts)
    assert len({tuple(d.token_ids) for d in drafts}) > 1  # the noise follows the draft position
    ps = prompts(3, seed=13)
    plain = run(engine_with_eagle(target, None, k=0), ps, params)
    engine = engine_with_eagle(target, drafter, k=3)
    assert run(engine, ps, params) == plain
    assert engine.stats.drafted_tokens > 0


class _Garbling:
    """Passes the drafter wrong features: shifted positions, noise, wrong width, past the prefix."""

    needs_target_features = True

    def __init__(self, inner: EagleDrafter, mode: str) -> None:
        self.inner, self.mode = inner, mode

    def release(self, seq_ids):
        self.inner.release(seq_ids)

    def propose(self, requests):
        garbled = []
        for r in requests:
            f, start = r.features, r.feature_start
            if f is not None:
                if self.mode == "noise":
                    f = torch.randn_like(f) * 100
                elif self.mode == "width":
                    f = f[:, :-1]
                elif self.mode == "shift":
                    start += 1
            garbled.append(DraftRequest(r.seq_id, r.committed_len, r.new_token_ids, r.k, r.params, f, start))
        return self.inner.propose(garbled)


@pytest.mark.parametrize("mode", ["noise", "width", "shift"])
def test_wrong_features_never_change_output(tmp_path, target_hf, target, mode):
    inner = make_eagle_drafter(
        str(make_head_dir(tmp_path, target[1], torch.arange(VOCAB))), *embeddings(target), num_blocks=256, block_size=4
    )
    engine = engine_with_eagle(target, _Garbling(inner, mode), k=3)
    ps = prompts(3, seed=7)
    outs = run(engine, ps, SamplingParams(max_tokens=20, ignore_eos=True))
    for i, p in enumerate(ps):
        assert outs[f"r{i}"] == hf_greedy(target_hf, p, 20, eos=False)


def test_prefix_cache_gap_is_filled_and_output_kept(tmp_path, target_hf, target):
    """A second turn whose prefix the verifier serves from its cache sends no features for it: the head
    reuses its own cached blocks or fills the gap from its guesses; the output stays exact."""
    drafter = make_eagle_drafter(
        str(make_head_dir(tmp_path, target[1], torch.arange(VOCAB))), *embeddings(target), num_blocks=256, block_size=4
    )
    engine = engine_with_eagle(target, drafter, k=3, max_num_seqs=2)
    conv = prompts(1, seed=9)[0]
    for turn in range(3):
        out = run(engine, [conv], SamplingParams(max_tokens=12, ignore_eos=True))["r0"]
        assert out == hf_greedy(target_hf, conv, 12, eos=False)
        conv = conv + out + [turn + 3, turn + 4]
    assert engine.scheduler.prefix_cache.hit_tokens > 0
    assert drafter.blocks.num_cached_blocks > 0


@pytest.mark.parametrize(("gaps", "fills"), [((12, 12, 12, 12), 12), ((3, 12, 20, 30), 1 + 16)], ids=["even", "mixed"])
def test_a_served_prefix_is_filled_for_a_whole_batch_at_once(tmp_path, target, gaps, fills):
    """Sequences whose first positions came from the verifier's prefix cache (no features for them) fill that gap
    from the head's guesses one position of every sequence per forward, not one sequence after another (a gap
    longer than MAX_SEQUENTIAL_FILL: its start in one bulk forward for all); each sequence's head state at its last
    committed position is what it is alone (within rounding: products over more rows may round differently)."""
    folder = str(make_head_dir(tmp_path, target[1], torch.arange(VOCAB), scale=3.0))
    rng = random.Random(4)
    length = 40
    seqs = [[rng.randrange(1, EOS) for _ in range(length)] for _ in range(4)]
    features = [
        torch.randn(length - 1 - gap, target[1].hidden_size, generator=torch.Generator().manual_seed(i))
        for i, gap in enumerate(gaps)
    ]

    def request(i: int) -> DraftRequest:
        return DraftRequest(f"s{i}", length, seqs[i], 3, SamplingParams(), features[i], gaps[i], 0, "", 0)

    alone = []
    for i in range(4):
        drafter = make_eagle_drafter(folder, *embeddings(target), num_blocks=64, block_size=4)
        assert drafter.propose([request(i)])[0].token_ids
        alone.append(drafter.states[f"s{i}"].last_hidden)
    drafter = make_eagle_drafter(folder, *embeddings(target), num_blocks=64, block_size=4)
    forwards = 0
    forward = drafter._forward

    def counted(rows):
        nonlocal forwards
        forwards += 1
        return forward(rows)

    drafter._forward = counted
    assert all(draft.token_ids for draft in drafter.propose([request(i) for i in range(4)]))
    for i in range(4):
        torch.testing.assert_close(drafter.states[f"s{i}"].last_hidden, alone[i], rtol=1e-4, atol=1e-5)
    assert forwards == fills + 1 + 2  # the gaps' forwards, the real features, two more draft positions


def test_preemption_keeps_output(tmp_path, target_hf, target):
    drafter = make_eagle_drafter(
        str(make_head_dir(tmp_path, target[1], torch.arange(VOCAB))), *embeddings(target), num_blocks=256, block_size=4
    )
    engine = engine_with_eagle(target, drafter, k=3, max_num_seqs=4, num_blocks=34)
    ps = prompts(4, seed=11)
    outs = run(engine, ps, SamplingParams(max_tokens=40, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(ps):
        assert outs[f"r{i}"] == hf_greedy(target_hf, p, 40, eos=False)


def _law_pvalues(target_hf, target, drafter_factory, n=3000):
    temperature = 1.5
    first, second = two_token_law(target_hf, lambda logits: torch.softmax(logits / temperature, -1), VOCAB)
    engine = engine_with_eagle(target, drafter_factory(), k=3, max_num_seqs=64, max_waiting=5000)
    params = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True)
    counts = first_two_token_counts(engine, n, lambda i: params, VOCAB)
    return [law_pvalue(counts[0], first, n), law_pvalue(counts[1], second, n)], engine


@pytest.mark.parametrize(
    ("layers", "dtype"), [((-1,), "float32"), (FUSED, "float32"), ((-1,), "bfloat16")], ids=["eagle1", "eagle3", "bf16"]
)
def test_sampled_output_law_matches_target_with_subset_drafts(tmp_path, target_hf, target, layers, dtype):
    """The head drafts from a distribution that is zero outside its subset and truncated to its top 8:
    the emitted tokens still follow the target's law (first and second token, chi-square). The second
    token comes from a speculative step. Negative control: the same drafts with a wrong claimed law fail.
    A bf16 head's distribution is computed from bf16 products: what it sends must still be what it drew from."""
    subset = torch.arange(0, VOCAB, 3)  # a third of the vocabulary
    folder = str(make_head_dir(tmp_path, target[1], subset, scale=10.0, layers=layers))

    def honest():
        return make_eagle_drafter(
            folder, *embeddings(target), num_blocks=2048, block_size=4, top_n=8, dtype=getattr(torch, dtype)
        )

    pvalues, engine = _law_pvalues(target_hf, target, honest)
    assert min(pvalues) > 1e-4, pvalues
    assert 0 < engine.stats.accepted_tokens < engine.stats.drafted_tokens  # both paths were exercised
    lying_pvalues, _ = _law_pvalues(target_hf, target, lambda: WrongDraftLaw(honest()))
    assert lying_pvalues[1] < 1e-6, lying_pvalues


def test_head_dtype_auto_is_bf16_only_where_the_cpu_multiplies_bf16(monkeypatch):
    from shared.model import parallel
    from shared.model.dtype import resolve_head_dtype

    for has_kernels, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(parallel, "half_kernels", lambda dtype, has=has_kernels: has and dtype == torch.bfloat16)
        assert resolve_head_dtype("auto", "cpu", "unused") == expected
        assert resolve_head_dtype("float32", "cpu", "unused") == torch.float32  # asked for: taken as it is
        assert resolve_head_dtype("float16", "cpu", "unused") == torch.float16
    with pytest.raises(ValueError, match="--dtype must be one of"):
        resolve_head_dtype("fp8", "cpu", "unused")
