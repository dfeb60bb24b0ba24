"""`python -m specdec_train`: generate data with the target, train an EAGLE head, evaluate it, write it.

Every stage resumes: data shards and the training checkpoint in --work-dir are reused when present.
`--quick` runs the whole pipeline on a tiny random target in about a minute (the tests use it).
"""

from __future__ import annotations

import argparse
import logging
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from shared.malloc_tuning import tune_malloc
from shared.model.eagle import arch_from_config, head_config, save_head
from shared.model.loader import load_embeddings, load_model, load_tokenizer
from shared.settings import REPO_ROOT, default_target_model
from specdec_train.data import DataConfig, generate, load_samples, prompt_ids
from specdec_train.prompts import held_out_prompts
from specdec_train.report import frequency_subset, measure_acceptance, plot_losses, subset_coverage, write_card
from specdec_train.train import TrainConfig, Trainer

DEFAULT_OUT = REPO_ROOT / "models" / "smollm2-135m-eagle"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specdec_train", description=__doc__.splitlines()[0])
    p.add_argument(
        "--target", default=None, help="target model: HF folder, .gguf folder or hub id (default: the repo's)"
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the head is written (%(default)s)")
    p.add_argument("--work-dir", type=Path, default=REPO_ROOT / ".cache" / "eagle-train", help="data and checkpoints")
    p.add_argument("--num-prompts", type=int, default=1536, help="target continuations to generate")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gen-batch", type=int, default=48, help="sequences the engine decodes at once")
    p.add_argument("--draft-vocab-size", type=int, default=8192, help="size of the frequency-ranked subset")
    p.add_argument("--num-layers", type=int, default=1, help="decoder layers in the head")
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    p.add_argument("--max-len", type=int, default=TrainConfig.max_len)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--unroll", type=int, default=TrainConfig.unroll, help="training-time-test steps (1 = EAGLE-1)")
    p.add_argument("--time-budget-min", type=float, default=20.0, help="stop training after this (0 = no limit)")
    p.add_argument("--eval-k", type=int, default=4)
    p.add_argument("--eval-tokens", type=int, default=128)
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
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=127,
        )  # fmt: skip
        LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    tune_malloc()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.num_prompts, args.max_new_tokens, args.gen_batch = 12, 24, 6
        args.draft_vocab_size, args.steps, args.batch_size, args.max_len = 64, 12, 4, 32
        args.eval_tokens, args.time_budget_min = 16, 0
    target = quick_target(args.work_dir) if args.quick else args.target or default_target_model()
    given = _without(list(argv if argv is not None else sys.argv[1:]), ("--steps", "--time-budget-min"))

    started = time.monotonic()
    target_model = load_model(target)
    data = DataConfig(
        target, args.work_dir / "data", args.num_prompts, args.max_new_tokens, args.gen_batch,
        seed=args.seed, random_prompts=args.quick,
    )  # fmt: skip
    samples = load_samples(generate(data, target_model))
    data_minutes = (time.monotonic() - started) / 60

    embedding, lm_head, target_arch = load_embeddings(target)
    subset = frequency_subset(samples, target_arch.vocab_size, args.draft_vocab_size, target_arch.eos_token_ids)
    config = head_config(target_arch, args.num_layers, len(subset), target_model=Path(target).name)
    train_config = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, max_len=args.max_len, lr=args.lr, unroll=args.unroll,
        time_budget_s=args.time_budget_min * 60, seed=args.seed,
    )  # fmt: skip
    trainer = Trainer(arch_from_config(config), embedding, lm_head, subset, train_config)
    started = time.monotonic()
    trainer.fit(samples, args.work_dir / f"checkpoint-seed{args.seed}.pt")
    train_minutes = (time.monotonic() - started) / 60
    # The same schedule without a clock: the step count the time budget settled on, fixed.
    command = " ".join(
        [
            "python -m specdec_train",
            *map(shlex.quote, given),
            "--steps",
            str(trainer.planned_steps),
            "--time-budget-min",
            "0",
        ]
    )
    save_head(args.out, config, trainer.best_state())
    plot_losses(trainer.history, args.out / "loss.png")

    acceptance = evaluate(args, target, target_model, embedding, lm_head)
    last = trainer.history[-50:]
    top1 = ", ".join(
        f"step {s}: {sum(h[f'top1_{s}'] for h in last) / len(last):.2f}" for s in range(1, train_config.unroll + 1)
    )
    write_card(
        args.out / "README.md",
        name=args.out.name, target=Path(target).name, num_layers=args.num_layers, draft_vocab=len(subset),
        command=command, num_samples=len(samples), max_new_tokens=args.max_new_tokens,
        num_positions=sum(s["features"].shape[0] for s in samples), coverage=subset_coverage(samples, subset),
        seed=args.seed, steps=trainer.step, batch_size=args.batch_size, max_len=args.max_len, lr=args.lr,
        cls_weight=train_config.cls_weight, unroll=args.unroll, data_minutes=data_minutes,
        train_minutes=train_minutes, machine=f"{platform.machine()}, {torch.get_num_threads()} threads",
        top1=top1, best_step=trainer.best[1] if trainer.best else trainer.step,
        val_top1=trainer.best[0] if trainer.best else float("nan"),
        val_samples=round(len(samples) * train_config.val_fraction), eval_k=args.eval_k,
        eval_tokens=args.eval_tokens, mean_len=acceptance.mean_accepted_length,
        per_position=", ".join(f"{p:.2f}" for p in acceptance.per_position),
    )  # fmt: skip
    print(
        f"head written to {args.out}: mean accepted length {acceptance.mean_accepted_length:.2f} at k = {args.eval_k}"
    )


def _without(args: list[str], flags: tuple[str, ...]) -> list[str]:
    """`args` less the given flags and their values (the card's command sets them itself)."""
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in flags)):
            kept.append(arg)
    return kept


def evaluate(args: argparse.Namespace, target: str, target_model, embedding, lm_head):
    from proposer_service.eagle import make_eagle_drafter
    from shared.model.build import CacheConfig
    from specdec_local.builder import build_engine
    from verifier_service.engine import EngineConfig

    if args.quick:
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(1, 127, (8,), generator=gen).tolist() for _ in range(3)]
    else:
        tokenizer = load_tokenizer(target)
        prompts = [prompt_ids(tokenizer, text, True) for text in held_out_prompts()]
    config = EngineConfig(num_speculative_tokens=args.eval_k, adaptive_k=False, max_num_seqs=len(prompts))
    drafter = make_eagle_drafter(str(args.out), embedding, lm_head, num_blocks=len(prompts) * 140)
    engine = build_engine(target_model, drafter, config, CacheConfig())
    return measure_acceptance(engine, prompts, args.eval_tokens)


if __name__ == "__main__":
    main()
