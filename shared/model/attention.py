"""Paged attention: per-step metadata (built once, passed explicitly) and two backends.

Layout: the step's new tokens of all sequences are flattened into T rows. For attention each
sequence's queries are left-padded to `max_query_len`, so query slot j of sequence b sits at position
`context_len[b] - max_query_len + j`. That single convention serves prefill chunks, `k + 1` scoring
queries and plain decode in one call, and matches flash-attn's bottom-right causal alignment.

Padding every query to the longest one would make decode rows pay for a prefill chunk in the same step (one
2,000-token chunk with 7 decodes: 16,000 query rows instead of 2,007). So a step whose queries differ in
shape is split into groups, each its own attention call within the one forward: every query longer than
SHORT_QUERY (a prefill chunk) alone, unpadded, and all the short ones (decode, k + 1 verify rows) together,
padded to their own longest. On CPU the short ones are cut further, longest context first, into calls of at
most MAX_CALL_KEY_SLOTS gathered keys: a call pads every sequence to its longest context, and one large gather
costs several times its parts. K/V writes, RoPE and every other layer still run once over all T rows.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

try:  # flash-attn is GPU-only and optional; the torch backend is the reference everywhere.
    from flash_attn import flash_attn_with_kvcache  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_with_kvcache = None

log = logging.getLogger("specdec.attention")

# Queries up to this many rows (decode, k + 1 verify rows) share one padded attention call; longer ones
# (prefill chunks) get a call each, so no row is padded to a prefill chunk's length.
SHORT_QUERY = 32
# On CPU a call gathers its sequences' K/V, each padded to the call's longest context. Past a few thousand
# gathered key slots (sequences x longest context) one call costs more than several smaller ones: at batch 128
# with contexts of 100-1,500 tokens, 30 layers of decode attention took 9.3 s as one call and 1.8 s in calls of
# at most 8,192 slots (1 thread; 5.7 s and 1.3 s with 2), and batch 8 at 100-1,500 tokens 163 -> 122 ms.
# flash-attn reads the pages in place, so on CUDA the short queries stay one call.
MAX_CALL_KEY_SLOTS = 8192


@dataclass(frozen=True)
class TreeSpec:
    """The last `len(positions)` new tokens of a span are nodes of a token tree. Node i is written at its slot
    like any new token, but it sees only the keys before `prefix_len` and the slots in `visible[i]` (its
    ancestors' and its own), and its rotary position is `positions[i]` (prefix length + depth), not its slot."""

    prefix_len: int
    positions: tuple[int, ...]
    visible: tuple[tuple[int, ...], ...]  # per node: slot offsets (>= prefix_len) it attends to


def tree_of_parents(num_cached: int, num_new: int, parents: list[int]) -> TreeSpec:
    """The tree of a scored span: its last len(parents) tokens are draft nodes in topological order, node i's
    parent `parents[i]` (-1: the span's last token before the nodes, the root, at the end of the committed
    prefix). Node i sits at slot root + 1 + i and position root + depth(i)."""
    root = num_cached + num_new - len(parents) - 1
    visible: list[tuple[int, ...]] = []
    positions = []
    for i, parent in enumerate(parents):
        above = visible[parent] if parent >= 0 else ()
        visible.append((*above, root + 1 + i))
        positions.append(root + len(visible[-1]))
    return TreeSpec(root + 1, tuple(positions), tuple(visible))


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's part of a forward: `num_new` tokens written after `num_cached` cached ones (causal), the
    last of them the nodes of `tree` when it is given."""

    block_table: list[int]
    num_cached: int
    num_new: int
    tree: TreeSpec | None = None


@dataclass(frozen=True)
class KernelRows:
    """The step for the cpu kernel, which reads each row's keys straight from the block table: row t of the
    step's T rows sees the first `row_keys[t]` positions of its sequence, then `extra_keys[extra_start[t] :
    extra_start[t + 1]]` (a tree node's path past the committed prefix, ascending)."""

    block_tables: torch.Tensor  # [B, max_blocks] int64 (padded with block 0, never read)
    seq_start: torch.Tensor  # [B + 1] int32: first row of each sequence
    row_keys: torch.Tensor  # [T] int32
    extra_start: torch.Tensor  # [T + 1] int32
    extra_keys: torch.Tensor  # [max(1, E)] int32

    @property
    def num_seqs(self) -> int:
        return self.seq_start.numel() - 1


def kernel_rows(spans: list[SeqSpan]) -> KernelRows:
    seq_start, extra_start = [0], [0]
    row_keys: list[int] = []
    extra_keys: list[int] = []
    for span in spans:
        seq_start.append(seq_start[-1] + span.num_new)
        nodes = 0 if span.tree is None else len(span.tree.positions)
        causal = span.num_new - nodes
        row_keys.extend(range(span.num_cached + 1, span.num_cached + causal + 1))
        extra_start.extend([extra_start[-1]] * causal)
        if span.tree is not None:
            for visible in span.tree.visible:
                row_keys.append(span.tree.prefix_len)
                extra_keys.extend(visible)
                extra_start.append(len(extra_keys))
    int32 = torch.int32
    return KernelRows(
        block_tables=_padded_tables(spans),
        seq_start=torch.tensor(seq_start, dtype=int32),
        row_keys=torch.tensor(row_keys, dtype=int32),
        extra_start=torch.tensor(extra_start, dtype=int32),
        extra_keys=torch.tensor(extra_keys or [0], dtype=int32),
    )


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    positions: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64 (padded with block 0, masked out)
    context_lens: torch.Tensor  # [B] int32: cached + new tokens per sequence
    query_lens: list[int]  # new tokens per sequence
    max_query_len: int
    # [T] int64: row of each token in the padded [B * max_query_len]; None when every sequence has max_query_len
    query_pad_index: torch.Tensor | None
    attn_mask: torch.Tensor  # [B, 1, max_query_len, max_blocks * block_size] bool, True = attend
    # Set when the step is split into attention calls: (rows of T in the group [t] int64, the group's metadata).
    # The fields above that only attention reads are then empty: the groups carry their own.
    groups: list[tuple[torch.Tensor, AttentionMetadata]] | None = None
    has_tree: bool = False  # some query is a tree node: its mask is not causal (a causal-only kernel cannot run it)
    kernel_rows: KernelRows | None = None  # the whole step for the cpu kernel (build_metadata(kernel=True))
    spans: tuple[SeqSpan, ...] = field(default=(), compare=False, repr=False)  # what it was built from
    # init=False: a copy made with dataclasses.replace starts empty rather than with masks of another attn_mask
    _grouped_masks: dict[tuple[int, torch.dtype, int], torch.Tensor] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def rows_for_kernel(self) -> KernelRows:
        """kernel_rows, built on the first layer's call where the metadata was built for another backend."""
        if self.kernel_rows is None:
            object.__setattr__(self, "kernel_rows", kernel_rows(list(self.spans)))
        assert self.kernel_rows is not None
        return self.kernel_rows

    def grouped_mask(self, group: int, dtype: torch.dtype, padding: int = 0) -> torch.Tensor:
        """attn_mask as SDPA's additive mask in the queries' dtype (0 attend, -inf not), every query row repeated
        for the `group` query heads stacked on one KV head, then `padding` rows that attend key 0 only:
        [B, 1, group * max_query_len + padding, L]. Built on the first layer's call and reused by the others;
        given the bool mask, SDPA converted it in every call (what it builds is this tensor: the same output to
        the bit, 10-20 us a layer saved at batch 8)."""
        mask = self._grouped_masks.get((group, dtype, padding))
        if mask is None:
            attend = self.attn_mask if group == 1 else self.attn_mask.repeat(1, 1, group, 1)
            if padding:
                pad = torch.zeros(*attend.shape[:2], padding, attend.shape[3], dtype=torch.bool, device=attend.device)
                attend = torch.cat([attend, pad.index_fill_(3, torch.tensor([0], device=attend.device), True)], 2)
            mask = torch.zeros(attend.shape, dtype=dtype, device=attend.device).masked_fill_(~attend, float("-inf"))
            self._grouped_masks[(group, dtype, padding)] = mask
        return mask


def build_metadata(
    spans: list[SeqSpan], block_size: int, device: torch.device | str = "cpu", kernel: bool = False
) -> AttentionMetadata:
    """The step's metadata, once for every layer; `kernel`: for the cpu kernel (the backend's `whole_step`),
    which reads only the K/V slots, positions and `kernel_rows`, and none of the masks and calls built here."""
    if not kernel:
        return _build_calls(spans, block_size, device)
    return _rows_only(spans, block_size, device, kernel_rows=kernel_rows(spans))


def _rows_only(spans: list[SeqSpan], block_size: int, device: torch.device | str, **fields) -> AttentionMetadata:
    """Metadata whose attention-only fields are empty: a split step's (its `groups` carry their own) and the
    cpu kernel's (its `kernel_rows` instead)."""
    slots, positions = _slots_and_positions(spans, block_size)
    query_lens = [s.num_new for s in spans]
    empty = torch.empty(0, dtype=torch.int64, device=device)
    return AttentionMetadata(
        has_tree=any(span.tree is not None for span in spans),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        block_tables=empty,
        context_lens=empty,
        query_lens=query_lens,
        max_query_len=max(query_lens),
        query_pad_index=None,
        attn_mask=torch.empty(0, dtype=torch.bool, device=device),
        spans=tuple(spans),
        **fields,
    )


def _build_calls(spans: list[SeqSpan], block_size: int, device: torch.device | str) -> AttentionMetadata:
    calls = _attention_calls(spans, block_size, device)
    if len(calls) == 1:
        return _build_one(spans, block_size, device)
    starts = [0]
    for span in spans:
        starts.append(starts[-1] + span.num_new)
    groups = []
    for members in calls:
        rows = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in members]).to(device)
        groups.append((rows, _build_one([spans[b] for b in members], block_size, device)))
    return _rows_only(spans, block_size, device, groups=groups)


def _attention_calls(spans: list[SeqSpan], block_size: int, device: torch.device | str) -> list[list[int]]:
    """The sequences of each attention call: every prefill chunk alone, the short queries together, cut on CPU
    into calls of at most MAX_CALL_KEY_SLOTS gathered key slots; prefill chunks all of one length: one call."""
    query_lens = [s.num_new for s in spans]
    if len(spans) == 1 or (min(query_lens) > SHORT_QUERY and len(set(query_lens)) == 1):
        return [list(range(len(spans)))]
    long_queries = [[b] for b, n in enumerate(query_lens) if n > SHORT_QUERY]
    short = [b for b, n in enumerate(query_lens) if n <= SHORT_QUERY]
    if not short:
        return long_queries
    if torch.device(device).type != "cpu":
        return [*long_queries, short]
    # Longest first, so each call pads to a context close to its members' own.
    short.sort(key=lambda b: len(spans[b].block_table), reverse=True)
    calls = [[short[0]]]
    for b in short[1:]:
        if (len(calls[-1]) + 1) * len(spans[calls[-1][0]].block_table) * block_size > MAX_CALL_KEY_SLOTS:
            calls.append([])
        calls[-1].append(b)
    return long_queries + calls


def _slots_and_positions(spans: list[SeqSpan], block_size: int) -> tuple[list[int], list[int]]:
    slots: list[int] = []
    positions: list[int] = []
    for span in spans:
        offsets = range(span.num_cached, span.num_cached + span.num_new)
        slots.extend(span.block_table[offset // block_size] * block_size + offset % block_size for offset in offsets)
        if span.tree is None:
            positions.extend(offsets)
        else:  # tree nodes sit at their depth, not at their slot
            positions.extend(offsets[: span.num_new - len(span.tree.positions)])
            positions.extend(span.tree.positions)
    return slots, positions


def paged_attention(backend, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]: one backend call, or one per group of a split step. A group with tree nodes
    runs the torch backend whatever `backend` is: flash-attn's paged kernel knows only causal masks. The cpu
    kernel takes the whole step, trees included, in one call."""
    if uses_kernel(backend):
        return backend(q, k_cache, v_cache, meta, scale)
    if meta.groups is None:
        return _backend_for(backend, meta)(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    for rows, group in meta.groups:
        call = _backend_for(backend, group)
        out.index_copy_(0, rows, call(q.index_select(0, rows), k_cache, v_cache, group, scale))
    return out


def uses_kernel(backend) -> bool:
    """Whether `backend` takes a whole step from metadata built with `kernel=True` (the cpu kernel)."""
    return getattr(backend, "whole_step", False)


def _backend_for(backend, meta: AttentionMetadata):
    return _TREE_BACKEND if meta.has_tree and backend.name != _TREE_BACKEND.name else backend


def _build_one(spans: list[SeqSpan], block_size: int, device: torch.device | str) -> AttentionMetadata:
    slots, positions = _slots_and_positions(spans, block_size)
    query_lens = [s.num_new for s in spans]
    max_query_len = max(query_lens)
    tables = _padded_tables(spans)
    max_blocks = tables.shape[1]
    context_lens = torch.tensor([s.num_cached + s.num_new for s in spans], dtype=torch.int32)

    pad_index = None  # equal query lengths (decode steps, every sequence drafting k): already in padded order
    if len(set(query_lens)) > 1:
        pad_index = torch.tensor(
            [b * max_query_len + (max_query_len - n) + j for b, n in enumerate(query_lens) for j in range(n)],
            dtype=torch.int64,
        )
    # Query slot j of sequence b is at slot context_len - max_query_len + j; it may attend to keys at slots
    # <= its own. Padding slots (negative positions) attend to key 0 only so no row is empty (NaN).
    query_pos = context_lens.unsqueeze(1) - max_query_len + torch.arange(max_query_len).unsqueeze(0)  # [B, Qmax]
    key_pos = torch.arange(max_blocks * block_size)  # [L]
    mask = key_pos.view(1, 1, -1) <= query_pos.clamp(min=0).unsqueeze(-1)  # [B, Qmax, L]
    for b, span in enumerate(spans):
        if span.tree is not None:  # the last query slots are the nodes: the prefix, then their own path
            nodes = mask[b, max_query_len - len(span.tree.positions) :]  # [n, L] (a view)
            nodes.copy_(key_pos.unsqueeze(0) < span.tree.prefix_len)
            for node, visible in zip(nodes, span.tree.visible, strict=True):
                node[list(visible)] = True
    return AttentionMetadata(
        has_tree=any(span.tree is not None for span in spans),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        block_tables=tables.to(device),
        context_lens=context_lens.to(device),
        query_lens=query_lens,
        max_query_len=max_query_len,
        query_pad_index=None if pad_index is None else pad_index.to(device),
        attn_mask=mask.unsqueeze(1).to(device),
        spans=tuple(spans),
    )


def _padded_tables(spans: list[SeqSpan]) -> torch.Tensor:  # [B, max_blocks] int64, padded with block 0
    max_blocks = max(len(s.block_table) for s in spans)
    return torch.tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s in spans], dtype=torch.int64)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
    """k_cache [num_blocks, block_size, kv_heads, head_dim]; k [T, kv_heads, head_dim]."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)


def _pad_queries(x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:  # [T, H, D] -> [B, Qmax, H, D]
    if meta.query_pad_index is None:
        return x.reshape(meta.num_seqs, meta.max_query_len, *x.shape[1:])
    padded = x.new_zeros(meta.num_seqs * meta.max_query_len, *x.shape[1:])
    padded[meta.query_pad_index] = x
    return padded.view(meta.num_seqs, meta.max_query_len, *x.shape[1:])


def _unpad(x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:  # [B, Qmax, H, D] -> [T, H, D]
    flat = x.reshape(-1, *x.shape[2:])
    return flat if meta.query_pad_index is None else flat[meta.query_pad_index]


# SDPA's products on the CPU (MKL's fp32 sgemm there) computed a query row with other kernels, or in another
# order, depending on how many rows shared the call: on an AMD EPYC (Zen 4) a row's output differed in the last
# bits between calls of 1-3, 5-7, 9-11 or 33-35 rows and calls of 4, while every multiple of 4 up to 400 rows gave
# each row what 4-row calls give (bf16: any count). Speculative greedy output is exact only if a position scored
# among k + 1 rows gets the logits a one-token step gives it, so each KV head's query rows are padded to a
# multiple of 4 (padding rows attend key 0 and are dropped): a decode step at 3 query heads per KV head computes
# 4 rows instead of 3.
ROW_MULTIPLE = 4


class TorchPagedAttention:
    """Gather each sequence's blocks, then scaled_dot_product_attention with an explicit mask.

    Grouped-query attention without copying keys: the `group` query heads that share a KV head are
    stacked along the query axis, so one KV head serves `group * Qmax` query rows. Expanding K and V to
    every query head instead (or SDPA's enable_gqa) costs a copy of the whole context per layer, which
    on CPU was most of a batch-8 decode step."""

    name = "torch"

    def __call__(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        batch, q_len = meta.num_seqs, meta.max_query_len
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        group = q.shape[1] // kv_heads  # query heads per KV head
        rows = group * q_len
        padding = -rows % ROW_MULTIPLE
        queries = _pad_queries(q, meta).view(batch, q_len, kv_heads, group, head_dim)
        queries = queries.permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, rows, head_dim)
        if padding:
            queries = F.pad(queries, (0, 0, 0, padding))  # [B, kv_heads, rows + padding, D]
        mask = meta.grouped_mask(group, q.dtype, padding)  # [B, 1, rows + padding, L]
        out = F.scaled_dot_product_attention(
            queries,
            _gather(k_cache, meta.block_tables),  # [B, kv_heads, L, D]
            _gather(v_cache, meta.block_tables),
            attn_mask=mask,
            scale=scale,
        )  # [B, kv_heads, rows + padding, D]
        out = out[:, :, :rows].reshape(batch, kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
        return _unpad(out.reshape(batch, q_len, kv_heads * group, head_dim), meta)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, kv_heads, D] -> [B, kv_heads, max_blocks * block_size, D].

    index_select rather than cache[block_tables]: on CPU advanced indexing is ~100x slower here."""
    batch, max_blocks = block_tables.shape
    _, block_size, kv_heads, head_dim = cache.shape
    blocks = cache.index_select(0, block_tables.view(-1))  # [B * max_blocks, block_size, kv_heads, D]
    return blocks.view(batch, max_blocks * block_size, kv_heads, head_dim).transpose(1, 2)


class FlashPagedAttention:
    """flash-attn's paged kernel: reads blocks through the block table; causal mask aligned bottom-right,
    which is exactly where our left-padded queries sit. Requires a CUDA device and block_size % 256 == 0."""

    name = "flash"

    def __call__(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        assert flash_attn_with_kvcache is not None
        out = flash_attn_with_kvcache(
            _pad_queries(q, meta),  # [B, Qmax, H, D]
            k_cache,
            v_cache,
            cache_seqlens=meta.context_lens,
            block_table=meta.block_tables.to(torch.int32),
            softmax_scale=scale,
            causal=True,
        )
        return _unpad(out, meta)


_TREE_BACKEND = TorchPagedAttention()

DEFAULT_BLOCK_SIZE = 16
FLASH_BLOCK_SIZE = 256  # flash_attn_with_kvcache's paged KV takes pages of a multiple of 256 tokens


def resolve_block_size(block_size: int, attention_backend: str, device: torch.device | str) -> int:
    """`block_size` 0 (the services' default) = auto: 256 where flash-attn will run (CUDA, flash-attn installed,
    backend auto or flash), else 16, the finer page: more prefix blocks shared, less of a last block wasted."""
    if block_size:
        return block_size
    on_cuda = torch.device(device).type == "cuda"
    flash = flash_attn_with_kvcache is not None and on_cuda and attention_backend in ("auto", "flash")
    return FLASH_BLOCK_SIZE if flash else DEFAULT_BLOCK_SIZE


def select_backend(
    name: str,
    device: torch.device | str,
    block_size: int,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
):
    """'auto' picks flash-attn on CUDA when installed and the block size allows it; on the CPU the cpu kernel
    where it builds and runs the cache's dtype and head size (float32 or bfloat16; see cpu_attention), else torch."""
    on_cuda = torch.device(device).type == "cuda"
    flash_ok = flash_attn_with_kvcache is not None and on_cuda and block_size % 256 == 0
    if name in ("cpu", "auto") and not on_cuda:
        from shared.model import cpu_attention  # it builds and loads a C++ kernel: only where asked for

        lib = cpu_attention.load_kernel() if cpu_attention.supports(dtype, head_dim) else None
        if lib is not None:
            log.info("attention backend cpu on %s (the paged kernel, %s)", device, dtype)
            return cpu_attention.CpuPagedAttention(lib)
        if name == "cpu":
            raise ValueError(
                f"attention backend 'cpu' needs a C++ compiler, a CPU device, float32 or bfloat16 and a head size in "
                f"{cpu_attention.HEAD_SIZES} (here {dtype}, head size {head_dim})"
            )
    if name == "torch" or (name == "auto" and not flash_ok):
        if name == "auto" and on_cuda:  # never silently: say why the GPU runs the gather + SDPA path
            why = "flash-attn is not installed" if flash_attn_with_kvcache is None else f"block_size {block_size}"
            log.warning("attention backend torch on %s (flash needs block_size %% 256 == 0; %s)", device, why)
        else:
            log.info("attention backend torch on %s", device)
        return TorchPagedAttention()
    if name in ("flash", "auto"):
        if not flash_ok:
            raise ValueError(
                "attention backend 'flash' needs flash-attn installed, a CUDA device and block_size divisible by 256"
            )
        log.info(
            "attention backend flash on %s (block_size %d); steps with token-tree rows run the torch backend "
            "(flash-attn's paged kernel is causal only)",
            device,
            block_size,
        )
        return FlashPagedAttention()
    raise ValueError(f"unknown attention backend {name!r} (choose auto, torch, cpu or flash)")


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
