"""`python -m specdec_train`: generate data with the target, train an EAGLE head, evaluate it, write it.

Every stage resumes: data shards and the training checkpoint in --work-dir are reused when present, so an
interrupted run continues where it stopped when run again. `--resume --steps N --time-budget-min 0` trains a
finished run on to N steps (the cosine schedule stretched to the new end), across as many sittings as needed.
`--quick` runs the whole pipeline on a tiny random target in about a minute (the tests use it).
"""

from __future__ import annotations

import argparse
import logging
import platform
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import torch

from shared.malloc_tuning import tune_malloc
from shared.model.eagle import (
    FINAL_LAYER,
    arch_from_config,
    eagle3_layers,
    feature_layers_of,
    head_config,
    load_head_state,
    read_head_config,
    save_head,
)
from shared.model.loader import load_embeddings, load_model
from shared.settings import REPO_ROOT, default_target_model
from specdec_train.conversations import held_out_conversations
from specdec_train.data import DEFAULT_CONVERSATIONS, DataConfig, generate, load_samples
from specdec_train.features import CachedFeatures, FeatureStore, TargetFeatures
from specdec_train.heldout import HeldOut
from specdec_train.report import frequency_subset, plot_losses, subset_coverage, write_card
from specdec_train.train import TrainConfig, Trainer

