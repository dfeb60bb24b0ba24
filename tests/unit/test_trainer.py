"""The trainer: the whole pipeline on a tiny random target (`--quick`: data, subset, training, held-out
selection, card, resume), which positions are scored, the training-time-test unroll against a hand-written
two-step case, and the held-out measure against greedy drafting with the serving head."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from shared.kv.cache import KVCache
from shared.model.attention import SeqSpan, build_metadata, default_scale
from shared.model.eagle import (
    _rms_norm,
    arch_from_config,
    build_head,
    head_config,
    init_head_state,
    load_head_state,
    reference_forward,
    save_head,
)
from shared.model.rope import RotaryEmbedding, apply_rotary
from specdec_train.__main__ import main
from specdec_train.data import load_samples
from specdec_train.evaluate import rows_for
from specdec_train.heldout import HeldOut, walk_rounds
from specdec_train.report import frequency_subset, measure_acceptance
from specdec_train.train import (
    Batch,
    TrainConfig,
    Trainer,
    epoch_batches,
    make_batch,
    paced_steps,
    plan_batches,
    scored,
    unrolled_forward,
)
from tests.tiny import ours, tiny_hf_model


def test_quick_pipeline_writes_a_loadable_head_and_resumes(tmp_path):
    work, out = tmp_path / "work", tmp_path / "head"
    args = ["--quick", "--work-dir", str(work), "--out", str(out), "--threads", "1"]
    main(args)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["SpecdecEagleHead"] and config["draft_vocab_size"] == 64
    assert config["target_feature_layers"] == [0, 2, 3]  # a low, a middle and a high layer of the 4-layer target
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        first = {name: f.get_tensor(name) for name in names}
    assert {"vocab_subset", "fuse.weight", "norm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert {t.dtype for n, t in first.items() if n != "vocab_subset"} == {torch.float16}
    assert first["fuse.weight"].shape == (64, 3 * 64)
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    card = (out / "README.md").read_text()
    assert "python -m specdec_train" in card and "tokens per verify step" in card
    assert "| tree k=4, <= 10 nodes, T=0.8 unseeded |" in card
    shards = sorted((work / "data").glob("shard-*.pt"))
    stamps = [p.stat().st_mtime_ns for p in shards]
    checkpoint = work / "checkpoint-seed0.pt"
    ckpt = torch.load(checkpoint, weights_only=False)
    assert ckpt["step"] == 6 and any("heldout" in h for h in ckpt["history"])

    main(args)  # everything is on disk: nothing is generated or trained again
    assert [p.stat().st_mtime_ns for p in shards] == stamps
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert all(torch.equal(f.get_tensor(n), first[n]) for n in names)
    main([*args, "--resume", "--steps", "8", "--feature-store-gb", "1"])  # a further sitting trains on to 8 steps
    assert torch.load(checkpoint, weights_only=False)["step"] == 8
    (store,) = (work / "features").iterdir()  # the features its steps prefilled, kept for the next sitting
    assert store.name == "tiny-target-layers0_2_3-fp16" and list(store.glob("*.pt"))


def test_a_sitting_stopped_before_its_schedule_ends_is_reproduced_by_its_card_and_resumes(tmp_path):
    """A sitting that stopped before the end of its schedule (its time budget, here --stop-at) trained the steps up
    to there on the schedule's learning rates; the card's command, which has no clock, says both, and a later
    sitting trains on from the checkpoint to the schedule's end. Before --stop-at the card gave the schedule's
    length alone, which trains past where the head was taken."""
    work, out = tmp_path / "work", tmp_path / "head"
    args = ["--quick", "--work-dir", str(work), "--out", str(out), "--threads", "1"]
    main([*args, "--steps", "6", "--stop-at", "3"])
    checkpoint = work / "checkpoint-seed0.pt"
    ckpt = torch.load(checkpoint, weights_only=False)
    assert ckpt["step"] == 3 and ckpt["planned_steps"] == 6
    assert "--steps 6 --stop-at 3 --time-budget-min 0" in (out / "README.md").read_text()
    main([*args, "--resume", "--steps", "6"])
    assert torch.load(checkpoint, weights_only=False)["step"] == 6
    assert "--steps 6 --time-budget-min 0" in (out / "README.md").read_text()
    assert "--stop-at" not in (out / "README.md").read_text()


def test_a_warm_start_drafts_over_the_subset_of_its_own_data_not_its_heads(tmp_path):
    """A warm start takes the frequency subset of the data it trains on: the subset's LM-head rows are the
    target's own, frozen, so an old head's subset (the committed one's was counted with prompt text and held 91%
    of generated tokens, a fresh one 98%) would only keep frequent answer tokens out of every draft."""
    work, first, stale, second = (tmp_path / name for name in ("work", "first", "stale", "second"))
    quick = ["--quick", "--work-dir", str(work), "--threads", "1", "--feature-layers", "-1"]
    main([*quick, "--out", str(first)])
    config, state = json.loads((first / "config.json").read_text()), load_head_state(first)
    vocab_size = config["vocab_size"]
    state["vocab_subset"] = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(0))[:64]
    save_head(stale, config, state)
    main([*quick, "--seed", "1", "--out", str(second), "--init-from", str(stale)])
    samples = load_samples(sorted((work / "data").glob("shard-*.pt")))
    eos = json.loads((work / "tiny-target" / "config.json").read_text())["eos_token_id"]
    kept = load_head_state(second)["vocab_subset"]
    assert torch.equal(kept, frequency_subset(samples, vocab_size, 64, (eos,)))
    assert not torch.equal(kept, state["vocab_subset"])


def test_a_fused_head_warm_starts_a_fused_head_of_its_layers_and_no_other(tmp_path):
    """`--init-from` a fused head: a head reading the same target layers trains on from every weight; other
    layers are refused at once, before any data is generated (`fuse`'s columns belong to the old layers)."""
    work, first, second = (tmp_path / name for name in ("work", "first", "second"))
    quick = ["--quick", "--work-dir", str(work), "--threads", "1"]
    main([*quick, "--out", str(first)])
    warm = [*quick, "--seed", "1", "--out", str(second), "--init-from", str(first)]
    with pytest.raises(SystemExit, match=r"reads the target's layers \[0, 2, 3\].*--feature-layers gives \[0, 3\]"):
        main([*warm, "--feature-layers", "0,3"])
    assert not second.exists()
    main(warm)
    assert "every weight of that fused head, trained on from there" in (second / "README.md").read_text()


def test_epochs_of_different_lengths_are_walked_whole_and_a_resumed_run_goes_on_where_it_stopped():
    """Conversations are grouped into steps in each epoch's own shuffled order, so epochs differ in length: every
    epoch's batches come in turn, none skipped or repeated (counting epochs by the first one's length stalled a
    warm start of seed 1 for ever, its epoch 0 being shorter than the count), and a run resumed at any step goes
    on with the batch it stopped at."""
    lengths = [int(n) for n in torch.randint(1, 100, (60,), generator=torch.Generator().manual_seed(0))]
    plans = [plan_batches(lengths, 150, random.Random(1 * 1000 + epoch)) for epoch in range(4)]
    assert len({len(plan) for plan in plans}) > 1  # the case in question: epochs of different lengths
    walked = [group for plan in plans for group in plan]
    assert list(itertools.islice(epoch_batches(lengths, 150, 1, 0), len(walked))) == walked
    for start in (1, len(plans[0]) - 1, len(plans[0]), len(plans[0]) + len(plans[1]) + 2):
        resumed = epoch_batches(lengths, 150, 1, start)
        assert list(itertools.islice(resumed, len(walked) - start)) == walked[start:]
    with pytest.raises(ValueError, match="no conversations"):  # not an endless walk of empty epochs
        next(epoch_batches([], 150, 1, 0))


def test_frequency_subset_ranks_generated_ids_by_count_then_id():
    tokens = torch.tensor([4, 4, 4, 4, 5, 5, 5, 9, 9, 2])
    generated = torch.tensor([False] * 4 + [True] * 6)  # the prompt's 4s do not count
    subset = frequency_subset([{"tokens": tokens, "generated": generated}], vocab_size=12, size=5, always=(11,))
    assert subset.tolist() == [11, 5, 9, 2, 0]


def test_sampled_rows_carry_a_seed_unless_told_not_to():
    """A seeded request drafts a chain (the engine follows its seeded token): the T = 0.8 tree row must go unseeded."""

    class Engine:
        config = type("Config", (), {"num_speculative_tokens": 4})

        def __init__(self):
            self.seeds = []

        def add_request(self, request_id, ids, params):
            self.seeds.append(params.seed)

        def has_unfinished(self):
            return False

    prompts = [[1, 2], [3, 4], [5]]
    for temperature, seeded, expected in ((0.8, True, [0, 1, 2]), (0.8, False, [None] * 3), (0.0, True, [None] * 3)):
        engine = Engine()
        measure_acceptance(engine, prompts, 8, temperature, seeded)
        assert engine.seeds == expected
    (tree_sampled,) = [row for row in rows_for(10) if row.tree_nodes and row.temperature]
    assert tree_sampled.tree_nodes == 10 and not tree_sampled.seeded


def test_help():
    result = subprocess.run([sys.executable, "-m", "specdec_train", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "--quick" in result.stdout and "--resume" in result.stdout


def test_scored_positions_follow_generated_runs():
    """Position j drafts t_{j+2}; at unroll step s the chain t_{j-s+2} .. t_{j+2} must be the target's."""
    generated = torch.tensor([0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.bool)  # prompt, answer, question
    assert scored(generated, 1).nonzero().flatten().tolist() == [2, 3, 4, 8, 9]
    assert scored(generated, 2).nonzero().flatten().tolist() == [3, 4, 9]
    assert scored(generated, 3).nonzero().flatten().tolist() == [4]
    assert not scored(generated, 4).any()


def _arch_and_state(fused: bool, seed: int = 0):
    _, target_arch = ours(tiny_hf_model(seed=3, layers=4))
    layers = (0, 2, 3) if fused else (-1,)
    config = head_config(target_arch, 1, 16, layers)
    arch = arch_from_config(config)
    state = init_head_state(arch, torch.arange(16), seed, layers)
    with torch.no_grad():
        for name, t in state.items():
            if name.endswith("proj.weight"):
                t.mul_(10)  # attention that is far from uniform, so a wrong key would show
            if "norm" in name:
                t.uniform_(0.5, 1.5)
    return arch, state, layers


def test_unroll_step_two_equals_a_hand_written_draft():
    """Step 2 at position j by hand: the head's input is its own state at j - 1, and its one layer attends to
    step 1's keys at positions <= j - 1 and to its own key at j."""
    arch, state, layers = _arch_and_state(fused=True)
    rotary = RotaryEmbedding(arch.rope_parameters, arch.head_dim, arch.max_position_embeddings)
    gen = torch.Generator().manual_seed(1)
    seq_len, h = 7, arch.hidden_size
    features = torch.randn(1, seq_len, len(layers) * h, generator=gen) * 5
    embeds = torch.randn(1, seq_len, h, generator=gen)
    with torch.no_grad():
        steps = unrolled_forward(state, arch, rotary, features, embeds, 2)
        p = "layers.0."
        g = torch.cat([torch.zeros(1, 1, h), steps[0][:, :-1]], dim=1)[0]  # step 2's inputs: x1 at j - 1

        def project(x: torch.Tensor, positions: torch.Tensor):
            y = _rms_norm(x, state[f"{p}input_layernorm.weight"], arch.rms_norm_eps)
            cos, sin = rotary(positions, x.dtype)
            q = apply_rotary(
                F.linear(y, state[f"{p}self_attn.q_proj.weight"]).view(-1, arch.num_heads, arch.head_dim), cos, sin
            )
            k = apply_rotary(
                F.linear(y, state[f"{p}self_attn.k_proj.weight"]).view(-1, arch.num_kv_heads, arch.head_dim), cos, sin
            )
            v = F.linear(y, state[f"{p}self_attn.v_proj.weight"]).view(-1, arch.num_kv_heads, arch.head_dim)
            return q, k, v

        positions = torch.arange(seq_len)
        fused = F.linear(_rms_norm(features[0].view(seq_len, 3, h), None, 1e-6).flatten(1), state["fuse.weight"])
        x1 = F.linear(torch.cat([fused, embeds[0]], -1), state["fc.weight"], state["fc.bias"])
        _, k1, v1 = project(x1, positions)  # step 1's keys: the real positions
        x2 = F.linear(torch.cat([g, embeds[0]], -1), state["fc.weight"], state["fc.bias"])
        q2, k2, v2 = project(x2, positions)
        group = arch.num_heads // arch.num_kv_heads
        for j in range(1, seq_len):
            keys = torch.cat([k1[:j], k2[j : j + 1]])  # [j + 1, kv_heads, D]
            values = torch.cat([v1[:j], v2[j : j + 1]])
            heads = []
            for head in range(arch.num_heads):
                kv_head = head // group
                weights = torch.softmax(keys[:, kv_head] @ q2[j, head] * default_scale(arch.head_dim), dim=0)
                heads.append(weights @ values[:, kv_head])
            x = x2[j] + F.linear(torch.cat(heads), state[f"{p}self_attn.o_proj.weight"])
            y = _rms_norm(x, state[f"{p}post_attention_layernorm.weight"], arch.rms_norm_eps)
            mlp = F.silu(F.linear(y, state[f"{p}mlp.gate_proj.weight"])) * F.linear(y, state[f"{p}mlp.up_proj.weight"])
            x = x + F.linear(mlp, state[f"{p}mlp.down_proj.weight"])
            torch.testing.assert_close(steps[1][0, j], x, atol=1e-4, rtol=1e-4)
        # and step 1 is the plain causal forward on the fused features
        torch.testing.assert_close(steps[0], reference_forward(state, arch, rotary, fused[None], embeds))


@pytest.mark.parametrize("fused", [False, True])
def test_heldout_measure_is_greedy_drafting_with_the_serving_head(tmp_path, fused):
    """For every start m, the serving head drafting greedily from the real features up to m accepts as many
    tokens as the held-out measure says (a draft is accepted when it is the next token of the answer)."""
    target_hf = tiny_hf_model(seed=5, layers=4)
    model, target_arch = ours(target_hf)
    arch, state, layers = _arch_and_state(fused, seed=2)
    subset = torch.tensor([3, 7])  # two ids: about half the drafts hit the answer's tokens drawn from them
    state["vocab_subset"] = subset
    save_head(tmp_path, head_config(target_arch, 1, 2, layers), state)
    embed, lm_head = model.embed_tokens.weight, model.lm_head_weight
    head, _ = build_head(tmp_path, embed, lm_head)
    gen = torch.Generator().manual_seed(3)
    tokens = subset[torch.randint(0, 2, (24,), generator=gen)].int()
    generated = torch.tensor([False] * 5 + [True] * 19)
    from specdec_train.features import TargetFeatures

    features = TargetFeatures(model, layers)
    trainer = Trainer(arch, embed, lm_head, subset, TrainConfig(unroll=3), layers)
    with torch.no_grad():
        for name, value in load_head_state(tmp_path).items():  # the fp16 file's weights, as served
            trainer.state[name].copy_(value)
    k = 3
    chain = HeldOut([{"tokens": tokens, "generated": generated}], features, k, max_len=64).measure(trainer)
    ((_, layer_feats),) = features([tokens])
    ids = tokens.long()
    accepted, starts, hits_at = torch.zeros(k), 0, {}
    for m in range(len(ids) - k - 1):
        if not generated[m + 1 : m + k + 2].all():
            continue
        cache = KVCache(1, 16, 4, arch.num_kv_heads, arch.head_dim)
        table = list(range(16))
        out = head(
            head.fuse_features(layer_feats[: m + 1]),
            ids[1 : m + 2],
            cache.layers,
            build_metadata([SeqSpan(table, 0, m + 1)], 4),
        )
        guess, hits = out[-1], 0
        for s in range(k):
            draft = int(subset[head.compute_logits(guess[None]).argmax()])
            if draft != int(ids[m + s + 2]):
                break
            hits += 1
            guess = head(
                guess[None], torch.tensor([draft]), cache.layers, build_metadata([SeqSpan(table, m + 1 + s, 1)], 4)
            )[0]
        accepted[:hits] += 1
        starts += 1
        hits_at[m] = hits
    assert chain.starts == starts and starts > 0
    assert chain.per_start == pytest.approx((accepted / starts).tolist())
    # An engine's rounds: the first drafts after the answer's first token (position 5, from the prefill), each
    # next one after the accepted drafts and the target's own token
    m, per_round = 4, []
    while m in hits_at:
        per_round.append(hits_at[m])
        m += hits_at[m] + 1
    assert chain.rounds == len(per_round) < starts
    assert chain.per_position == pytest.approx([sum(h > i for h in per_round) / len(per_round) for i in range(k)])
    assert 0 < chain.per_position[0] < 1


def test_rounds_are_walked_as_an_engine_steps_through_each_answer():
    # starts 0-1: a prompt; 2-7: one answer; 8-9: the next turn's prompt; 10-13: the next answer
    ok = [False] * 2 + [True] * 6 + [False] * 2 + [True] * 4
    accepted = [4, 4, 1, 4, 0, 2, 3, 3, 4, 4, 3, 1, 1, 1]
    # answer 1: start 2 accepts 1 -> start 4 accepts 0 -> start 5 accepts 2 -> start 8, past the answer;
    # answer 2: start 10 accepts 3 -> start 14, past the row
    assert walk_rounds(accepted, ok) == [1, 0, 2, 3]
    assert walk_rounds([0] * 3, [True] * 3) == [0, 0, 0]
    assert walk_rounds([2, 2], [False, False]) == []


def test_make_batch_teacher_rows_line_up_with_scored_positions():
    tokens = torch.arange(10, dtype=torch.int32)
    generated = torch.tensor([False] * 3 + [True] * 7)
    final = torch.arange(10.0).unsqueeze(1).repeat(1, 4)  # row i holds i: the teacher row tells its position
    layers = torch.zeros(10, 8)
    batch = make_batch([{"tokens": tokens, "generated": generated}], [(final, layers)], unroll=2, max_len=5)
    assert batch is not None and batch.features.shape == (2, 5, 8)  # windows of positions [0, 5) and [5, 9)
    assert batch.valid[0].tolist() == [[False, False, True, True, True], [True, True, True, False, False]]
    assert batch.valid[1].tolist() == [[False, False, False, True, True], [False, True, True, False, False]]
    # position j's teacher is the final state at j + 1
    assert batch.teacher_feats[:, 0].tolist() == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert batch.next_ids[1].tolist() == [6, 7, 8, 9, 0]


def test_packed_windows_train_exactly_as_one_window_a_row():
    """Packing short windows into shared rows changes no scored position's draft: the loss, every unroll step's
    agreement and the gradients equal those of one window a row, in fewer rows."""
    model, _ = ours(tiny_hf_model(seed=5, layers=4))
    arch, state, layers = _arch_and_state(fused=True)
    embed, lm_head = model.embed_tokens.weight, model.lm_head_weight
    gen = torch.Generator().manual_seed(2)
    convs, feats = [], []
    for n in (23, 9, 14, 6, 17):  # with max_len 10: windows of 10, 10, 2 / 8 / 10, 3 / 5 / 10, 6
        generated = torch.rand(n, generator=gen) > 0.2
        convs.append({"tokens": torch.randint(0, 96, (n,), generator=gen).int(), "generated": generated})
        feats.append((torch.randn(n, arch.hidden_size, generator=gen), torch.randn(n, 3 * 64, generator=gen) * 5))
    results = []
    for pack in (False, True):
        trainer = Trainer(arch, embed, lm_head, torch.arange(16), TrainConfig(unroll=3), layers)
        with torch.no_grad():
            for name, value in state.items():
                trainer.state[name].copy_(value)
        batch = make_batch(convs, feats, unroll=3, max_len=10, pack=pack)
        assert batch is not None
        loss, stats = trainer.loss(batch)
        loss.backward()
        results.append((batch.features.shape[0], loss.item(), stats, {n: t.grad for n, t in trainer.state.items()}))
    (rows, loss, stats, grads), (packed_rows, packed_loss, packed_stats, packed_grads) = results
    assert packed_rows < rows
    assert packed_loss == pytest.approx(loss, rel=1e-5) and packed_stats == pytest.approx(stats, rel=1e-5)
    for name, grad in grads.items():
        if grad is not None:
            torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-5)


def test_warm_start_from_an_eagle1_head_drafts_like_it():
    """A fused head reading (0, -1) warm-started from an EAGLE-1 head gives, on the target's own features,
    the EAGLE-1 head's logits up to the final state's RMS varying a little from position to position."""
    target_hf = tiny_hf_model(seed=5, layers=4)
    model, target_arch = ours(target_hf)
    embed, lm_head = model.embed_tokens.weight, model.lm_head_weight
    old_arch, old_state, _ = _arch_and_state(fused=False, seed=4)
    layers = (0, -1)
    trainer = Trainer(old_arch, embed, lm_head, torch.arange(16), TrainConfig(), layers)
    from specdec_train.features import TargetFeatures

    tokens = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(0))
    ((final, feats),) = TargetFeatures(model, layers)([tokens[0]])
    trainer.start_from(old_state, Batch(feats[None], tokens, final[None]))
    rotary = RotaryEmbedding(old_arch.rope_parameters, old_arch.head_dim, old_arch.max_position_embeddings)
    embeds = F.embedding(tokens, embed)
    with torch.no_grad():
        old_x = reference_forward(old_state, old_arch, rotary, final[None], embeds)
        old_logits = old_x @ lm_head[:16].T
        new_logits = trainer.logits(unrolled_forward(trainer.state, old_arch, rotary, feats[None], embeds, 1)[0])
    assert ((new_logits - old_logits).norm() / old_logits.norm()).item() < 0.2
    assert (old_logits.argmax(-1) == new_logits.argmax(-1)).float().mean() > 0.9
    with pytest.raises(ValueError, match="include -1"):
        Trainer(old_arch, embed, lm_head, torch.arange(16), TrainConfig(), (0, 1)).start_from(old_state, None)


def _unrolled_old_and_new(trainer: Trainer, old_state, old_arch, embed, unroll: int):
    """(old head's step, warm-started head's step) for each unroll step, on the same random features."""
    gen = torch.Generator().manual_seed(2)
    width = old_state["fuse.weight"].shape[1] if "fuse.weight" in old_state else old_arch.hidden_size
    features, next_ids = torch.randn(1, 9, width, generator=gen) * 3, torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        old = unrolled_forward(old_state, old_arch, trainer.rotary, features, F.embedding(next_ids, embed), unroll)
        new = trainer.forward(Batch(features, next_ids, features[0]), unroll)
    return list(zip(old, new, strict=True))


@pytest.mark.parametrize("fused", [False, True], ids=["eagle1", "fused"])
def test_warm_start_from_a_head_of_the_same_kind_goes_on_from_its_weights(fused):
    """Training on from a committed head (new data, another sitting's settings): every weight, `fuse` included,
    copied as it is, so the first forward is the old head's exactly. A fused head cannot start an EAGLE-1 head,
    nor a fused head of other layers (until 2026-12-07 every fused source was refused: only --resume of the same
    run went on from one)."""
    arch, old_state, layers = _arch_and_state(fused=fused, seed=4)
    embed, lm_head = torch.randn(96, arch.hidden_size), torch.randn(96, arch.hidden_size)
    trainer = Trainer(arch, embed, lm_head, torch.arange(16), TrainConfig(), layers)
    assert not torch.equal(trainer.state["fc.weight"], old_state["fc.weight"])
    trainer.start_from(old_state, None)
    for old_step, new_step in _unrolled_old_and_new(trainer, old_state, arch, embed, 2):
        assert torch.equal(old_step, new_step)
    _, fused_state, fused_layers = _arch_and_state(fused=True)
    other = Trainer(arch, embed, lm_head, torch.arange(16), TrainConfig(), fused_layers[:2]) if fused else trainer
    with pytest.raises(ValueError, match="fused head warm-starts only a fused head that reads as many target layers"):
        other.start_from(fused_state, None)


def test_a_deeper_head_warm_started_from_an_eagle1_head_drafts_exactly_like_it_and_its_new_layer_can_learn():
    """Two decoder layers from a one-layer head: layer 0 copied, layer 1 the identity (zero output projections),
    so every unroll step equals the old head's; the loss has a gradient on those projections, so training
    moves them."""
    arch, old_state, layers = _arch_and_state(fused=False, seed=4)
    deep_arch = dataclasses.replace(arch, num_layers=2)
    embed, lm_head = torch.randn(96, arch.hidden_size), torch.randn(96, arch.hidden_size)
    trainer = Trainer(deep_arch, embed, lm_head, torch.arange(16), TrainConfig(unroll=3), layers)
    trainer.start_from(old_state, None)
    for old_step, new_step in _unrolled_old_and_new(trainer, old_state, arch, embed, 3):
        assert torch.equal(old_step, new_step)
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        assert not trainer.state[f"layers.1.{name}"].any()
    gen = torch.Generator().manual_seed(3)
    conv = {"tokens": torch.randint(0, 96, (10,), generator=gen), "generated": torch.ones(10, dtype=torch.bool)}
    final = torch.randn(10, arch.hidden_size, generator=gen) * 3
    batch = make_batch([conv], [(final, final)], unroll=3, max_len=10)
    assert batch is not None
    loss, _ = trainer.loss(batch)
    loss.backward()
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        assert trainer.state[f"layers.1.{name}"].grad.abs().sum() > 0


class CountingFeatures:
    """TargetFeatures with its prefills counted: a cache or store hit must not prefill."""

    def __init__(self, inner) -> None:
        self.inner, self.rows = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, rows):
        self.rows += len(rows)
        return self.inner(rows)


def test_features_are_rounded_as_the_wire_sends_them():
    from specdec_train.features import TargetFeatures

    model, _ = ours(tiny_hf_model(seed=5, layers=4))
    tokens = torch.randint(0, 96, (11,), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    ((final, layers),) = TargetFeatures(model, (1, -1))([tokens])
    arch = model.arch
    cache = KVCache(arch.num_layers, 4, 16, arch.num_kv_heads, arch.head_dim)
    meta = build_metadata([SeqSpan([0], 0, 11)], 16)
    with torch.inference_mode():
        ref_final, ref_layers = model.forward_with_layers(tokens.long(), cache.layers, meta, (1, -1))
    assert torch.equal(final, ref_final.half().float()) and torch.equal(layers, ref_layers.half().float())
    assert not torch.equal(final, ref_final)  # rounded, not the fp32 values


@pytest.mark.parametrize("layers", [(0, -1), (0, 2)])
def test_cached_features_are_those_recomputed_and_the_cache_is_bounded(layers):
    from specdec_train.features import CachedFeatures, TargetFeatures

    model, _ = ours(tiny_hf_model(seed=5, layers=4))
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 96, (n,), generator=gen, dtype=torch.int32) for n in (20, 7, 13)]
    plain = TargetFeatures(model, layers)
    counted = CountingFeatures(TargetFeatures(model, layers))
    cached = CachedFeatures(counted, max_bytes=cached_bytes(plain, 27))
    assert not cached.holds_all([20, 7, 13]) and cached.holds_all([20, 7])
    first, again = cached(rows), cached(list(reversed(rows)))
    assert len(cached.store) == 2 and counted.rows == 3 + 1  # the third row did not fit: computed again
    for got in (first, list(reversed(again))):
        for (final, feats), (ref_final, ref_feats) in zip(got, plain(rows), strict=True):
            assert torch.equal(final, ref_final) and torch.equal(feats, ref_feats)
    cached([rows[0]])
    assert counted.rows == 4  # served from memory, not recomputed


