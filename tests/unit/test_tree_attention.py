"""Tree attention (shared/model/attention.py): every node of a draft tree, scored in one forward, gets the logits
its own path gets scored as a chain (1e-5): random trees over paged blocks across block boundaries, a
prefix-cached prompt, a mixed step with a prefill chunk and plain decode rows; and a tree's accepted path,
moved onto consecutive slots (KVCache.copy_slots), serves the next step as if it had been decoded."""

from __future__ import annotations

import random

import pytest
import torch

from shared.model.attention import SeqSpan, build_metadata, tree_of_parents
from shared.model.build import CacheConfig, make_runner
from shared.model.runner import ForwardItem, ModelRunner
from tests.tiny import ours, tiny_hf_model

BLOCK = 4
VOCAB = 96
ATOL = 1e-5


@pytest.fixture(scope="module")
def target():
    return ours(tiny_hf_model(seed=3, vocab_size=VOCAB, layers=2, logit_scale=4.0))


def runner_for(target) -> ModelRunner:
    model, arch = target
    return make_runner(model, arch, num_blocks=96, cache=CacheConfig(block_size=BLOCK, attention_backend="torch"))


def random_tree(rng: random.Random, num_nodes: int) -> tuple[list[int], list[int]]:
    """(node tokens, parents) in topological order: each node's parent is an earlier node or the root (-1)."""
    parents = [rng.randrange(-1, i) for i in range(num_nodes)]
    return [rng.randrange(VOCAB) for _ in range(num_nodes)], parents


def tree_of(prompt: list[int], tokens: list[int], parents: list[int]):
    """The tree spec of a step that feeds the prompt's last token (the root) and the nodes."""
    return tree_of_parents(len(prompt) - 1, 1 + len(tokens), parents)


def path_of(node: int, parents: list[int]) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def chain_logits(target, prompt: list[int], path_tokens: list[int]) -> torch.Tensor:
    """The last row's logits when prompt + path are scored as a plain chain in a fresh cache."""
    runner = runner_for(target)
    table = list(range(12))
    runner.forward([ForwardItem(table, 0, prompt[:-1], 0)])
    return runner.forward([ForwardItem(table, len(prompt) - 1, [prompt[-1], *path_tokens], 1)])[0][-1]


def test_tree_spec_positions_and_visibility():
    # root at slot 9 (9 cached + the root fed); nodes 0 and 1 are children of the root, 2 of 0, 3 of 2
    tree = tree_of_parents(9, 5, [-1, -1, 0, 2])
    assert tree.prefix_len == 10
    assert tree.positions == (10, 10, 11, 12)
    assert tree.visible == ((10,), (11,), (10, 12), (10, 12, 13))
    meta = build_metadata([SeqSpan(list(range(4)), 9, 5, tree)], BLOCK)
    assert meta.has_tree and meta.positions.tolist() == [9, 10, 10, 11, 12]
    mask = meta.attn_mask[0, 0]  # [5 queries, 16 keys]
    assert mask[0].nonzero().flatten().tolist() == list(range(10))  # the root: causal
    assert mask[3].nonzero().flatten().tolist() == [*range(10), 10, 12]  # node 2 sees node 0, not node 1
    assert mask[4].nonzero().flatten().tolist() == [*range(10), 10, 12, 13]


@pytest.mark.parametrize("seed", range(6))
def test_every_node_gets_the_logits_of_its_path_scored_as_a_chain(target, seed):
    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 14))]
    tokens, parents = random_tree(rng, rng.randrange(2, 12))
    runner = runner_for(target)
    table = list(range(12))
    runner.forward([ForwardItem(table, 0, prompt[:-1], 0)])
    item = ForwardItem(table, len(prompt) - 1, [prompt[-1], *tokens], len(tokens) + 1, tree_of(prompt, tokens, parents))
    (logits,) = runner.forward([item])  # [1 + nodes, vocab]: the root, then each node
    torch.testing.assert_close(logits[0], chain_logits(target, prompt, []), rtol=0, atol=ATOL)
    for node in range(len(tokens)):
        path = [tokens[i] for i in path_of(node, parents)]
        torch.testing.assert_close(logits[node + 1], chain_logits(target, prompt, path), rtol=0, atol=ATOL)


