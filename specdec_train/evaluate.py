"""`python -m specdec_train.evaluate HEAD`: a head's acceptance as the product measures it, through the engine.

The fixed held-out set (conversations.held_out_conversations: topics the training set never names), each
prompt answered by the target with the head drafting and exact verification, greedy and T = 0.8 (seeded, so
reruns agree), chain k = 4 at a fixed k (no adaptive policy). Reported per row: tokens per verify step
(1 + accepted / draft rounds) and acceptance per draft position (share of rounds whose first i drafts were
all accepted; they sum to tokens per verify step - 1).

`--tree-nodes N` (default 10) adds two rows with token trees: depth k = 4, at most N nodes, the proposer's
default tree (EAGLE-2's dynamic tree: tree_width 4 tokens under each node, the tree_beam 2 best nodes of each
depth expanded); their acceptance per position is per depth (share of rounds whose accepted path reached it).
One greedy; one at T = 0.8 without a seed, as most sampled traffic comes: a seed makes the engine follow the
seeded token, which drafts a chain (docs/engine.md), so this row's tokens (and its figure, by a few hundredths)
differ from run to run.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from shared.malloc_tuning import tune_malloc
from shared.model.loader import load_embeddings, load_model, load_tokenizer
from shared.settings import default_target_model
from specdec_train.conversations import held_out_conversations
from specdec_train.data import prompt_ids
from specdec_train.report import measure_acceptance


@dataclass(frozen=True)
class Row:
    name: str
    temperature: float
    k: int = 4
    tree_nodes: int = 0  # 0: chains; else token trees of at most this many nodes
    seeded: bool = True  # sampled rows: a seed per prompt, so reruns agree


ROWS = (Row("chain k=4, greedy", 0.0), Row("chain k=4, T=0.8", 0.8))
DEFAULT_TREE_NODES = 10


def rows_for(tree_nodes: int) -> tuple[Row, ...]:
    if not tree_nodes:
        return ROWS
    trees = (
        Row(f"tree k=4, <= {tree_nodes} nodes, greedy", 0.0, tree_nodes=tree_nodes),
        Row(f"tree k=4, <= {tree_nodes} nodes, T=0.8 unseeded", 0.8, tree_nodes=tree_nodes, seeded=False),
    )
    return ROWS + trees


@dataclass(frozen=True)
class RowResult:
    name: str
    rounds: int
    tokens_per_verify_step: float
    per_position: list[float]


def held_out_prompt_ids(target: str, quick: bool = False) -> list[list[int]]:
    if quick:  # a tiny random target has no tokenizer
        gen = torch.Generator().manual_seed(1)
        return [torch.randint(1, 127, (8,), generator=gen).tolist() for _ in range(3)]
    tokenizer = load_tokenizer(target)
    return [prompt_ids(tokenizer, c.turns[0], c.chat, c.system) for c in held_out_conversations()]


def run_row(
    row: Row, head_dir: Path, target_model, embedding, lm_head, prompts, max_tokens: int, suffix_branches: bool = False
) -> RowResult:
    from proposer_service.eagle import make_eagle_drafter
    from shared.model.build import CacheConfig
    from specdec_local.builder import build_engine
    from verifier_service.engine import EngineConfig

    batch = min(16, len(prompts))
    max_len = max(map(len, prompts)) + max_tokens + row.k + 1
    config = EngineConfig(
        num_speculative_tokens=row.k, adaptive_k=False, max_num_seqs=batch, max_model_len=max_len,
        max_tree_nodes=row.tree_nodes,
    )  # fmt: skip
    drafter = make_eagle_drafter(str(head_dir), embedding, lm_head, num_blocks=batch * (max_len // 16 + 2))
    if suffix_branches:
        from proposer_service.suffix_branches import SuffixBranches

        drafter.branches = SuffixBranches()
    engine = build_engine(target_model, drafter, config, CacheConfig())
    result = measure_acceptance(engine, prompts, max_tokens, row.temperature, row.seeded)
    return RowResult(row.name, result.rounds, result.mean_accepted_length, result.per_position)


def evaluate(
    head_dir: Path,
    target: str,
    target_model=None,
    max_tokens: int = 128,
    quick: bool = False,
    tree_nodes: int = DEFAULT_TREE_NODES,
    suffix_branches: bool = False,
):
    target_model = target_model or load_model(target)
    embedding, lm_head, _ = load_embeddings(target)
    prompts = held_out_prompt_ids(target, quick)
    return [
        run_row(row, head_dir, target_model, embedding, lm_head, prompts, max_tokens, suffix_branches)
        for row in rows_for(tree_nodes)
    ]


def format_results(results: list[RowResult]) -> str:
    lines = [
        "| row | verify rounds | tokens per verify step | acceptance per draft position |",
        "| --- | ---: | ---: | --- |",
    ]
    for r in results:
        per_position = " / ".join(f"{p:.2f}" for p in r.per_position)
        lines.append(f"| {r.name} | {r.rounds} | {r.tokens_per_verify_step:.2f} | {per_position} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m specdec_train.evaluate", description=__doc__.splitlines()[0])
    p.add_argument("head", type=Path, help="a head folder (config.json, model.safetensors)")
    p.add_argument("--target", default=None, help="the target (default: the repo's)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument(
        "--tree-nodes", type=int, default=DEFAULT_TREE_NODES, help="nodes of the tree row (0: chain rows only)"
    )
    p.add_argument(
        "--suffix-branches",
        action="store_true",
        help="the head's drafts joined by each request's own text, as the proposer's --suffix-branches does",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    tune_malloc()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = evaluate(
        args.head,
        args.target or default_target_model(),
        max_tokens=args.max_tokens,
        tree_nodes=args.tree_nodes,
        suffix_branches=args.suffix_branches,
    )
    print(format_results(results))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")


if __name__ == "__main__":
    main()