DEFAULT_OUT = REPO_ROOT / "models" / "smollm2-135m-eagle"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specdec_train", description=__doc__.splitlines()[0])
    p.add_argument(
        "--target", default=None, help="target model: HF folder, .gguf folder or hub id (default: the repo's)"
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the head is written (%(default)s)")
    p.add_argument("--work-dir", type=Path, default=REPO_ROOT / ".cache" / "eagle-train", help="data and checkpoints")
    p.add_argument("--num-conversations", type=int, default=DEFAULT_CONVERSATIONS, help="conversations to generate")
    p.add_argument("--gen-batch", type=int, default=DataConfig.batch, help="sequences the engine decodes at once")
    p.add_argument(
        "--shards-on-disk", action="store_true",
        help="train on the data shards already written, generating none (python -m specdec_train.data may be "
        "writing the rest meanwhile)",
    )  # fmt: skip
    p.add_argument(
        "--feature-cache-gb", type=float, default=4.0,
        help="keep the target's features of up to this many GB of conversations in memory (fp16; 0 = none): "
        "data that fits pays the target's prefill in its first epoch only",
    )  # fmt: skip
    p.add_argument(
        "--feature-store-gb", type=float, default=0.0,
        help="keep the target's features of up to this many GB of conversations on disk, in --work-dir/features "
        "(fp16; 0 = none): a run trained over several sittings (--resume) prefills each conversation once",
    )  # fmt: skip
    p.add_argument("--draft-vocab-size", type=int, default=8192, help="size of the frequency-ranked subset")
    p.add_argument("--num-layers", type=int, default=1, help="decoder layers in the head")
    p.add_argument(
        "--feature-layers", default="auto",
        help="target layers the head reads, comma-separated (decoder layer outputs, -1 = final normed state); "
        "auto: a low, a middle and a high layer (EAGLE-3: 1, L/2 - 1, L - 4); -1 alone: an EAGLE-1 head",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--tokens-per-step", type=int, default=TrainConfig.tokens_per_step)
    p.add_argument("--max-len", type=int, default=TrainConfig.max_len)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--warmup", type=int, default=TrainConfig.warmup, help="steps of linear learning-rate warm-up")
    p.add_argument("--unroll", type=int, default=TrainConfig.unroll, help="training-time-test steps (1 = EAGLE-1)")
    p.add_argument("--reg-weight", type=float, default=TrainConfig.reg_weight, help="feature regression weight")
    p.add_argument("--time-budget-min", type=float, default=60.0, help="stop training after this (0 = no limit)")
    p.add_argument("--resume", action="store_true", help="train a finished checkpoint on to --steps")
    p.add_argument(
        "--stop-at", type=int, default=0,
        help="stop after this step, on the schedule of --steps (0 = at its end): where a sitting's time budget "
        "stopped it, so that the model card's command, which has no clock, trains the same steps",
    )  # fmt: skip
    p.add_argument(
        "--export", action="store_true",
        help="write the head (best weights so far), card and evaluation from the checkpoint, training nothing "
        "(e.g. while a run goes on in the background)",
    )  # fmt: skip
    p.add_argument(
        "--init-from", type=Path, default=None,
        help="warm start from this head (the subset is this run's data's): an EAGLE-1 head into an EAGLE-1 head "
        "(--feature-layers -1), or a fused head into one of the same --feature-layers, trains on from its weights; "
        "an EAGLE-1 head into a fused head: fc and layers, the input starting as the final state "
        "(--feature-layers must include -1)",
    )  # fmt: skip
    p.add_argument("--eval-every", type=int, default=TrainConfig.eval_every, help="steps between held-out checks")
    p.add_argument("--eval-k", type=int, default=4)
    p.add_argument("--eval-tokens", type=int, default=128)
    p.add_argument("--no-engine-eval", action="store_true", help="skip the engine's held-out evaluation at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--quick", action="store_true", help="tiny random target, tiny everything: a pipeline check")
    return p.parse_args(argv)


def quick_target(work_dir: Path) -> str:
    """A tiny random Llama saved as an HF folder (no tokenizer: prompts are random ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = work_dir / "tiny-target"
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=127,
        )  # fmt: skip
        LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def feature_layers(spec: str, num_target_layers: int) -> tuple[int, ...]:
    return eagle3_layers(num_target_layers) if spec == "auto" else tuple(int(i) for i in spec.split(","))


def _warm_start_layers(init_from: Path | None) -> tuple[int, ...]:
    """The target layers the `--init-from` head reads (the final state for an EAGLE-1 head, or for none)."""
    return feature_layers_of(read_head_config(init_from)) if init_from else FINAL_LAYER


def _check_warm_start_layers(init_from: Path | None, layers: tuple[int, ...]) -> None:
    """Before any data is generated: a fused head's `fuse` columns belong to its layers, in order."""
    init_layers = _warm_start_layers(init_from)
    if init_layers != FINAL_LAYER and init_layers != layers:
        raise SystemExit(
            f"--init-from {init_from} reads the target's layers {list(init_layers)}: a fused head warm-starts only "
            f"a head of the same layers, and --feature-layers gives {list(layers)}"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    tune_malloc()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.num_conversations, args.gen_batch, args.draft_vocab_size = 16, 8, 64
        args.tokens_per_step, args.max_len, args.eval_tokens, args.time_budget_min = 160, 32, 16, 0
        args.steps = 6 if args.steps == TrainConfig.steps else args.steps
    target = quick_target(args.work_dir) if args.quick else args.target or default_target_model()
    given = _without(
        list(argv if argv is not None else sys.argv[1:]),
        ("--steps", "--time-budget-min", "--stop-at", "--resume", "--shards-on-disk", "--export")
        + (("--num-conversations",) if args.shards_on_disk else ()),
    )

    target_model = load_model(target)
    _check_warm_start_layers(args.init_from, feature_layers(args.feature_layers, target_model[1].num_layers))
    data = DataConfig(
        target, args.work_dir / "data", args.num_conversations, args.gen_batch, seed=args.seed,
        random_prompts=args.quick, max_new_tokens=24 if args.quick else None, shard_size=8 if args.quick else 128,
    )  # fmt: skip
    shards = sorted(data.out_dir.glob("shard-*.pt")) if args.shards_on_disk else generate(data, target_model)
    samples = load_samples(shards)
    embedding, lm_head, target_arch = load_embeddings(target)
    layers = feature_layers(args.feature_layers, target_arch.num_layers)
    init_state = load_head_state(args.init_from) if args.init_from is not None else None
    # A warm start too takes the subset of this run's data, not its head's: the subset's LM-head rows are the
    # target's own, frozen, so a head drafts over any subset, and an old one may miss frequent answer tokens (the
    # committed head's, counted with prompt text, held 91% of generated tokens where a fresh one holds 98%).
    subset = _vocab_subset(args, samples, target_arch)
    config = head_config(target_arch, args.num_layers, len(subset), layers, target_model=Path(target).name)
    train_config = TrainConfig(
        steps=args.steps, tokens_per_step=args.tokens_per_step, max_len=args.max_len, lr=args.lr, warmup=args.warmup,
        unroll=args.unroll,
        reg_weight=args.reg_weight, time_budget_s=args.time_budget_min * 60, stop_at=args.stop_at, seed=args.seed,
        eval_every=2 if args.quick else args.eval_every,
    )  # fmt: skip
    target_features = TargetFeatures(target_model[0], layers, max_tokens=max(4096, args.tokens_per_step + 2048))
    heldout = HeldOut(_held_out_samples(args, data, target_model), target_features, args.eval_k, args.max_len)
    stored = target_features
    if args.feature_store_gb > 0:
        folder = FeatureStore.folder_for(args.work_dir / "features", target, layers)
        stored = FeatureStore(target_features, folder, int(args.feature_store_gb * 2**30))
    features = CachedFeatures(stored, int(args.feature_cache_gb * 2**30))
    trainer = Trainer(arch_from_config(config), embedding, lm_head, subset, train_config, layers)
    start_measure = None
    if init_state is not None:
        trainer.start_from(init_state, heldout.batches[0])
        if not args.export:
            start_measure = heldout.measure(trainer)
            logging.info("warm start: held-out %.3f tokens per verify step", start_measure.mean_accepted_length)
    trainer.fit(
        samples, features, args.work_dir / f"checkpoint-seed{args.seed}.pt", heldout,
        extend_to=args.steps if args.resume else None, export_only=args.export,
    )  # fmt: skip
    # The same schedule without a clock: the step count the time budget settled on, fixed, and where the budget
    # (or --stop-at) ended the sitting before the schedule's end.
    command = " ".join(
        [
            "python -m specdec_train",
            *map(shlex.quote, given),
            # The shards trained on: the set is prefix-stable, so this many regenerates them.
            *(["--num-conversations", str(len(samples))] if args.shards_on_disk else []),
            "--steps",
            str(trainer.planned_steps),
            *(["--stop-at", str(trainer.step)] if trainer.step < trainer.planned_steps else []),
            "--time-budget-min 0",
        ]
    )
    save_head(args.out, config, trainer.best_state())
    plot_losses(trainer.history, args.out / "loss.png")
    evaluation = "(not run: --no-engine-eval)"
    if not args.no_engine_eval:
        from specdec_train.evaluate import evaluate, format_results

        evaluation = format_results(evaluate(args.out, target, target_model, args.eval_tokens, args.quick))
    _write_card(args, target, config, samples, subset, trainer, heldout, command, evaluation, start_measure)
    print(f"head written to {args.out}\n{evaluation}")


def _vocab_subset(args: argparse.Namespace, samples: list[dict], target_arch) -> torch.Tensor:
    """The frequency-ranked subset, fixed by the first sitting of a run: the data may grow between sittings
    (--shards-on-disk), and a resumed head must keep the ids its LM head rows were trained for."""
    path = args.work_dir / f"vocab-subset-seed{args.seed}-{args.draft_vocab_size}.pt"
    if path.is_file():
        return torch.load(path)
    subset = frequency_subset(samples, target_arch.vocab_size, args.draft_vocab_size, target_arch.eos_token_ids)
    torch.save(subset, path)
    return subset


def _held_out_samples(args: argparse.Namespace, data: DataConfig, target_model) -> list[dict]:
    """The held-out conversations answered greedily by the target (generated once, then read from disk)."""
    convs = held_out_conversations()[: 3 if args.quick else None]
    config = replace(data, out_dir=args.work_dir / "heldout", num_conversations=len(convs), seed=data.seed + 1)
    config = replace(config, shard_size=len(convs), greedy_only=True, max_new_tokens=24 if args.quick else 192)
    return load_samples(generate(config, target_model, conversations=convs))


def _write_card(args, target, config, samples, subset, trainer, heldout, command, evaluation, start) -> None:
    last = trainer.history[-50:]
    top1 = ", ".join(
        f"step {s}: {sum(h[f'top1_{s}'] for h in last) / len(last):.2f}" for s in range(1, trainer.config.unroll + 1)
    )
    chain = heldout.measure(_with_state(trainer, trainer.best_state()))
    fused = trainer.feature_layers != (-1,)
    init_fused = _warm_start_layers(args.init_from) != FINAL_LAYER
    c = trainer.config
    write_card(
        args.out / "README.md",
        name=args.out.name, name_path=args.out, target=Path(target).name, feature_layers=list(trainer.feature_layers),
        fuse_note=", each RMS-normalised and mixed by `fuse` (n*h -> h)" if fused else "",
        weights="fuse (n*h -> h), fc (2h -> h), output RMSNorm" if fused else "fc (2h -> h)",
        num_layers=args.num_layers, draft_vocab=len(subset), command=command, num_samples=len(samples),
        num_tokens=sum(len(s["tokens"]) for s in samples),
        num_generated=sum(int(s["generated"].sum()) for s in samples), coverage=subset_coverage(samples, subset),
        seed=args.seed, steps=trainer.step, tokens_per_step=c.tokens_per_step, max_len=c.max_len, lr=c.lr,
        warmup=c.warmup,
        reg_note=f" + {c.reg_weight} x smooth-L1(feature)" if c.reg_weight else "", unroll=c.unroll,
        step_decay=c.step_decay, train_minutes=trainer.seconds / 60,
        init_note=(
            f"\n- Warm start (`--init-from {args.init_from}`): "
            + (
                "fc and decoder layer from that EAGLE-1 head, `fuse` reading only the final state at first"
                if fused and not init_fused
                else f"every weight of that {'fused' if fused else 'EAGLE-1'} head, trained on from there"
            )
            + " (`Trainer.start_from`)"
            + (f"; held-out measure at the start {start.mean_accepted_length:.2f}." if start else ".")
            if args.init_from else ""
        ),
        subset_origin=f"the {len(subset)} most frequent ids of the generated text (then id order)",
        machine=f"{platform.machine()}, {torch.get_num_threads()} thread(s)", sittings=_sittings(trainer), top1=top1,
        best_step=trainer.best[1] if trainer.best else trainer.step, eval_k=args.eval_k,
        heldout=chain.mean_accepted_length, heldout_per_position=" / ".join(f"{p:.2f}" for p in chain.per_position),
        heldout_per_start=chain.per_start_length,
        num_heldout=len(held_out_conversations()), eval_tokens=args.eval_tokens, evaluation=evaluation,
    )  # fmt: skip


def _sittings(trainer: Trainer) -> str:
    if len(trainer.sittings) < 2:
        return ""
    parts = [f"steps {s['from_step']}-{s['to_step']} on {s['started']} ({s['minutes']} min)" for s in trainer.sittings]
    return f", in {len(parts)} sittings (`--resume`): " + "; ".join(parts)


def _with_state(trainer: Trainer, state: dict[str, torch.Tensor]) -> Trainer:
    trainer.load_weights(state)
    return trainer


def _without(args: list[str], flags: tuple[str, ...]) -> list[str]:
    """`args` less the given flags and their values (the card's command sets them itself)."""
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in flags:
            skip = arg not in ("--resume", "--shards-on-disk", "--export")  # the flags here without a value
        elif not arg.startswith(tuple(f + "=" for f in flags)):
            kept.append(arg)
    return kept


if __name__ == "__main__":
    main()
