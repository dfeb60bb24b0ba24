"""A suffix tree of bounded depth over token sequences, with counts: the structure of suffix decoding.

The indexed strings are, for every start position s of every sequence, seq[s : s + max_depth] (cut at the
sequence's current end). Each is a path from the root; a node's `count` is how many strings pass through it or
end at it, and `ends` how many end exactly at it, so count = ends + the children's counts, and a continuation's
empirical probability is child.count / node.count. Paths are compressed: a node holds the `length` tokens of
its edge as a reference into one sequence that passes through it (`seq`, `pos`), and every position on an edge
has the node's count. A string always ends at the end of a node's edge.

Sequences grow by appends: the strings of a sequence's last max_depth - 1 starts are still growing, and their
end nodes (`_Sequence.active`, oldest start first) are each extended by one token per append, O(max_depth) per
token. Whole sequences go away with `remove`. Finding a string costs nothing while it is active: the end nodes
of a sequence's active strings are the matches of all its suffixes, which is how the drafter uses the tree.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import weakref
from array import array
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

# Bytes per node, for the memory estimate: the slotted object (8 slots) with its GC header, one dict entry in
# its parent, and the children dict of an inner node amortised (measured with tracemalloc on CPython 3.11:
# see tests/unit/test_suffix_tree.py::test_memory_estimate_is_close_to_what_python_allocates).
NODE_BYTES = 200
TOKEN_BYTES = 4  # sequences are array('i')


class Node:
    __slots__ = ("count", "ends", "children", "parent", "token", "seq", "pos", "length")

    def __init__(self, parent: Node | None, token: int, seq: Sequence[int], pos: int, length: int, count: int) -> None:
        self.count = count
        self.ends = 0
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.token = token  # the edge's first token: this node's key in its parent's children
        self.seq = seq  # the edge is seq[pos : pos + length]
        self.pos = pos
        self.length = length

    def edge_token(self, offset: int) -> int:
        return self.seq[self.pos + offset]


@dataclass
class _Sequence:
    tokens: array = field(default_factory=lambda: array("i"))
    active: deque[Node] = field(default_factory=deque)  # end nodes of the growing strings, oldest start first


@dataclass(frozen=True)
class Continuation:
    """Tokens that followed a match, in topological order: parents[i] is the index of token i's parent (-1: the
    match itself); a chain has parents [-1, 0, 1, ...]. probs[i] is the empirical probability of the path from the
    match to token i (product of child.count / node.count along it); score = sum(probs), the expected number of
    tokens the target accepts if the history's frequencies hold."""

    token_ids: list[int]
    parents: list[int]
    probs: list[float]

    @property
    def score(self) -> float:
        return sum(self.probs)


EMPTY = Continuation([], [], [])