def test_trees_mix_with_a_prefill_chunk_decodes_and_a_prefix_cached_prompt(target):
    """One step: a 40-token prefill chunk (its own attention call), a plain decode row, a chain verify row, and two
    tree rows, one of them over blocks it shares with another sequence (a prefix-cache hit)."""
    rng = random.Random(11)
    shared_prompt = [rng.randrange(VOCAB) for _ in range(9)]  # blocks 0-1 full, shared
    runner = runner_for(target)
    tables = {
        "chunk": list(range(20, 32)),
        "decode": list(range(32, 36)),
        "chain": list(range(36, 40)),
        "tree": list(range(40, 48)),
        "cached": [0, 1, *range(48, 54)],  # the first two blocks are the shared prompt's
        "owner": [0, 1, *range(54, 58)],
    }
    histories = {
        name: [rng.randrange(VOCAB) for _ in range(6 + i)] for i, name in enumerate(("decode", "chain", "tree"))
    }
    histories["owner"] = shared_prompt
    for name, history in histories.items():
        runner.forward([ForwardItem(tables[name], 0, history[:-1], 0)])
    cached_prompt = [*shared_prompt[:8], rng.randrange(VOCAB), rng.randrange(VOCAB)]
    runner.forward([ForwardItem(tables["cached"], 8, cached_prompt[8:-1], 0)])  # only past the shared blocks
    histories["cached"] = cached_prompt
    trees = {name: random_tree(rng, 7) for name in ("tree", "cached")}
    chain = [rng.randrange(VOCAB) for _ in range(4)]
    chunk = [rng.randrange(VOCAB) for _ in range(40)]
    items = {
        "chunk": ForwardItem(tables["chunk"], 0, chunk, 1),
        "decode": ForwardItem(tables["decode"], 6 - 1, histories["decode"][-1:], 1),
        "chain": ForwardItem(tables["chain"], 7 - 1, [histories["chain"][-1], *chain], 5),
        **{
            name: ForwardItem(
                tables[name],
                len(histories[name]) - 1,
                [histories[name][-1], *trees[name][0]],
                8,
                tree_of(histories[name], *trees[name]),
            )
            for name in ("tree", "cached")
        },
    }
    out = dict(zip(items, runner.forward(list(items.values())), strict=True))
    torch.testing.assert_close(out["chunk"][0], chain_logits(target, chunk, []), rtol=0, atol=ATOL)
    torch.testing.assert_close(out["decode"][0], chain_logits(target, histories["decode"], []), rtol=0, atol=ATOL)
    for j in range(5):
        want = chain_logits(target, histories["chain"], chain[:j])
        torch.testing.assert_close(out["chain"][j], want, rtol=0, atol=ATOL)
    for name in ("tree", "cached"):
        tokens, parents = trees[name]
        for node in range(len(tokens)):
            want = chain_logits(target, histories[name], [tokens[i] for i in path_of(node, parents)])
            torch.testing.assert_close(out[name][node + 1], want, rtol=0, atol=ATOL)


def test_an_accepted_path_moved_onto_consecutive_slots_serves_the_next_step(target):
    rng = random.Random(5)
    prompt = [rng.randrange(VOCAB) for _ in range(7)]
    tokens = [rng.randrange(VOCAB) for _ in range(6)]
    parents = [-1, -1, 1, 0, 2, 4]  # path to node 5: 1 -> 2 -> 4 -> 5, written at slots 8, 9, 11, 12
    runner = runner_for(target)
    table = list(range(12))
    runner.forward([ForwardItem(table, 0, prompt[:-1], 0)])
    runner.forward([ForwardItem(table, len(prompt) - 1, [prompt[-1], *tokens], 7, tree_of(prompt, tokens, parents))])
    accepted = path_of(5, parents)  # [1, 2, 4, 5]
    root = len(prompt) - 1

    def slot(offset: int) -> int:
        return table[offset // BLOCK] * BLOCK + offset % BLOCK

    runner.cache.copy_slots([(slot(root + 1 + node), slot(root + 1 + depth)) for depth, node in enumerate(accepted)])
    path = [tokens[i] for i in accepted]
    bonus = rng.randrange(VOCAB)
    # The next step feeds the bonus token after the path: as if the path had been decoded one token at a time.
    got = runner.forward([ForwardItem(table, len(prompt) + len(path), [bonus], 1)])[0][0]
    torch.testing.assert_close(got, chain_logits(target, prompt, [*path, bonus]), rtol=0, atol=ATOL)
