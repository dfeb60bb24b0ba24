"""The suffix tree against a brute-force reference: the counts of every substring, the active ends, the best
chain and the best tree of continuations, under random appends and removals (hypothesis)."""

from __future__ import annotations

import random
import tracemalloc
from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from proposer_service.suffix_tree import NODE_BYTES, TOKEN_BYTES, Node, SuffixTree

ALPHABET = 3  # few symbols: repeats, branches and shared edges happen all the time


class Reference:
    """The indexed strings written out: for every start of every sequence, seq[start : start + depth]."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.seqs: dict[int, list[int]] = {}

    def count(self, pattern: list[int]) -> int:
        n = len(pattern)
        return sum(
            1
            for seq in self.seqs.values()
            for start in range(len(seq))
            if n <= min(self.depth, len(seq) - start) and seq[start : start + n] == pattern
        )

    def substrings(self) -> set[tuple[int, ...]]:
        return {
            tuple(seq[i:j])
            for seq in self.seqs.values()
            for i in range(len(seq))
            for j in range(i + 1, min(i + self.depth, len(seq)) + 1)
        }

    def next_counts(self, pattern: list[int]) -> dict[int, int]:
        if len(pattern) >= self.depth:
            return {}
        counts = {t: self.count([*pattern, t]) for t in range(ALPHABET)}
        return {t: c for t, c in counts.items() if c}


def check_structure(tree: SuffixTree, removed: list[array] = ()) -> None:
    """`removed`: arrays of sequences no longer in the tree, which a node reads only where the tree counts it."""
    stack, seen, paths = [tree.root], 0, {id(tree.root): []}
    while stack:
        node = stack.pop()
        seen += 1
        path = paths.pop(id(node))
        # The array a node reads holds its whole string from the root, not just its edge: a merge with its
        # parent (on a removal) or its parent re-pointed at it reads the tokens before the edge.
        assert node.pos + node.length - len(path) >= 0
        assert list(node.seq[node.pos + node.length - len(path) : node.pos + node.length]) == path
        if any(node.seq is gone for gone in removed):  # only while the tree counts it in its memory
            assert any(ref() is node.seq for ref in tree._remnants), "a removed sequence's array read, not counted"
        for child in node.children.values():
            paths[id(child)] = path + list(child.seq[child.pos : child.pos + child.length])
        assert node.count == node.ends + sum(c.count for c in node.children.values())
        for token, child in node.children.items():
            assert child.parent is node and child.token == token == child.edge_token(0)
            assert child.length >= 1 and child.count >= 1
            # A unary node through which every string goes on is merged with its child (compact paths).
            assert not (child.ends == 0 and len(child.children) == 1), "unary node left unmerged"
        stack.extend(node.children.values())
    assert seen == tree.num_nodes
    assert tree.num_tokens == sum(len(s.tokens) for s in tree.sequences.values())


def check_against(tree: SuffixTree, ref: Reference, removed: list[array] = ()) -> None:
    check_structure(tree, removed)
    for pattern in ref.substrings():
        found = tree.find(list(pattern))
        assert found is not None, pattern
        node, offset = found
        assert node.count == ref.count(list(pattern)), pattern
        if offset < node.length:  # inside an edge: one way on, with the same count
            assert ref.next_counts(list(pattern)) == {node.edge_token(offset): node.count}
    for key, seq in ref.seqs.items():
        ends = list(tree.active_ends(key))
        assert len(ends) == min(len(seq), tree.max_depth - 1)
        for i, node in enumerate(ends):  # the end node of the suffix of length len(ends) - i
            assert tree.find(seq[len(seq) - (len(ends) - i) :]) == (node, node.length)


operations = st.lists(
    st.one_of(
        st.tuples(st.just("extend"), st.integers(0, 3), st.lists(st.integers(0, ALPHABET - 1), min_size=1, max_size=7)),
        st.tuples(st.just("remove"), st.integers(0, 3), st.just([])),
    ),
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(depth=st.integers(2, 7), ops=operations)
def test_counts_and_active_ends_match_the_reference(depth, ops):
    tree, ref = SuffixTree(depth), Reference(depth)
    removed = []
    for op, key, tokens in ops:
        if op == "extend":
            tree.extend(key, tokens)
            ref.seqs.setdefault(key, []).extend(tokens)
        elif key in ref.seqs:
            removed.append(tree.tokens(key))
            tree.remove(key)
            del ref.seqs[key]
        check_against(tree, ref, removed)
    for key in list(ref.seqs):
        tree.remove(key)
    assert tree.num_nodes == 1 and tree.num_tokens == 0 and tree.root.count == 0 and not tree.root.children


def build(depth: int, seqs: list[list[int]]) -> tuple[SuffixTree, Reference]:
    tree, ref = SuffixTree(depth), Reference(depth)
    for key, seq in enumerate(seqs):
        tree.extend(key, seq)
        ref.seqs[key] = list(seq)
    return tree, ref


def located(tree: SuffixTree, pattern: list[int]) -> tuple[Node, int]:
    found = tree.find(pattern)
    assert found is not None
    return found


texts = st.lists(st.lists(st.integers(0, ALPHABET - 1), min_size=1, max_size=30), min_size=1, max_size=4)
# A tree over random texts and one of their substrings, where the continuations are read.
scenarios = st.tuples(st.integers(2, 10), texts, st.randoms(use_true_random=False))


def scenario(drawn) -> tuple[SuffixTree, Reference, list[int], Node, int]:
    depth, seqs, pick = drawn
    tree, ref = build(depth, seqs)
    pattern = list(pick.choice(sorted(ref.substrings())))
    return tree, ref, pattern, *located(tree, pattern)


@settings(max_examples=300, deadline=None)
@given(drawn=scenarios, max_tokens=st.integers(0, 12), min_prob=st.sampled_from([0.0, 0.2, 0.5, 0.9]))
def test_best_chain_is_the_most_frequent_continuation(drawn, max_tokens, min_prob):
    tree, ref, pattern, node, offset = scenario(drawn)
    chain = tree.best_chain(node, offset, max_tokens, min_prob)
    assert chain.parents == list(range(-1, len(chain.token_ids) - 1))
    context, prob = list(pattern), 1.0
    for token, token_prob in zip(chain.token_ids, chain.probs, strict=True):
        counts = ref.next_counts(context)
        assert counts.get(token, 0) == max(counts.values()), "not the most frequent continuation"
        prob *= counts[token] / ref.count(context)
        assert abs(token_prob - prob) < 1e-9 and prob >= min_prob
        context.append(token)
    # It stops only at max_tokens, where nothing follows, or where the path's probability would fall too low.
    counts = ref.next_counts(context)
    if len(chain.token_ids) < max_tokens and counts:
        # the path's probability as the loop above multiplies it (at a tie, (p * 3) / 5 and p * (3 / 5) differ)
        assert prob * (max(counts.values()) / ref.count(context)) < min_prob
    assert abs(chain.score - sum(chain.probs)) < 1e-9


@settings(max_examples=300, deadline=None)
@given(
    drawn=scenarios,
    max_nodes=st.integers(0, 20),
    min_prob=st.sampled_from([0.0, 0.1, 0.3]),
    max_depth=st.sampled_from([None, 1, 2, 4]),
)
def test_best_tree_holds_the_most_probable_continuations(drawn, max_nodes, min_prob, max_depth):
    tree, ref, pattern, node, offset = scenario(drawn)
    result = tree.best_tree(node, offset, max_nodes, min_prob, max_depth)
    paths: list[list[int]] = []
    for token, parent, prob in zip(result.token_ids, result.parents, result.probs, strict=True):
        assert -1 <= parent < len(paths), "a node comes after its parent"
        prefix = paths[parent] if parent >= 0 else []
        path = [*prefix, token]
        assert path not in paths, "two nodes for the same continuation"
        paths.append(path)
        # The continuation occurs after the pattern, with the empirical probability of its path.
        assert ref.count(pattern + path) > 0
        assert abs(prob - ref.count(pattern + path) / ref.count(pattern)) < 1e-9
        assert prob >= min_prob
    # Best first: every eligible continuation more probable than the least probable node taken is taken.
    eligible = {}
    frontier: list[list[int]] = [[]]
    while frontier:
        path = frontier.pop()
        for token in ref.next_counts(pattern + path):
            longer = [*path, token]
            prob = ref.count(pattern + longer) / ref.count(pattern)
            if prob >= min_prob and (max_depth is None or len(longer) <= max_depth):
                eligible[tuple(longer)] = prob
                frontier.append(longer)
    taken = {tuple(p) for p in paths}
    assert taken <= set(eligible)
    if len(paths) < max_nodes:
        assert taken == set(eligible)
    elif paths:
        least = min(result.probs)
        assert all(path in taken for path, prob in eligible.items() if prob > least + 1e-9)


def test_a_repeated_text_keeps_its_edges_long():
    """A second, third copy of a text adds counts, not nodes: the tree stays about one node per token."""
    rng = random.Random(0)
    text = [rng.randrange(1000) for _ in range(500)]
    tree = SuffixTree(24)
    tree.extend("a", text)
    nodes = tree.num_nodes
    for key in "bc":
        for i in range(0, len(text), 3):  # in steps of a few tokens, as an engine commits them
            tree.extend(key, text[i : i + 3])
    assert tree.num_nodes <= nodes * 1.05
    assert nodes < 2 * len(text)


def test_memory_estimate_is_close_to_what_python_allocates():
    rng = random.Random(1)
    words = [int(rng.paretovariate(1.0)) % 2000 for _ in range(20_000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tree = SuffixTree(24)
        for i in range(0, len(words), 250):
            tree.extend(i, words[i : i + 250])
        allocated = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.7 < tree.memory_bytes() / allocated < 1.3, (tree.memory_bytes(), allocated)


def nodes_of(tree: SuffixTree) -> list[Node]:
    stack, nodes = [tree.root], []
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    return nodes


def test_an_evicted_request_whose_text_lives_on_is_kept_at_most_once_and_counted():
    """Evicting a request whose output another repeats: the nodes its strings share go on reading its array (a
    copy per node cost 50 times the array), and the tree's memory estimate counts it until they stop."""
    rng = random.Random(0)
    text = [rng.randrange(50_000) for _ in range(2000)]
    tree = SuffixTree(32)
    tree.extend("a", text)
    tree.extend("b", text)
    first = tree.tokens("a")
    tree.remove("a")
    arrays = {id(node.seq) for node in nodes_of(tree)[1:]}
    assert arrays <= {id(first), id(tree.tokens("b"))}
    del first  # the test's own reference
    assert tree.memory_bytes() == tree.num_nodes * NODE_BYTES + (2000 + 2000) * TOKEN_BYTES
    tree.remove("b")
    assert tree.memory_bytes() == NODE_BYTES and tree.remnant_tokens() == 0


