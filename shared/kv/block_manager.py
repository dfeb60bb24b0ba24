"""Bookkeeping for a paged KV cache: which physical blocks each sequence owns, in which order.

The cache tensors are split into `num_blocks` blocks of `block_size` token slots. A sequence's
logical position `p` lives in block `table[p // block_size]` at offset `p % block_size`, so a
sequence can grow without ever moving data, and blocks of finished sequences are reused at once.

This module holds no tensors on purpose: it only decides *where* things go. The caller owns the
cache and performs the copies this module asks for (copy-on-write pairs from `reserve`).

Sharing is expressed only through reference counts: `fork` makes two tables point at the same
blocks, and a block returns to the free list when its count drops to zero. Anything that wants to
share blocks later (prefix caching) must go through `_incref` / `_decref` so the invariants hold.
"""

from __future__ import annotations

from collections.abc import Hashable

SeqId = Hashable


class NoFreeBlocksError(RuntimeError):
    """Not enough free blocks; the scheduler should preempt or wait, nothing was changed."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Hands out physical KV-cache blocks to sequences and keeps their block tables.

    Every public method either succeeds completely or raises without changing state, so the
    scheduler can try an allocation and fall back to preemption on `NoFreeBlocksError`.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # LIFO stack: pop() hands out the most recently freed block (still warm in caches).
        # Initialised reversed so a fresh manager hands out 0, 1, 2, ... which reads well in logs.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refcount: list[int] = [0] * num_blocks
        self._tables: dict[SeqId, list[int]] = {}
        self._num_tokens: dict[SeqId, int] = {}

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def has_seq(self, seq_id: SeqId) -> bool:
        return seq_id in self._tables

    def num_tokens(self, seq_id: SeqId) -> int:
        """Token slots reserved for the sequence; 0 for an unknown one, so callers need no check."""
        return self._num_tokens.get(seq_id, 0)

    def block_table(self, seq_id: SeqId) -> list[int]:
        """Physical block ids in logical order (a copy, so callers cannot corrupt the table)."""
        return list(self._tables[seq_id])

    def ref_count(self, block_id: int) -> int:
        """How many table entries point at the block (0 = free)."""
        return self._refcount[block_id]

    def blocks_needed(self, seq_id: SeqId, num_tokens: int) -> int:
        """Free blocks that `reserve(seq_id, num_tokens)` would consume, copy-on-write copies included."""
        current = self._check_grow(seq_id, num_tokens)
        table = self._tables.get(seq_id, [])
        needed = _ceil_div(num_tokens, self.block_size) - len(table)
        if self._needs_cow(seq_id, current, num_tokens):
            needed += 1
        return needed

    def can_reserve(self, seq_id: SeqId, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= len(self._free)

    def slot_mapping(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        """Flat slot index (block_id * block_size + offset) for logical positions [start, end).

        This is what the attention kernel writes new K/V into, so positions past the reserved
        length are refused: they would land in blocks this sequence does not own.
        """
        length = self.num_tokens(seq_id)
        if not 0 <= start <= end <= length:
            raise ValueError(f"positions [{start}, {end}) outside reserved [0, {length}) of {seq_id!r}")
        table = self._tables[seq_id] if end > start else []
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    # ------------------------------------------------------------------ mutations

    def reserve(self, seq_id: SeqId, num_tokens: int) -> list[tuple[int, int]]:
        """Grow the sequence (creating it if new) to `num_tokens` slots.

        Returns copy-on-write pairs (src, dst): the caller must copy block src to dst in the cache
        before writing, because the slots about to be written were shared with another sequence
        and writing in place would corrupt it. Raises NoFreeBlocksError with nothing changed.
        """
        current = self._check_grow(seq_id, num_tokens)
        needed = self.blocks_needed(seq_id, num_tokens)
        if needed > len(self._free):
            raise NoFreeBlocksError(
                f"{seq_id!r} needs {needed} blocks to reach {num_tokens} tokens, {len(self._free)} free"
            )
        table = self._tables.setdefault(seq_id, [])
        cow: list[tuple[int, int]] = []
        if self._needs_cow(seq_id, current, num_tokens):
            src = table[-1]
            dst = self._allocate()
            self._decref(src)  # cannot reach 0: it was shared
            table[-1] = dst
            cow.append((src, dst))
        for _ in range(_ceil_div(num_tokens, self.block_size) - len(table)):
            table.append(self._allocate())
        self._num_tokens[seq_id] = num_tokens
        return cow

    def rollback(self, seq_id: SeqId, num_tokens: int) -> None:
        """Shrink to `num_tokens` slots, e.g. after speculative tokens were rejected.

        Blocks that no longer hold any kept position are released. A partially kept block stays,
        even if shared: its stale tail is overwritten later, after `reserve` has copied it if needed.
        """
        current = self._num_tokens[seq_id]
        if not 0 <= num_tokens <= current:
            raise ValueError(f"rollback of {seq_id!r} to {num_tokens} must be within [0, {current}]")
        table = self._tables[seq_id]
        keep = _ceil_div(num_tokens, self.block_size)
        for block in table[keep:]:
            self._decref(block)
        del table[keep:]
        self._num_tokens[seq_id] = num_tokens

    def free(self, seq_id: SeqId) -> None:
        """Release all blocks of the sequence; unknown ids are ignored so abort-after-finish is safe."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        del self._num_tokens[seq_id]
        for block in table:
            self._decref(block)

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Make `child_id` share every block of `parent_id` (e.g. parallel sampling) without copying.

        Copies happen lazily: the first `reserve` that writes into a shared block gets a CoW pair.
        """
        table = self._tables[parent_id]
        if child_id in self._tables:
            raise ValueError(f"fork target {child_id!r} already exists")
        for block in table:
            self._incref(block)
        self._tables[child_id] = list(table)
        self._num_tokens[child_id] = self._num_tokens[parent_id]

    # ------------------------------------------------------------------ checking

    def check_invariants(self) -> None:
        """Assert that refcounts, tables and the free list agree. O(num_blocks); for tests and debugging."""
        uses = [0] * self.num_blocks
        assert self._tables.keys() == self._num_tokens.keys(), "tables and lengths track different seqs"
        for seq_id, table in self._tables.items():
            expected = _ceil_div(self._num_tokens[seq_id], self.block_size)
            assert len(table) == expected, f"{seq_id!r}: {len(table)} blocks, expected {expected}"
            for block in table:
                uses[block] += 1
        assert uses == self._refcount, "refcounts differ from table usage"
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate block in free list"
        unused = {b for b in range(self.num_blocks) if self._refcount[b] == 0}
        assert free == unused, f"free list {sorted(free)} != unreferenced blocks {sorted(unused)}"

    # ------------------------------------------------------------------ internals

    def _check_grow(self, seq_id: SeqId, num_tokens: int) -> int:
        """Return the current length; growing is the only direction reserve/blocks_needed accept."""
        current = self.num_tokens(seq_id)
        if num_tokens < current:
            raise ValueError(f"cannot shrink {seq_id!r} from {current} to {num_tokens} here; use rollback")
        return current

    def _needs_cow(self, seq_id: SeqId, current: int, num_tokens: int) -> bool:
        """Whether the first new slot falls in a partially filled block shared with another sequence.

        Only that block can be hit: earlier blocks are full (no new slots), later ones are fresh.
        """
        if num_tokens <= current or current % self.block_size == 0:
            return False
        return self._refcount[self._tables[seq_id][-1]] > 1

    def _allocate(self) -> int:
        block = self._free.pop()
        self._refcount[block] = 1
        return block

    def _incref(self, block: int) -> None:
        self._refcount[block] += 1

    def _decref(self, block: int) -> None:
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            self._free.append(block)