def cached_bytes(features, num_tokens: int) -> int:
    width = len(features.layers) + (0 if -1 in features.layers else 1)  # the final state is stored apart
    return num_tokens * width * features.model.arch.hidden_size * 2  # fp16


@pytest.mark.parametrize("layers", [(-1,), (0, 2)])
def test_feature_store_serves_later_sittings_from_disk_exactly(tmp_path, layers):
    from specdec_train.features import FeatureStore, TargetFeatures

    model, _ = ours(tiny_hf_model(seed=5, layers=4))
    gen = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, 96, (n,), generator=gen, dtype=torch.int32) for n in (9, 17, 5)]
    plain = TargetFeatures(model, layers)
    folder = FeatureStore.folder_for(tmp_path, "/models/some-target/", layers)
    counted = CountingFeatures(TargetFeatures(model, layers))
    budget = plain.stored_bytes(9 + 17)
    first = FeatureStore(counted, folder, budget)(rows)
    assert counted.rows == 3 and len(list(folder.glob("*.pt"))) == 2  # the third did not fit the budget
    assert not list(folder.glob("*.tmp"))
    later = CountingFeatures(TargetFeatures(model, layers))  # another sitting: a new process, the same folder
    store = FeatureStore(later, folder, budget)
    assert store.used_bytes == sum(p.stat().st_size for p in folder.glob("*.pt"))  # counted from the folder
    again = store(rows)
    assert later.rows == 1 and (store.hits, store.misses) == (2, 1)
    for got in (first, again):
        for (final, feats), (ref_final, ref_feats) in zip(got, plain(rows), strict=True):
            assert torch.equal(final, ref_final) and torch.equal(feats, ref_feats)
    assert folder.name == f"some-target-layers{'_'.join(map(str, layers))}-fp16"


