"""Tests for the paged-KV block manager: hand-made cases plus a hypothesis state machine.

The state machine checks the manager against a tiny reference model and, end to end, against a
fake cache (a dict slot -> value): each step writes the sequence's new tokens through
`slot_mapping` after applying the CoW copies, and every sequence must always read back exactly
its own tokens. That catches any sharing bug without trusting the manager's own bookkeeping.

Prefix caching is part of the model: which full blocks are cached (by their whole token prefix),
the LRU order of evictable blocks, and which blocks a lookup must hit. Rules commit (register),
add a sequence sharing a cached prefix, and preempt (commit, free, re-admit).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shared.kv.block_manager import BlockManager, NoFreeBlocksError


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def snapshot(bm: BlockManager, seq_ids) -> tuple:
    return (
        bm.num_free_blocks,
        {s: (bm.num_tokens(s), bm.block_table(s)) for s in seq_ids if bm.has_seq(s)},
    )


# ---------------------------------------------------------------------- hand-made cases


def test_fresh_manager():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.num_free_blocks == 4
    assert not bm.has_seq("a")
    assert bm.num_tokens("a") == 0
    bm.check_invariants()


def test_bad_construction():
    with pytest.raises(ValueError):
        BlockManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError):
        BlockManager(num_blocks=-1, block_size=4)


def test_allocation_across_block_boundaries():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.reserve("a", 4) == []
    assert len(bm.block_table("a")) == 1  # exactly one full block
    assert bm.blocks_needed("a", 5) == 1
    bm.reserve("a", 5)  # first slot of the second block
    assert len(bm.block_table("a")) == 2
    assert bm.blocks_needed("a", 8) == 0
    bm.reserve("a", 8)
    assert len(bm.block_table("a")) == 2
    bm.reserve("a", 9)
    assert len(bm.block_table("a")) == 3
    assert bm.num_tokens("a") == 9
    assert bm.num_free_blocks == 5
    assert len(set(bm.block_table("a"))) == 3
    bm.check_invariants()


def test_reserve_same_length_is_noop_and_zero_creates():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert bm.reserve("a", 0) == []
    assert bm.has_seq("a") and bm.block_table("a") == [] and bm.num_free_blocks == 2
    bm.reserve("a", 3)
    before = snapshot(bm, ["a"])
    assert bm.reserve("a", 3) == []
    assert snapshot(bm, ["a"]) == before
    bm.check_invariants()


def test_reserve_shrink_is_value_error():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.reserve("a", 6)
    with pytest.raises(ValueError):
        bm.reserve("a", 5)
    with pytest.raises(ValueError):
        bm.blocks_needed("a", 2)
    assert bm.num_tokens("a") == 6


def test_slot_mapping_values():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.reserve("a", 3)  # block 0
    bm.reserve("b", 2)  # block 1
    bm.reserve("a", 6)  # block 2: tables interleave, so "a" is not contiguous
    assert bm.block_table("a") == [0, 2]
    assert bm.block_table("b") == [1]
    assert bm.slot_mapping("a", 0, 6) == [0, 1, 2, 3, 8, 9]
    assert bm.slot_mapping("a", 3, 5) == [3, 8]
    assert bm.slot_mapping("b", 0, 2) == [4, 5]
    assert bm.slot_mapping("a", 2, 2) == []
    with pytest.raises(ValueError):
        bm.slot_mapping("a", 0, 7)  # position 6 not reserved
    with pytest.raises(ValueError):
        bm.slot_mapping("a", 3, 2)


def test_slot_mapping_uses_block_table():
    bm = BlockManager(num_blocks=16, block_size=3)
    for i in range(5):
        bm.reserve(i, 3 * (i + 1))
    for i in range(5):
        table = bm.block_table(i)
        slots = bm.slot_mapping(i, 0, bm.num_tokens(i))
        assert slots == [table[p // 3] * 3 + p % 3 for p in range(bm.num_tokens(i))]
        assert len(set(slots)) == len(slots)


def test_freed_blocks_are_reused_and_tables_become_non_contiguous():
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.reserve("a", 4)
    bm.reserve("b", 4)
    bm.free("a")
    bm.reserve("c", 8)
    table = bm.block_table("c")
    assert any(y != x + 1 for x, y in zip(table, table[1:], strict=False))  # reused, so scattered
    assert set(table).isdisjoint(bm.block_table("b"))
    bm.check_invariants()


def test_rollback_frees_exactly_the_right_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.reserve("a", 10)  # 3 blocks, last one holds 2 slots
    table = bm.block_table("a")
    free_before = bm.num_free_blocks
    bm.rollback("a", 9)  # still 3 blocks
    assert bm.block_table("a") == table and bm.num_free_blocks == free_before
    bm.rollback("a", 8)  # third block no longer needed
    assert bm.block_table("a") == table[:2]
    assert bm.num_free_blocks == free_before + 1
    assert bm.ref_count(table[2]) == 0
    bm.rollback("a", 5)
    assert bm.block_table("a") == table[:2]
    bm.rollback("a", 1)
    assert bm.block_table("a") == table[:1]
    bm.rollback("a", 0)
    assert bm.block_table("a") == [] and bm.has_seq("a") and bm.num_tokens("a") == 0
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_rollback_errors():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.reserve("a", 5)
    with pytest.raises(ValueError):
        bm.rollback("a", 6)
    with pytest.raises(ValueError):
        bm.rollback("a", -1)
    with pytest.raises(KeyError):
        bm.rollback("nope", 0)
    assert bm.num_tokens("a") == 5


def test_reserve_then_rollback_restores_free_count():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.reserve("a", 6)
    free_before, table_before = bm.num_free_blocks, bm.block_table("a")
    bm.reserve("a", 15)
    bm.rollback("a", 6)
    assert bm.num_free_blocks == free_before
    assert bm.block_table("a") == table_before


def test_reserve_is_atomic_on_exhaustion():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.reserve("a", 6)
    bm.reserve("b", 5)
    before = snapshot(bm, ["a", "b", "c"])
    assert not bm.can_reserve("a", 13)
    with pytest.raises(NoFreeBlocksError):
        bm.reserve("a", 13)  # needs 2 more, 0 free
    with pytest.raises(NoFreeBlocksError):
        bm.reserve("c", 1)  # a new sequence must not be created either
    assert not bm.has_seq("c")
    assert snapshot(bm, ["a", "b", "c"]) == before
    bm.check_invariants()
    assert bm.can_reserve("a", 8)


def test_reserve_atomic_when_cow_copy_does_not_fit():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.reserve("p", 6)  # both blocks
    bm.fork("p", "c")
    before = snapshot(bm, ["p", "c"])
    assert bm.blocks_needed("c", 7) == 1  # only the CoW copy
    with pytest.raises(NoFreeBlocksError):
        bm.reserve("c", 7)
    assert snapshot(bm, ["p", "c"]) == before
    bm.check_invariants()


def test_free_unknown_is_noop_and_double_free_is_safe():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.reserve("a", 5)
    bm.free("zzz")
    bm.free("a")
    bm.free("a")  # abort after finish
    assert bm.num_free_blocks == 4 and not bm.has_seq("a")
    bm.check_invariants()


def test_fork_shares_blocks_and_cow_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.reserve("p", 6)
    parent_table = bm.block_table("p")
    free_before = bm.num_free_blocks
    bm.fork("p", "c")
    assert bm.block_table("c") == parent_table and bm.num_tokens("c") == 6
    assert bm.num_free_blocks == free_before  # sharing costs nothing
    assert [bm.ref_count(b) for b in parent_table] == [2, 2]
    bm.check_invariants()

    assert bm.blocks_needed("c", 7) == 1
    cow = bm.reserve("c", 7)  # slot 6 falls in the shared second block
    child_table = bm.block_table("c")
    assert cow == [(parent_table[1], child_table[1])]
    assert child_table[0] == parent_table[0] and child_table[1] != parent_table[1]
    assert bm.block_table("p") == parent_table and bm.num_tokens("p") == 6  # parent untouched
    assert bm.ref_count(parent_table[0]) == 2
    assert bm.ref_count(parent_table[1]) == 1
    assert bm.ref_count(child_table[1]) == 1
    assert bm.num_free_blocks == free_before - 1
    bm.check_invariants()

    # The parent now owns its last block alone: writing in place needs no copy.
    assert bm.reserve("p", 8) == []
    assert bm.block_table("p") == parent_table
    # Only the shared first block is left; it is full so growing past it copies nothing.
    assert bm.reserve("c", 12) == []
    bm.free("p")
    assert bm.ref_count(parent_table[0]) == 1
    bm.free("c")
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_fork_at_block_boundary_needs_no_cow():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.reserve("p", 8)
    bm.fork("p", "c")
    assert bm.blocks_needed("c", 9) == 1
    assert bm.reserve("c", 9) == []
    assert bm.block_table("c")[:2] == bm.block_table("p")
    bm.check_invariants()


def test_fork_errors():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.reserve("p", 3)
    bm.reserve("q", 3)
    with pytest.raises(KeyError):
        bm.fork("nope", "c")
    with pytest.raises(ValueError):
        bm.fork("p", "q")
    assert bm.block_table("q") != bm.block_table("p")
    bm.check_invariants()


def test_rollback_into_shared_block_then_reserve_triggers_cow():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.reserve("p", 8)  # two full blocks
    bm.fork("p", "c")
    shared = bm.block_table("p")
    bm.rollback("c", 5)  # back into the shared second block; nothing is freed
    assert bm.block_table("c") == shared
    assert bm.ref_count(shared[1]) == 2
    assert bm.num_free_blocks == 6
    cow = bm.reserve("c", 7)  # overwriting slots 5..6 would clobber the parent's tokens
    assert cow == [(shared[1], bm.block_table("c")[1])]
    assert bm.block_table("p") == shared
    assert bm.ref_count(shared[1]) == 1
    bm.check_invariants()
    # Rolling back the child past the copy frees the private copy only.
    copy = bm.block_table("c")[1]
    bm.rollback("c", 4)
    assert bm.ref_count(copy) == 0 and bm.block_table("c") == shared[:1]
    bm.check_invariants()


def test_rollback_shared_full_block_only_decrements():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.reserve("p", 8)
    bm.fork("p", "c")
    bm.rollback("c", 4)
    table = bm.block_table("p")
    assert bm.ref_count(table[1]) == 1  # still owned by the parent, not freed
    assert bm.num_free_blocks == 2
    bm.check_invariants()


def test_check_invariants_detects_corruption():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.reserve("a", 5)
    bm._refcount[bm.block_table("a")[0]] += 1
    with pytest.raises(AssertionError):
        bm.check_invariants()

    bm = BlockManager(num_blocks=4, block_size=4)
    bm.reserve("a", 5)
    bm._free.append(bm.block_table("a")[0])  # block both free and used
    with pytest.raises(AssertionError):
        bm.check_invariants()

    bm = BlockManager(num_blocks=4, block_size=4)
    bm.reserve("a", 5)
    bm._num_tokens["a"] = 9  # table too short for its length
    with pytest.raises(AssertionError):
        bm.check_invariants()


# ---------------------------------------------------------------------- state machine

NUM_SEQS = 5
SEQ_IDS = st.sampled_from(range(NUM_SEQS))


class BlockManagerMachine(RuleBasedStateMachine):
    """Reference model: per sequence its token values and its blocks as abstract ids.

    Abstract ids model sharing (fork copies them, CoW replaces the last one) without choosing
    physical ids; the manager must keep a bijection between abstract and physical ids.
    """

    @initialize(num_blocks=st.integers(1, 16), block_size=st.integers(1, 8))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.bs = block_size
        self.tokens: dict[int, list[int]] = {}
        self.blocks: dict[int, list[int]] = {}
        self.next_abstract = 0
        self.next_value = 0
        self.cache: dict[int, int] = {}  # physical slot -> token value
        # Prefix-cache model: cached abstract block -> its whole token prefix, and the inverse.
        self.key_of: dict[int, tuple[int, ...]] = {}
        self.block_of: dict[tuple[int, ...], int] = {}
        self.evictable: list[int] = []  # cached blocks nobody owns, least recently used first
        self.processed: dict[int, int] = {}  # per sequence: leading full blocks already offered to the cache
        self.histories: list[list[int]] = []  # token lists of sequences seen, to draw shared prefixes from

    # -- model helpers

    def _new_abstract(self) -> int:
        self.next_abstract += 1
        return self.next_abstract

    def _shared(self, abstract: int) -> bool:
        return sum(blocks.count(abstract) for blocks in self.blocks.values()) > 1

    def _owned(self, abstract: int) -> bool:
        return any(abstract in blocks for blocks in self.blocks.values())

    def _model_needed(self, seq: int, n: int) -> tuple[int, bool]:
        cur = len(self.tokens.get(seq, []))
        blocks = self.blocks.get(seq, [])
        cow = n > cur and cur % self.bs != 0 and (self._shared(blocks[-1]) or blocks[-1] in self.key_of)
        return ceil_div(n, self.bs) - len(blocks) + int(cow), cow

    def _model_alloc(self) -> int:
        """A fresh abstract block; with no plain free block, the LRU evictable one loses its cache entry."""
        plain_free = self.bm.num_blocks - len({a for b in self.blocks.values() for a in b}) - len(self.evictable)
        if plain_free == 0:
            victim = self.evictable.pop(0)
            del self.block_of[self.key_of.pop(victim)]
            event("evict")
        return self._new_abstract()

    def _model_release(self, abstracts: list[int]) -> None:
        """Abstract blocks dropped from a table (already removed), in the manager's order."""
        for a in abstracts:
            if not self._owned(a) and a in self.key_of:
                self.evictable.append(a)

    def _model_hits(self, tokens: list[int]) -> list[int]:
        hits = []
        for end in range(self.bs, len(tokens) + 1, self.bs):
            block = self.block_of.get(tuple(tokens[:end]))
            if block is None:
                break
            hits.append(block)
        return hits

    def _model_free(self) -> int:
        used = {a for blocks in self.blocks.values() for a in blocks}
        return self.bm.num_blocks - len(used)

    def _pick_seq(self, data) -> int:
        """Mostly a live sequence, so rules do real work; sometimes any id, for new-seq and error paths."""
        live = sorted(self.blocks)
        if live and data.draw(st.integers(0, 3), label="live") > 0:
            return data.draw(st.sampled_from(live), label="seq")
        return data.draw(SEQ_IDS, label="seq")

    def _others(self, seq: int) -> dict[int, list[int]]:
        return {s: self.bm.block_table(s) for s in self.blocks if s != seq}

    # -- rules

    def _shares_partial_tail(self, seq: int) -> bool:
        blocks = self.blocks[seq]
        return len(self.tokens[seq]) % self.bs != 0 and self._shared(blocks[-1])

    @rule(data=st.data(), extra=st.integers(0, 6))
    def reserve(self, data, extra: int) -> None:
        self._reserve(self._pick_seq(data), extra)

    @precondition(lambda self: any(self._shares_partial_tail(s) for s in self.blocks))
    @rule(data=st.data(), extra=st.integers(1, 3))
    def write_into_shared_tail(self, data, extra: int) -> None:
        """Grow a sequence whose partial last block is shared: the copy-on-write path."""
        candidates = [s for s in sorted(self.blocks) if self._shares_partial_tail(s)]
        self._reserve(data.draw(st.sampled_from(candidates), label="seq"), extra)

    def _reserve(self, seq: int, extra: int, values: list[int] | None = None) -> None:
        cur = len(self.tokens.get(seq, []))
        n = cur + extra
        needed, cow_expected = self._model_needed(seq, n)
        assert self.bm.blocks_needed(seq, n) == needed
        assert self.bm.can_reserve(seq, n) == (needed <= self.bm.num_free_blocks)
        before = snapshot(self.bm, self.blocks.keys() | {seq})
        others = self._others(seq)
        old_table = self.bm.block_table(seq) if seq in self.blocks else []
        if needed > self._model_free():
            event("reserve: out of blocks")
            with pytest.raises(NoFreeBlocksError):
                self.bm.reserve(seq, n)
            assert snapshot(self.bm, self.blocks.keys() | {seq}) == before
            assert self.bm.has_seq(seq) == (seq in self.blocks)
            return

        cow = self.bm.reserve(seq, n)
        new_table = self.bm.block_table(seq)
        # A copied block that only this sequence owned (it was cached) becomes evictable, i.e. free.
        released = sum(self.bm.ref_count(src) == 0 for src, _ in cow)
        assert self.bm.num_free_blocks == before[0] - needed + released
        assert self._others(seq) == others  # nobody else's table moves
        # Blocks before the write position are kept; a copy replaces only the shared partial one.
        assert new_table[: cur // self.bs] == old_table[: cur // self.bs]
        if cow_expected:
            event("reserve: copy-on-write")
            assert cow == [(old_table[-1], new_table[len(old_table) - 1])]
        else:
            assert cow == []
            assert new_table[: len(old_table)] == old_table

        # Model update, in the manager's order: the copy, then the old block's release, then growth.
        blocks = self.blocks.setdefault(seq, [])
        self.processed.setdefault(seq, 0)
        if cow_expected:
            old, blocks[-1] = blocks[-1], self._model_alloc()
            self._model_release([old])
        blocks.extend(self._model_alloc() for _ in range(ceil_div(n, self.bs) - len(blocks)))
        if values is None:
            values = list(range(self.next_value, self.next_value + extra))
            self.next_value += extra
        self.tokens.setdefault(seq, []).extend(values)

        # Fake cache: copy then write, exactly as the verifier would.
        for src, dst in cow:
            for off in range(self.bs):
                if src * self.bs + off in self.cache:
                    self.cache[dst * self.bs + off] = self.cache[src * self.bs + off]
        for slot, value in zip(self.bm.slot_mapping(seq, cur, n), values, strict=True):
            self.cache[slot] = value

    @precondition(lambda self: bool(self.blocks))
    @rule(data=st.data())
    def rollback(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.blocks)), label="seq")
        cur = len(self.tokens[seq])
        n = data.draw(st.integers(0, cur), label="rollback_to")
        others = self._others(seq)
        old_table = self.bm.block_table(seq)
        free_before = self.bm.num_free_blocks
        unshared = all(self.bm.ref_count(b) == 1 for b in old_table)

        self.bm.rollback(seq, n)

        keep = ceil_div(n, self.bs)
        assert self.bm.block_table(seq) == old_table[:keep]
        assert self._others(seq) == others
        released = old_table[keep:]
        freed = [b for b in released if self.bm.ref_count(b) == 0]
        assert self.bm.num_free_blocks == free_before + len(freed)
        event(f"rollback: {'unshared' if unshared else 'shared'}")
        if unshared:  # the free count is what it was when this sequence had n tokens
            assert freed == released
            assert self.bm.num_free_blocks == free_before + len(old_table) - keep
        del self.tokens[seq][n:]
        dropped = self.blocks[seq][keep:]
        del self.blocks[seq][keep:]
        self._model_release(dropped)
        self.processed[seq] = min(self.processed[seq], n // self.bs)

    @precondition(lambda self: bool(self.blocks))
    @rule(data=st.data(), extra=st.integers(1, 9))
    def reserve_then_rollback(self, data, extra: int) -> None:
        """A verify step that rejects every draft token leaves only the CoW copy behind."""
        seq = data.draw(st.sampled_from(sorted(self.blocks)), label="seq")
        cur = len(self.tokens[seq])
        free_before = self.bm.num_free_blocks
        table_before = self.bm.block_table(seq)
        try:
            cow = self.bm.reserve(seq, cur + extra)
        except NoFreeBlocksError:
            assert self.bm.num_free_blocks == free_before
            return
        self.bm.rollback(seq, cur)
        released = sum(self.bm.ref_count(src) == 0 for src, _ in cow)
        assert self.bm.num_free_blocks == free_before - len(cow) + released
        blocks = self.blocks[seq]
        if cow:
            event("reserve_then_rollback: copy-on-write")
            ((src, dst),) = cow
            assert self.bm.block_table(seq) == table_before[:-1] + [dst]
            for off in range(self.bs):
                if src * self.bs + off in self.cache:
                    self.cache[dst * self.bs + off] = self.cache[src * self.bs + off]
            old, blocks[-1] = blocks[-1], self._model_alloc()
            self._model_release([old])
        else:
            assert self.bm.block_table(seq) == table_before
        # The grown blocks were allocated (possibly evicting) and released again, unhashed.
        kept = len(blocks)
        blocks.extend(self._model_alloc() for _ in range(ceil_div(cur + extra, self.bs) - kept))
        grown = blocks[kept:]
        del blocks[kept:]
        self._model_release(grown)

    @rule(data=st.data())
    def free(self, data) -> None:
        self._free(self._pick_seq(data))

    def _free(self, seq: int) -> None:
        others = self._others(seq)
        if seq in self.blocks:  # a block left private because its prefix was cached elsewhere takes over
            for i in range(self.processed[seq]):
                key = tuple(self.tokens[seq][: (i + 1) * self.bs])
                if self.blocks[seq][i] not in self.key_of and key not in self.block_of:
                    self.key_of[self.blocks[seq][i]] = key
                    self.block_of[key] = self.blocks[seq][i]
                    event("free: private duplicate cached")
        self.bm.free(seq)
        assert not self.bm.has_seq(seq)
        assert self._others(seq) == others
        tokens = self.tokens.pop(seq, None)
        if tokens:
            self.histories.append(tokens)
        self._model_release(list(reversed(self.blocks.pop(seq, []))))
        self.processed.pop(seq, None)

    @precondition(lambda self: bool(self.blocks))
    @rule(data=st.data())
    def commit(self, data) -> None:
        """Mark a sequence's first n tokens committed: its full blocks among them become cacheable."""
        seq = data.draw(st.sampled_from(sorted(self.blocks)), label="seq")
        n = data.draw(st.integers(0, len(self.tokens[seq])), label="committed")
        self._commit(seq, n)

    def _commit(self, seq: int, n: int) -> None:
        self.bm.cache_full_blocks(seq, self.tokens[seq], n)
        tokens, blocks = self.tokens[seq], self.blocks[seq]
        for i in range(self.processed[seq], n // self.bs):
            key = tuple(tokens[: (i + 1) * self.bs])
            if blocks[i] in self.key_of:
                assert self.key_of[blocks[i]] == key
            elif key not in self.block_of:
                self.key_of[blocks[i]] = key
                self.block_of[key] = blocks[i]
                event("commit: block cached")
        self.processed[seq] = max(self.processed[seq], n // self.bs)

    @precondition(lambda self: bool(self.histories or self.blocks))
    @rule(data=st.data(), extra=st.integers(1, 6))
    def add_with_prefix(self, data, extra: int) -> None:
        """A new sequence whose tokens start with (part of) one seen before: it shares cached blocks."""
        sources = self.histories + [self.tokens[s] for s in sorted(self.tokens)]
        source = data.draw(st.sampled_from(sources), label="source")
        cut = data.draw(st.integers(0, len(source)), label="cut")
        fresh = list(range(self.next_value, self.next_value + extra))
        self.next_value += extra
        self._add(data.draw(SEQ_IDS, label="seq"), list(source[:cut]) + fresh)

    def _add(self, seq: int, tokens: list[int]) -> int | None:
        """Admit `seq` with `tokens` like the scheduler; returns its cache hits in tokens (None: refused)."""
        if seq in self.blocks:
            with pytest.raises(ValueError):
                self.bm.allocate_prefix(seq, self.bm.match_prefix(tokens))
            return None
        match = self.bm.match_prefix(tokens[:-1])
        hits = self._model_hits(tokens[:-1])
        assert len(match.blocks) == len(hits)
        revived = sum(a in self.evictable for a in hits)
        needed = ceil_div(len(tokens), self.bs) - len(hits) + revived
        assert self.bm.blocks_needed_with_prefix(match, len(tokens)) == needed
        if needed > self._model_free():
            event("add: out of blocks")
            return None
        cached = self.bm.allocate_prefix(seq, match)
        assert cached == len(hits) * self.bs
        event(f"add: {'hit' if hits else 'miss'}")
        for a in hits:
            if a in self.evictable:
                self.evictable.remove(a)
        self.blocks[seq] = list(hits)
        self.tokens[seq] = tokens[:cached]
        self.processed[seq] = len(hits)
        self._reserve(seq, len(tokens) - cached, tokens[cached:])
        return cached

    @precondition(lambda self: bool(self.blocks))
    @rule(data=st.data())
    def preempt(self, data) -> None:
        """Preemption by recompute: everything written is committed, freed, and re-admitted at once."""
        seq = data.draw(st.sampled_from(sorted(self.blocks)), label="seq")
        tokens = list(self.tokens[seq])
        self._commit(seq, len(tokens))
        self._free(seq)
        if not tokens:
            return
        cached = self._add(seq, tokens)
        # Nothing was allocated in between, so every full block before the last token is found again
        # (re-admission itself may wait for room, when a fork still holds the sequence's blocks).
        if cached is not None:
            assert cached == (len(tokens) - 1) // self.bs * self.bs

    @precondition(lambda self: bool(self.blocks))
    @rule(data=st.data())
    def fork(self, data) -> None:
        """Mostly a live parent into an unused id, so sharing (and CoW) is common; sometimes not."""
        parent = self._pick_seq(data)
        unused = [s for s in range(NUM_SEQS) if s not in self.blocks]
        if unused and data.draw(st.integers(0, 3), label="unused") > 0:
            child = data.draw(st.sampled_from(unused), label="child")
        else:
            child = data.draw(SEQ_IDS, label="child")
        if parent not in self.blocks:
            with pytest.raises(KeyError):
                self.bm.fork(parent, child)
            return
        if child in self.blocks:
            before = snapshot(self.bm, self.blocks.keys())
            with pytest.raises(ValueError):
                self.bm.fork(parent, child)
            assert snapshot(self.bm, self.blocks.keys()) == before
            return
        free_before = self.bm.num_free_blocks
        self.bm.fork(parent, child)
        assert self.bm.block_table(child) == self.bm.block_table(parent)
        assert self.bm.num_free_blocks == free_before
        self.tokens[child] = list(self.tokens[parent])
        self.blocks[child] = list(self.blocks[parent])
        self.processed[child] = self.processed[parent]

    @rule()
    def free_all(self) -> None:
        for seq in sorted(self.blocks):
            self._free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(self.bm.ref_count(b) == 0 for b in range(self.bm.num_blocks))

    # -- invariants

    @invariant()
    def manager_invariants(self) -> None:
        self.bm.check_invariants()

    @invariant()
    def matches_model(self) -> None:
        assert self.bm.num_free_blocks == self._model_free()
        to_phys: dict[int, int] = {}
        to_abstract: dict[int, int] = {}
        used: set[int] = set()
        for seq, blocks in self.blocks.items():
            assert self.bm.has_seq(seq)
            assert self.bm.num_tokens(seq) == len(self.tokens[seq])
            table = self.bm.block_table(seq)
            assert len(table) == len(blocks)
            assert len(set(table)) == len(table), "a block appears twice in one table"
            for abstract, phys in zip(blocks, table, strict=True):
                # Physical sharing must be exactly the model's (refcounted) sharing.
                assert to_phys.setdefault(abstract, phys) == phys
                assert to_abstract.setdefault(phys, abstract) == abstract
                assert 0 <= phys < self.bm.num_blocks
                used.add(phys)
        for phys in used:
            owners = sum(self.bm.block_table(s).count(phys) for s in self.blocks)
            assert self.bm.ref_count(phys) == owners
        assert self.bm.num_free_blocks + len(used) == self.bm.num_blocks

    @invariant()
    def every_sequence_reads_back_its_tokens(self) -> None:
        for seq, values in self.tokens.items():
            slots = self.bm.slot_mapping(seq, 0, len(values))
            assert [self.cache.get(s) for s in slots] == values

    @invariant()
    def prefix_cache_matches_model(self) -> None:
        """Same evictable count; every cached prefix is found as far as the model says, with its content."""
        assert self.bm.num_cached_blocks == len(self.evictable)
        for key in self.block_of:
            match = self.bm.match_prefix(list(key))
            assert len(match.blocks) == len(self._model_hits(list(key)))
            for j, block in enumerate(match.blocks):
                assert self.bm.is_cached(block)
                slots = range(block * self.bs, (block + 1) * self.bs)
                assert [self.cache.get(s) for s in slots] == list(key[j * self.bs : (j + 1) * self.bs])

    def teardown(self) -> None:
        for seq in range(NUM_SEQS):
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        self.bm.check_invariants()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
