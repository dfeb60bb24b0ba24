"""Bookkeeping for a paged KV cache: which physical blocks each sequence owns, in which order.

The cache tensors are split into `num_blocks` blocks of `block_size` token slots. A sequence's
logical position `p` lives in block `table[p // block_size]` at offset `p % block_size`, so a
sequence can grow without ever moving data, and blocks of finished sequences are reused at once.

This module holds no tensors on purpose: it only decides *where* things go. The caller owns the
cache and performs the copies this module asks for (copy-on-write pairs from `reserve`).

Sharing is expressed only through reference counts: `fork` makes two tables point at the same
blocks, and a block returns to the free list when its count drops to zero.

Automatic prefix caching (vLLM's "APC", on unless `enable_prefix_caching=False`): a *full* block
whose tokens are all committed can be registered (`cache_full_blocks`) under a hash of its tokens
chained with the hash of everything before it, so equal hashes mean equal whole prefixes. A new
sequence looks its tokens up (`match_prefix`) and shares the cached blocks it finds
(`allocate_prefix`); only the rest is computed. A cached block whose count drops to zero is not
freed but becomes *evictable*: it keeps its content and hash in an LRU order and is reused (its hash
dropped) only when the free list is empty. A cached block is immutable: a write into it (only
possible after a rollback into it) gets a copy-on-write pair like a shared block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

SeqId = Hashable
BlockHash = bytes
_ROOT_HASH: BlockHash = b""


class NoFreeBlocksError(RuntimeError):
    """Not enough free blocks; the scheduler should preempt or wait, nothing was changed."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def block_hash(parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    """Hash of a full block given its parent's hash: identifies the whole prefix ending with it.

    A 128-bit cryptographic digest, so two different prefixes never share K/V in practice (Python's
    `hash` is 64-bit and collisions in it could be crafted by a client).
    """
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def tenant_root(salt: str) -> BlockHash:
    """The chain's root for one tenant: every block hash below it differs from another tenant's, so one
    tenant's cached blocks are never a hit for another (vLLM's `cache_salt`). '' (the anonymous tenant, and
    every caller that has no tenants) keeps the unsalted root."""
    if not salt:
        return _ROOT_HASH
    return hashlib.blake2b(b"specdec-tenant\x00" + salt.encode(), digest_size=16).digest()


@dataclass(frozen=True)
class PrefixMatch:
    """Cached blocks covering the first `len(blocks) * block_size` tokens of a lookup, with their hashes."""

    blocks: tuple[int, ...] = ()
    hashes: tuple[BlockHash, ...] = ()


class BlockManager:
    """Hands out physical KV-cache blocks to sequences and keeps their block tables.

    Every public method either succeeds completely or raises without changing state, so the
    scheduler can try an allocation and fall back to preemption on `NoFreeBlocksError`.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
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
        self.enable_prefix_caching = enable_prefix_caching
        self._cached: dict[BlockHash, int] = {}  # hash -> the block holding that prefix's last block
        self._hash_of: dict[int, BlockHash] = {}  # the inverse: every cached block, owned or evictable
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks at refcount 0, LRU first
        self._seq_hashes: dict[SeqId, list[BlockHash]] = {}  # hashes of each sequence's leading full blocks
        self.num_evictions = 0  # counter: cached blocks reused for other content

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks a reservation may take: the free list plus evictable cached blocks."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold reusable prefix-cache content (a subset of num_free_blocks)."""
        return len(self._evictable)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._hash_of

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
        return self.blocks_needed(seq_id, num_tokens) <= self.num_free_blocks

    def match_prefix(self, token_ids: Sequence[int], salt: str = "") -> PrefixMatch:
        """The longest run of cached blocks equal to the leading full blocks of `token_ids` (no change),
        among those cached with the same `salt` (the tenant).

        Pass only tokens whose K/V may be reused: the caller keeps back the token(s) it must compute.
        """
        if not self.enable_prefix_caching:
            return PrefixMatch()
        bs = self.block_size
        blocks: list[int] = []
        hashes: list[BlockHash] = []
        parent = tenant_root(salt)
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = block_hash(parent, token_ids[start : start + bs])
            block = self._cached.get(parent)
            if block is None:
                break
            blocks.append(block)
            hashes.append(parent)
        return PrefixMatch(tuple(blocks), tuple(hashes))

    def blocks_needed_with_prefix(self, match: PrefixMatch, num_tokens: int) -> int:
        """Free blocks a new sequence taking `match` and growing to `num_tokens` slots would consume.

        Reviving an evictable block takes it out of the free pool, so it counts like a fresh one.
        """
        revived = sum(1 for b in match.blocks if self._refcount[b] == 0)
        return max(0, _ceil_div(num_tokens, self.block_size) - len(match.blocks)) + revived

    def allocate_prefix(self, seq_id: SeqId, match: PrefixMatch) -> int:
        """Create `seq_id` sharing the matched cached blocks; returns the tokens they hold (its length).

        `match` must come from `match_prefix` with no allocation in between (eviction could reuse them).
        """
        if seq_id in self._tables:
            raise ValueError(f"{seq_id!r} already has blocks; a prefix is allocated only to a new sequence")
        for block, h in zip(match.blocks, match.hashes, strict=True):
            if self._cached.get(h) != block:
                raise ValueError(f"stale prefix match: block {block} no longer holds the matched prefix")
        for block in match.blocks:
            self._incref(block)
        self._tables[seq_id] = list(match.blocks)
        self._num_tokens[seq_id] = len(match.blocks) * self.block_size
        self._seq_hashes[seq_id] = list(match.hashes)
        return self._num_tokens[seq_id]

    def num_cached_tokens(self, seq_id: SeqId) -> int:
        """The sequence's first slots whose blocks were offered for reuse (`cache_full_blocks`): what another
        sequence with the same tokens may match."""
        return len(self._seq_hashes.get(seq_id, ())) * self.block_size

    def cache_full_blocks(self, seq_id: SeqId, token_ids: Sequence[int], num_tokens: int, salt: str = "") -> None:
        """Register the sequence's full blocks among its first `num_tokens` slots for reuse, under `salt`
        (the tenant: the same one the sequence's `match_prefix` used).

        `token_ids[:num_tokens]` must be committed tokens whose K/V are written in those slots (never
        draft positions). Blocks already registered are skipped, so calling this every step is cheap.
        A block whose prefix is already cached in another block (both were computed at once) stays
        private and is freed normally.
        """
        if not self.enable_prefix_caching or seq_id not in self._tables:
            return
        if not 0 <= num_tokens <= min(self._num_tokens[seq_id], len(token_ids)):
            raise ValueError(f"cannot cache {num_tokens} tokens of {seq_id!r}: beyond its tokens or slots")
        bs = self.block_size
        hashes = self._seq_hashes.setdefault(seq_id, [])
        table = self._tables[seq_id]
        for i in range(len(hashes), num_tokens // bs):
            h = block_hash(hashes[-1] if hashes else tenant_root(salt), token_ids[i * bs : (i + 1) * bs])
            hashes.append(h)
            block = table[i]
            known = self._hash_of.get(block)
            if known is not None:
                if known != h:
                    raise ValueError(f"block {block} of {seq_id!r} is cached with other content")
                continue
            if h not in self._cached:
                self._cached[h] = block
                self._hash_of[block] = h

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
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"{seq_id!r} needs {needed} blocks to reach {num_tokens} tokens, {self.num_free_blocks} free"
            )
        table = self._tables.setdefault(seq_id, [])
        cow: list[tuple[int, int]] = []
        if self._needs_cow(seq_id, current, num_tokens):
            src = table[-1]
            dst = self._allocate()
            self._decref(src)  # shared: stays owned; cached: stays cached (evictable at 0)
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
        hashes = self._seq_hashes.get(seq_id)
        if hashes is not None:
            del hashes[num_tokens // self.block_size :]

    def free(self, seq_id: SeqId) -> None:
        """Release all blocks of the sequence; unknown ids are ignored so abort-after-finish is safe."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        del self._num_tokens[seq_id]
        # A block left private because its prefix was cached elsewhere (both computed at once) takes
        # over if that copy has been evicted meanwhile, so the prefix stays findable.
        for block, h in zip(table, self._seq_hashes.pop(seq_id, []), strict=False):
            if block not in self._hash_of and h not in self._cached:
                self._cached[h] = block
                self._hash_of[block] = h
        # Reversed: the prefix's first blocks end up most recently used, so LRU eviction takes a
        # prefix's tail before its head (a head is useful without its tail, not the other way round).
        for block in reversed(table):
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
        if parent_id in self._seq_hashes:
            self._seq_hashes[child_id] = list(self._seq_hashes[parent_id])

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
        evictable = set(self._evictable)
        assert not free & evictable, f"blocks {sorted(free & evictable)} both free and evictable"
        assert free | evictable == unused, f"free + evictable {sorted(free | evictable)} != unused {sorted(unused)}"
        self._check_prefix_cache(free, evictable)

    def _check_prefix_cache(self, free: set[int], evictable: set[int]) -> None:
        assert {b: h for h, b in self._cached.items()} == self._hash_of, "hash -> block map is not a bijection"
        assert evictable <= self._hash_of.keys(), "an evictable block has no hash"
        assert not free & self._hash_of.keys(), "a free-list block still has a hash"
        assert self._seq_hashes.keys() <= self._tables.keys(), "hashes kept for a freed sequence"
        for seq_id, hashes in self._seq_hashes.items():
            full_blocks = self._num_tokens[seq_id] // self.block_size
            assert len(hashes) <= full_blocks, f"{seq_id!r}: hashes past its full blocks"
            for block, h in zip(self._tables[seq_id], hashes, strict=False):
                assert self._hash_of.get(block, h) == h, f"{seq_id!r}: block {block} cached under another prefix"

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
        last = self._tables[seq_id][-1]
        return self._refcount[last] > 1 or last in self._hash_of  # a cached block's content is immutable

    def _allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # evict the least recently used cached block
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash_of.pop(block)]
            self.num_evictions += 1
        self._refcount[block] = 1
        return block

    def _incref(self, block: int) -> None:
        if self._refcount[block] == 0:  # a cached block revived by a prefix hit
            del self._evictable[block]
        self._refcount[block] += 1

    def _decref(self, block: int) -> None:
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None  # most recently used end
            else:
                self._free.append(block)