def test_paced_steps_count_the_prefill_once_when_it_is_cached():
    # 10 paced steps took 100 s, 60 of them the prefill; an epoch is 20 steps.
    assert paced_steps(1000.0, 100.0, 60.0, 20, prefill_once=False) == 100
    assert paced_steps(1000.0, 100.0, 60.0, 20, prefill_once=True) == 20 + 200  # 200 s, then 4 s a step
    assert paced_steps(150.0, 100.0, 60.0, 20, prefill_once=True) == 15  # the budget ends in the first epoch


def test_acceptance_per_position_sums_to_the_tokens_per_step():
    """Per position: the share of rounds whose accepted path reached it, also when a tree is shallower than k
    in some rounds (a share of the rounds that drafted that deep would not add up)."""
    from specdec_train.report import Acceptance

    result = Acceptance(4, accepted_at=[0] * 4)
    for depth, accepted in ((4, 4), (3, 3), (4, 1), (2, 0)):
        result.add(depth, accepted)
    assert result.per_position == pytest.approx([3 / 4, 2 / 4, 2 / 4, 1 / 4])
    assert 1 + sum(result.per_position) == pytest.approx(result.mean_accepted_length)


def test_data_generated_in_bf16_records_its_dtype_in_each_shard(tmp_path, monkeypatch):
    from specdec_train import data
    from specdec_train.__main__ import quick_target

    loaded = []
    real_load = data.load_model
    monkeypatch.setattr(data, "load_model", lambda name, dtype: loaded.append(dtype) or real_load(name, dtype))
    config = data.DataConfig(
        quick_target(tmp_path), tmp_path / "data", 8, batch=8, shard_size=4, random_prompts=True, max_new_tokens=8,
        dtype="bfloat16",
    )  # fmt: skip
    paths = data.generate(config, progress=False)
    assert loaded == [torch.bfloat16] and len(paths) == 2
    assert {torch.load(p)["dtype"] for p in paths} == {"bfloat16"}
    assert json.loads((tmp_path / "data" / "progress.json").read_text())["shards_done"] == 2  # the files on disk
    samples = data.load_samples(paths)
    assert len(samples) == 8 and all(s["generated"].any() for s in samples)