class SuffixTree:
    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = Node(None, -1, array("i"), 0, 0, 0)
        self.sequences: dict[Hashable, _Sequence] = {}
        self.num_tokens = 0
        self.num_nodes = 1
        # Arrays of removed sequences that nodes still read (the same string in live sequences): counted in the
        # memory estimate while anything reads them (`_rehome`).
        self._remnants: list[weakref.ref[array]] = []

    def __contains__(self, key: Hashable) -> bool:
        return key in self.sequences

    def tokens(self, key: Hashable) -> array:
        return self.sequences[key].tokens

    def memory_bytes(self) -> int:
        return self.num_nodes * NODE_BYTES + (self.num_tokens + self.remnant_tokens()) * TOKEN_BYTES

    def remnant_tokens(self) -> int:
        """Tokens of removed sequences' arrays still read by nodes (read by the metrics thread: no pruning here)."""
        return sum(len(tokens) for ref in list(self._remnants) if (tokens := ref()) is not None)

    # ---- growing -------------------------------------------------------------------------------

    def append(self, key: Hashable, token: int) -> None:
        self.extend(key, (token,))

    def extend(self, key: Hashable, new_tokens: Iterable[int]) -> None:
        """Append tokens to a sequence (new or indexed): its growing strings take them, up to max_depth, and
        each new start's string is inserted from the root. Each string is grown once per call, whatever the
        number of tokens, so an engine step's accepted tokens or a whole prompt cost one walk per string."""
        state = self.sequences.get(key)
        if state is None:
            state = self.sequences[key] = _Sequence()
        seq = state.tokens
        old = len(seq)
        seq.extend(new_tokens)
        new = len(seq)
        if new == old:
            return
        self.num_tokens += new - old
        depth = self.max_depth
        first = old - len(state.active)  # the start of the oldest growing string
        ends = []
        for start, node in enumerate(state.active, first):
            end = start + depth if start + depth < new else new
            if node.ends == 1 and not node.children:  # the common case, inlined: _grow's lengthening
                node.seq, node.pos = seq, old - node.length
                node.length += end - old
                ends.append(node)
            else:
                ends.append(self._grow(node, seq, old, end))
        root = self.root
        for start in range(old, new):
            root.count += 1
            ends.append(self._grow(root, seq, start, start + depth if start + depth < new else new))
        # Strings max_depth long are complete; the others (starts > new - max_depth) keep growing.
        state.active = deque(ends[max(0, new - depth + 1 - first) :])

    def active_ends(self, key: Hashable) -> deque[Node]:
        """The end nodes of the sequence's suffixes of length len(active), ..., 2, 1 (oldest start first)."""
        return self.sequences[key].active

    def _grow(self, node: Node, seq: array, a: int, b: int) -> Node:
        """The string ending at `node` grows by seq[a:b]; returns its new end node. Invariant of the loop: the
        string ends at `node` (counted in its `ends` and in the counts along its path)."""
        root = self.root
        while a < b:
            child = node.children.get(seq[a])
            if node is not root and node.ends == 1:  # our string is the only one ending here
                if not node.children:  # and nothing goes on: the edge takes the rest
                    node.seq, node.pos = seq, a - node.length
                    node.length += b - a
                    return node
                if child is not None and len(node.children) == 1:
                    # Every other string here goes on into `child`: move the boundary between them rather than
                    # split `child`, so that a repeated text keeps its edges long.
                    node, a = self._slide(node, child, seq, a, b)
                    continue
                node.ends = 0
            elif node is not root:
                node.ends -= 1
            if child is None:
                leaf = node.children[seq[a]] = Node(node, seq[a], seq, a, b - a, 1)
                leaf.ends = 1
                self.num_nodes += 1
                return leaf
            matched = _common(child, seq, a, b)
            if matched < child.length:
                child = self._split(child, matched)
            child.count += 1
            child.ends += 1
            node, a = child, a + matched
        return node

    def _split(self, child: Node, at: int) -> Node:
        """Cut `child`'s edge after `at` tokens; the lower part keeps the node (strings ending there keep their
        end node). Returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = Node(parent, child.token, child.seq, child.pos, at, child.count)
        self.num_nodes += 1
        parent.children[child.token] = upper
        child.pos += at
        child.length -= at
        child.token = child.edge_token(0)
        child.parent = upper
        upper.children[child.token] = child
        return upper

    def _slide(self, node: Node, child: Node, seq: array, a: int, b: int) -> tuple[Node, int]:
        """Only our string ends at `node`, all others go on into `child`, and seq[a:] follows child's edge for
        `matched` tokens: our string takes them into node's edge. When that empties child's edge, child absorbs
        node instead (child keeps its identity: other strings may end at it)."""
        matched = _common(child, seq, a, b)
        start = a - node.length  # our string's copy of node's edge
        if matched == child.length:
            parent = node.parent
            assert parent is not None
            child.seq, child.pos, child.length = seq, start, node.length + matched
            child.token, child.parent = node.token, parent
            child.count += 1
            child.ends += 1
            parent.children[node.token] = child
            self.num_nodes -= 1
            return child, a + matched
        node.seq, node.pos = seq, start
        node.length += matched
        del node.children[child.token]
        child.pos += matched
        child.length -= matched
        child.token = child.edge_token(0)
        node.children[child.token] = child
        return node, a + matched

    # ---- removing ------------------------------------------------------------------------------

    def remove(self, key: Hashable) -> None:
        state = self.sequences.pop(key)
        seq = state.tokens
        left: dict[int, Node] = {}  # nodes whose edge still reads `seq` when one of its strings went
        for start in range(len(seq)):
            self._remove_string(seq, start, min(start + self.max_depth, len(seq)), left)
        self.num_tokens -= len(seq)
        self._rehome(seq, [node for node in left.values() if node.seq is seq and _attached(node)])

    def _rehome(self, seq: array, nodes: list[Node]) -> None:
        """Nodes that still read a removed sequence (their strings live on in others) read the parts of it their
        paths need, copied into one array, or the whole array where those parts are most of it (a repeated
        text: a copy would save little); either way it is counted in `memory_bytes` while read."""
        self._remnants = [ref for ref in self._remnants if ref() is not None]
        if not nodes:
            return
        spans = []  # each node's whole string from the root: a merge or a parent reads before its edge
        for node in nodes:
            end = node.pos + node.length
            spans.append((end - _depth(node), end))
        merged: list[list[int]] = []
        for first, end in sorted(spans):
            if merged and first <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([first, end])
        kept = sum(end - first for first, end in merged)
        if 2 * kept >= len(seq):
            self._remnants.append(weakref.ref(seq))
            return
        remnant, starts, offsets = array("i"), [], []
        for first, end in merged:
            starts.append(first)
            offsets.append(len(remnant) - first)
            remnant.extend(seq[first:end])
        for node, (first, _) in zip(nodes, spans, strict=True):
            node.seq, node.pos = remnant, node.pos + offsets[bisect.bisect_right(starts, first) - 1]
        self._remnants.append(weakref.ref(remnant))

    def _remove_string(self, seq: array, start: int, end: int, left: dict[int, Node]) -> None:
        self.root.count -= 1
        path = []
        node, i = self.root, start
        while i < end:
            node = node.children[seq[i]]
            node.count -= 1
            path.append(node)
            i += node.length
        assert i == end, "a string ends inside an edge"
        node.ends -= 1
        for node in reversed(path):  # deepest first: a node's children are settled before it
            parent = node.parent
            assert parent is not None
            if node.count == 0:
                del parent.children[node.token]
                self.num_nodes -= 1
                continue
            if node.seq is seq:  # its edge reads a sequence going away
                child = next(iter(node.children.values()), None)
                if child is not None and child.seq is not seq:  # read another's copy
                    node.seq, node.pos = child.seq, child.pos - node.length
                else:  # a leaf (the same string in other sequences), or its child reads `seq` too
                    left[id(node)] = node
            if node.ends == 0 and len(node.children) == 1:  # unary, same count as its child: merge them
                (child,) = node.children.values()
                child.pos -= node.length
                child.length += node.length
                child.token, child.parent = node.token, parent
                parent.children[node.token] = child
                self.num_nodes -= 1

    # ---- reading -------------------------------------------------------------------------------

    def find(self, pattern: Sequence[int]) -> tuple[Node, int] | None:
        """Where `pattern` ends: (node, tokens of its edge matched), or None when it never occurs."""
        node, offset = self.root, 0
        for token in pattern:
            if offset == node.length:
                child = node.children.get(token)
                if child is None:
                    return None
                node, offset = child, 0
            elif node.edge_token(offset) != token:
                return None
            offset += 1
        return node, offset

    def best_chain(self, node: Node, offset: int, max_tokens: int, min_prob: float) -> Continuation:
        """The most frequent continuation of the string ending at (node, offset): follow the most counted child
        while the path's probability stays >= min_prob, at most max_tokens tokens."""
        tokens: list[int] = []
        probs: list[float] = []
        prob = 1.0
        while len(tokens) < max_tokens:
            if offset < node.length:
                tokens.append(node.edge_token(offset))
                probs.append(prob)
                offset += 1
                continue
            child = max(node.children.values(), key=_count, default=None)
            if child is None:
                break
            prob *= child.count / node.count
            if prob < min_prob:
                break
            node, offset = child, 0
        return Continuation(tokens, list(range(-1, len(tokens) - 1)), probs)

    def best_tree(
        self, node: Node, offset: int, max_nodes: int, min_prob: float, max_depth: int | None = None
    ) -> Continuation:
        """Several frequent continuations as one token tree: nodes taken best first by path probability while it
        stays >= min_prob, at most max_nodes, none deeper than max_depth (a chain of k tokens is k deep); a node
        always comes after its parent."""
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        depths: list[int] = []
        order = itertools.count()  # ties: first pushed first, so the result is deterministic
        # A path's probability is its count over the pattern's, not a product along the path: at min_prob the
        # product (0.6 * 1/6 = 0.0999...) could drop a continuation seen exactly min_prob of the time.
        base = node.count
        heap = [(-1.0, next(order), node, offset, -1)]
        while heap and len(tokens) < max_nodes:
            neg_prob, _, node, offset, parent = heapq.heappop(heap)
            depth = depths[parent] + 1 if parent >= 0 else 1
            if max_depth is not None and depth > max_depth:
                continue
            if offset < node.length:
                tokens.append(node.edge_token(offset))
                parents.append(parent)
                probs.append(-neg_prob)
                depths.append(depth)
                heapq.heappush(heap, (neg_prob, next(order), node, offset + 1, len(tokens) - 1))
                continue
            for child in sorted(node.children.values(), key=_count, reverse=True):
                prob = child.count / base
                if prob >= min_prob:
                    heapq.heappush(heap, (-prob, next(order), child, 0, parent))
        return Continuation(tokens, parents, probs)


def _depth(node: Node) -> int:
    """The length of the node's string from the root (at most max_depth)."""
    depth = 0
    while node.parent is not None:
        depth += node.length
        node = node.parent
    return depth


def _attached(node: Node) -> bool:
    """Still in the tree: not removed, nor merged into its child."""
    return node.parent is not None and node.parent.children.get(node.token) is node


def _common(child: Node, seq: array, a: int, b: int) -> int:
    """How many of seq[a:b] follow child's edge from its start (>= 1: its first token is the key)."""
    n = min(child.length, b - a)
    edge = child.seq
    pos = child.pos
    if edge[pos : pos + n] == seq[a : a + n]:
        return n
    matched = 1
    while edge[pos + matched] == seq[a + matched]:
        matched += 1
    return matched


def _count(node: Node) -> int:
    return node.count
