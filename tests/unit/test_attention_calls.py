"""On CPU the short queries of a step are cut into attention calls of bounded gathered keys (a call pads each
sequence to its longest context, and one large call costs several times its parts): every sequence lands in
exactly one call, no call but a lone sequence exceeds the bound, and each sequence's output is its output alone to
fp32 rounding, as in one call (a sequence's padding moves with every batch it is in: neither is bit-exact alone)."""

from __future__ import annotations

import torch

from shared.model import attention
from shared.model.attention import SeqSpan, TorchPagedAttention, build_metadata, paged_attention

BLOCK = 16
KV_HEADS, GROUP, DIM = 3, 3, 64


def _spans(contexts: list[int], query_lens: list[int]) -> tuple[list[SeqSpan], int]:
    spans, next_block = [], 1  # block 0 is the tables' padding
    for context, new in zip(contexts, query_lens, strict=True):
        blocks = -(-context // BLOCK)
        spans.append(SeqSpan(list(range(next_block, next_block + blocks)), context - new, new))
        next_block += blocks
    return spans, next_block


def _case(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    contexts = torch.randint(20, 1500, (40,), generator=gen).tolist()
    query_lens = [1 if b % 3 else 5 for b in range(40)]  # decode rows and k = 4 verify rows
    contexts.append(300)
    query_lens.append(200)  # a prefill chunk: a call of its own
    spans, num_blocks = _spans(contexts, query_lens)
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    q = torch.randn(sum(query_lens), KV_HEADS * GROUP, DIM, generator=gen)
    return spans, k_cache, v_cache, q


def test_calls_cover_every_sequence_once_within_the_bound():
    spans, *_ = _case()
    meta = build_metadata(spans, BLOCK)
    assert meta.groups is not None and len(meta.groups) > 2
    rows = torch.cat([rows for rows, _ in meta.groups])
    assert sorted(rows.tolist()) == list(range(sum(s.num_new for s in spans)))
    for _, call in meta.groups:
        slots = call.num_seqs * call.block_tables.shape[1] * BLOCK
        assert call.num_seqs == 1 or slots <= attention.MAX_CALL_KEY_SLOTS


def test_each_sequence_gets_its_output_alone_split_or_not(monkeypatch):
    spans, k_cache, v_cache, q = _case(1)
    backend = TorchPagedAttention()
    split = paged_attention(backend, q, k_cache, v_cache, build_metadata(spans, BLOCK), 0.125)
    monkeypatch.setattr(attention, "MAX_CALL_KEY_SLOTS", 1 << 40)
    whole_meta = build_metadata(spans, BLOCK)
    assert len(whole_meta.groups) == 2  # the prefill chunk, then every short query in one call
    whole = paged_attention(backend, q, k_cache, v_cache, whole_meta, 0.125)
    start = 0
    for span in spans:
        rows = slice(start, start + span.num_new)
        alone = paged_attention(backend, q[rows], k_cache, v_cache, build_metadata([span], BLOCK), 0.125)
        torch.testing.assert_close(split[rows], alone, rtol=0, atol=1e-6)
        torch.testing.assert_close(whole[rows], alone, rtol=0, atol=1e-6)
        start += span.num_new


def test_small_steps_stay_one_call_and_cuda_keeps_short_queries_together():
    spans, _ = _spans([300] * 8, [1] * 8)  # batch 8 at 300 tokens: 2,400 slots
    assert build_metadata(spans, BLOCK).groups is None
    spans, _ = _spans([1400] * 40, [1] * 40)
    assert len(attention._attention_calls(spans, BLOCK, "cpu")) == 8  # 5 sequences of 88 blocks per call
    assert attention._attention_calls(spans, BLOCK, "cuda") == [list(range(40))]


def _bool_mask(meta: attention.AttentionMetadata, group: int, dtype: torch.dtype, padding: int = 0) -> torch.Tensor:
    """What grouped_mask stands for, as the bool mask SDPA would convert: padding rows attend key 0 only."""
    attend = meta.attn_mask.repeat(1, 1, group, 1)
    pad = torch.zeros(*attend.shape[:2], padding, attend.shape[3], dtype=torch.bool)
    pad[..., 0] = True
    return torch.cat([attend, pad], 2)


def test_the_additive_mask_made_once_a_step_gives_what_the_bool_mask_gives_to_the_bit(monkeypatch):
    """SDPA given the bool mask converts it to this additive one in every call (every layer); made once a step it
    must change nothing: fully masked padding rows, decode rows, verify rows and a prefill chunk, fp32, bf16, fp16."""
    spans, k_cache, v_cache, q = _case(2)
    meta = build_metadata(spans, BLOCK)
    _, call = meta.groups[0]
    mask = call.grouped_mask(GROUP, torch.bfloat16)
    attend = call.attn_mask.repeat(1, 1, GROUP, 1)
    assert mask.dtype == torch.bfloat16 and mask.shape == attend.shape
    assert torch.equal(mask == 0, attend) and bool((mask[~attend] == float("-inf")).all())
    assert call.grouped_mask(GROUP, torch.bfloat16) is mask  # once a step, not once a layer
    backend = TorchPagedAttention()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        args = (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype))
        additive = paged_attention(backend, *args, build_metadata(spans, BLOCK), 0.125)
        with monkeypatch.context() as patch:
            patch.setattr(attention.AttentionMetadata, "grouped_mask", _bool_mask)
            boolean = paged_attention(backend, *args, build_metadata(spans, BLOCK), 0.125)
        assert torch.equal(additive, boolean), dtype


def test_a_query_gets_the_same_output_bit_for_bit_alone_and_among_any_number_of_query_rows():
    """Speculative greedy output is exact only if a position scored among k + 1 rows (or tree nodes) gets what a
    one-token step gives it. SDPA's fp32 products computed a row differently with the number of rows sharing the
    call on some CPUs (an AMD EPYC: 1-3, 5-7, 9-11 rows against 4); each KV head's rows are padded to a multiple
    of ROW_MULTIPLE. Every query length 1-16 at 1 and 3 query heads per KV head, its last query against the same
    position alone (with ROW_MULTIPLE = 1 it fails on that EPYC at every length from 2 to 16, both group sizes)."""
    gen = torch.Generator().manual_seed(5)
    context = 40
    spans, num_blocks = _spans([context], [1])
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    backend = TorchPagedAttention()

    def parted(group: int) -> list[int]:
        q = torch.randn(16, KV_HEADS * group, DIM, generator=gen)
        alone = paged_attention(backend, q[-1:], k_cache, v_cache, build_metadata(spans, BLOCK), 0.125)
        differ = []
        for n in range(1, 17):
            span = SeqSpan(spans[0].block_table, context - n, n)
            out = paged_attention(backend, q[-n:], k_cache, v_cache, build_metadata([span], BLOCK), 0.125)
            if not torch.equal(out[-1:], alone):
                differ.append(n)
        return differ

    assert parted(GROUP) == [] and parted(1) == []