def test_generation_dtype_auto_is_bf16_only_with_bf16_kernels():
    from shared.model.parallel import half_kernels
    from specdec_train.data import generation_dtype

    assert generation_dtype("auto") == ("bfloat16" if half_kernels(torch.bfloat16) else "float32")
    assert generation_dtype("float32") == "float32" and generation_dtype("bfloat16") == "bfloat16"


def test_a_checkpoint_rated_by_the_older_measure_has_its_best_weights_rated_again(tmp_path):
    """Before 2026-12-06 the held-out measure counted every start position (about 0.13 above the walked rounds): a
    resumed sitting's weights must not have to beat that figure, so the best weights are measured again, and the
    sitting's own weights are left as they were."""
    model, _ = ours(tiny_hf_model(seed=5, layers=4))
    arch, _, layers = _arch_and_state(fused=False)
    embed, lm_head = model.embed_tokens.weight, model.lm_head_weight
    name = "fc.bias"
    path = tmp_path / "checkpoint.pt"
    trainer = Trainer(arch, embed, lm_head, torch.arange(16), TrainConfig(), layers)
    best = {k: v.detach().clone() for k, v in trainer.state.items()}
    best[name].fill_(0.25)
    trainer.best = (9.0, 3, best)
    trainer.save_checkpoint(path)
    current = trainer.state[name].detach().clone()

    def measured(t: Trainer) -> float:  # a figure of the weights it is given
        calls.append(1)
        return float(t.state[name].mean())

    for older in (False, True):
        if older:
            ckpt = torch.load(path, weights_only=False)
            del ckpt["heldout_measure"]
            torch.save(ckpt, path)
        calls = []
        resumed = Trainer(arch, embed, lm_head, torch.arange(16), TrainConfig(), layers)
        resumed.fit([], lambda tokens: [], path, measured, export_only=True)
        assert resumed.best is not None and resumed.best[1] == 3
        assert resumed.best[0] == (pytest.approx(0.25) if older else 9.0) and len(calls) == int(older)
        torch.testing.assert_close(resumed.state[name], current)


