"""A step that mixes one long prefill chunk with decode and verify rows gives every sequence the logits it
gets alone (1e-4): the rows do not pay for, or leak into, each other (attention is split per query shape)."""

from __future__ import annotations

import pytest
import torch

from shared.model import attention
from shared.model.attention import SeqSpan, build_metadata
from shared.model.build import CacheConfig, make_runner
from shared.model.loader import load_model
from shared.model.runner import ForwardItem
from shared.settings import default_target_model

BLOCK = 16


@pytest.fixture(scope="module")
def target():
    return load_model(default_target_model())


def fresh_runner(target):
    model, arch = target
    return make_runner(model, arch, num_blocks=64, cache=CacheConfig(block_size=BLOCK, attention_backend="torch"))


@pytest.mark.slow
def test_long_prefill_chunk_with_decodes_equals_each_alone(target):
    gen = torch.Generator().manual_seed(0)
    vocab = target[1].vocab_size

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    tables = [list(range(i * 8, (i + 1) * 8)) for i in range(8)]  # 8 blocks (128 tokens) per sequence
    long_chunk = tokens(120)
    histories = [tokens(10 + 7 * i) for i in range(7)]
    step_feeds = [tokens(1) if i % 2 else tokens(5) for i in range(7)]  # decodes and k = 4 verify rows
    mixed, alone = fresh_runner(target), fresh_runner(target)
    for runner in (mixed, alone):
        for table, history in zip(tables[1:], histories, strict=True):
            runner.forward([ForwardItem(table, 0, history, 0)])
    items = [ForwardItem(tables[0], 0, long_chunk, 1)] + [
        ForwardItem(table, len(history), feed, len(feed))
        for table, history, feed in zip(tables[1:], histories, step_feeds, strict=True)
    ]
    together = mixed.forward(items)
    # The step really is split: the chunk alone (unpadded), the 7 short rows padded only to 5.
    meta = build_metadata([SeqSpan(it.block_table, it.num_cached, len(it.token_ids)) for it in items], BLOCK)
    assert meta.groups is not None
    assert [(len(rows), g.max_query_len, g.num_seqs) for rows, g in meta.groups] == [(120, 120, 1), (23, 5, 7)]
    for item, got in zip(items, together, strict=True):
        want = alone.forward([item])[0]
        assert got.shape == want.shape == (item.num_logits, vocab)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_block_size_auto_is_256_only_where_flash_attn_runs(monkeypatch):
    assert attention.resolve_block_size(8, "auto", "cuda") == 8  # an explicit size wins
    monkeypatch.setattr(attention, "flash_attn_with_kvcache", None)
    assert attention.resolve_block_size(0, "auto", "cuda") == 16  # no flash-attn installed
    monkeypatch.setattr(attention, "flash_attn_with_kvcache", object())
    assert attention.resolve_block_size(0, "auto", "cuda:0") == 256
    assert attention.resolve_block_size(0, "flash", "cuda") == 256
    assert attention.resolve_block_size(0, "torch", "cuda") == 16
    assert attention.resolve_block_size(0, "auto", "cpu") == 16