def test_an_evicted_request_that_shares_a_little_keeps_only_that_little():
    """A long request evicted while a short one repeats its last 40 tokens: the nodes those strings share read a
    copy of what their paths need, not the long request's whole array."""
    rng = random.Random(1)
    long = [rng.randrange(50_000) for _ in range(5000)]
    tree = SuffixTree(32)
    tree.extend("long", long)
    tree.extend("short", long[-40:])
    tree.remove("long")
    short = tree.tokens("short")
    others = {id(node.seq): node.seq for node in nodes_of(tree)[1:] if node.seq is not short}
    assert 0 < sum(len(a) for a in others.values()) == tree.remnant_tokens() <= 40 + 32
    assert tree.memory_bytes() == tree.num_nodes * NODE_BYTES + (40 + tree.remnant_tokens()) * TOKEN_BYTES
    check_structure(tree)


def test_a_continuation_seen_exactly_min_prob_of_the_time_is_in_the_tree():
    """Hypothesis found it: after [0], (0, 0, 0, 1) follows 1 time in 10. As a product along its path
    (0.6 * 1/6) that was 0.0999..., under min_prob = 0.1, and the tree left it out with room to spare."""
    tree, ref = build(5, [[0], [0, 0, 0, 0, 0, 0, 0, 0, 0, 1]])
    result = tree.best_tree(*located(tree, [0]), 20, 0.1, None)
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(result.token_ids, result.parents, strict=True):
        paths.append((*(paths[parent] if parent >= 0 else ()), token))
    assert ref.count([0, 0, 0, 0, 1]) / ref.count([0]) == 0.1
    assert (0, 0, 0, 1) in paths and len(paths) < 20