def test_a_last_step_that_learns_nothing_still_gets_its_heldout_check_and_checkpoint(tmp_path):
    """A step whose conversations hold no generated token counts without training. When it is the sitting's last,
    the held-out check and the checkpoint must still come at it: until 2026-12-07 the loop skipped both, so the
    checkpoint stayed steps behind (a resumed run trained them again) and the last weights were never rated."""
    model, _ = ours(tiny_hf_model(seed=5, layers=4))
    arch, _, layers = _arch_and_state(fused=False)
    config = TrainConfig(steps=3, tokens_per_step=8, eval_every=50, checkpoint_every=50)
    trainer = Trainer(arch, model.embed_tokens.weight, model.lm_head_weight, torch.arange(16), config, layers)
    samples = [{"tokens": torch.arange(6), "generated": torch.zeros(6, dtype=torch.bool)} for _ in range(4)]
    hidden = arch.hidden_size

    def features(rows):
        return [(torch.zeros(len(r), hidden), torch.zeros(len(r), hidden)) for r in rows]

    rated_at = []

    def measured(t: Trainer) -> float:
        rated_at.append(t.step)
        return 1.0

    path = tmp_path / "checkpoint.pt"
    trainer.fit(samples, features, path, measured)
    assert trainer.step == 3 and rated_at == [3]
    assert torch.load(path, weights_only=False)["step"] == 3


def test_a_shard_another_process_wrote_meanwhile_is_not_generated_again(tmp_path):
    """`--reverse` runs a second generator from the last shard: each must skip, when it gets there, a shard the other
    has written since it started, or both generate the whole set (the second half of each over the other's)."""
    from specdec_train.data import _pending

    shards = [(i, tmp_path / f"shard-{i:05d}.pt") for i in range(3)]
    pending = _pending(shards, size=4, total=10)
    assert [next(pending) for _ in range(4)] == [0, 1, 2, 3]  # shard 0: this process's own
    shards[1][1].write_bytes(b"written by the other process")  # while shard 0 was generated
    assert list(pending) == [8, 9]  # shard 1 skipped; shard 2, the last, holds 2 conversations
    assert list(_pending(shards, size=4, total=10)) == [0, 1, 2, 3, 8, 9]  # a fresh plan: whatever is not on disk
