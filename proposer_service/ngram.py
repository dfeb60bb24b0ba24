"""Prompt-lookup drafting: propose what followed the latest earlier occurrence of the last n tokens.

No model: it pays off when the output quotes its input (code edits, summaries with citations). An index
from each n-gram to where it last ended is kept per sequence and extended as tokens are committed, so a
lookup costs O(n) rather than a scan of the sequence. When the verifier takes a token tree, the continuations
of the suffix's matches of every length that differ become branches (a trie of them, longest match first).

A sequence with a format (structured output) gets only the run's prefix its grammar allows
(proposer_service/draft_grammar.py), then the tokens the format forces after it (JSON keys and punctuation),
up to k.
"""

from __future__ import annotations

from proposer_service.draft_grammar import DraftGrammar
from shared.drafting import Draft, DraftRequest, SequenceHistory
from shared.grammar import GrammarCompiler


class NgramDrafter:
    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, grammar: GrammarCompiler | None = None) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.history = SequenceHistory()
        # per sequence: n -> {ngram: end of its latest occurrence}, covering ends < indexed_len
        self.index: dict[str, dict[int, dict[tuple[int, ...], int]]] = {}
        self.indexed_len: dict[str, int] = {}
        self.grammar = DraftGrammar(grammar)  # without a compiler, sequences with a format are not drafted

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [self._propose_one(req) for req in requests]

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self.history.release(seq_id)
            self.index.pop(seq_id, None)
            self.indexed_len.pop(seq_id, None)
            self.grammar.release(seq_id)

    def _propose_one(self, req: DraftRequest) -> Draft:
        tokens = self.history.apply(req)
        if tokens is None:
            return Draft(req.seq_id, req.committed_len, [], needs_resync=True)
        self._extend_index(req.seq_id, tokens, rewritten_from=req.committed_len - len(req.new_token_ids))
        may_draft, matcher = self.grammar.update(req, tokens)
        if may_draft and matcher is None and req.max_tree_nodes > 0:
            branches = self.continuations(req.seq_id, tokens, req.k)
            if len(branches) > 1:
                nodes, parents = trie(branches, req.max_tree_nodes)
                return Draft(req.seq_id, req.committed_len, nodes, parents=parents)
        run = self.lookup(req.seq_id, tokens, req.k) if may_draft else []
        if matcher is not None and req.k > 0:
            run = run[: matcher.num_valid(run)]
            if len(run) < req.k:  # what the format forces next (keys, punctuation) is accepted for sure
                run += matcher.forced_after(run)[: req.k - len(run)]
        return Draft(req.seq_id, req.committed_len, run)

    def lookup(self, seq_id: str, tokens: list[int], k: int) -> list[int]:
        branches = self.continuations(seq_id, tokens, k)
        return branches[0] if branches else []

    def continuations(self, seq_id: str, tokens: list[int], k: int) -> list[list[int]]:
        """What followed the latest earlier occurrence of the last n tokens, for each n (longest first) that has
        one, at most k tokens each, without repeats."""
        if k <= 0:
            return []
        index = self.index[seq_id]
        found: list[list[int]] = []
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            end = index[n].get(tuple(tokens[-n:]))
            if end is not None and tokens[end : end + k] not in found:
                found.append(tokens[end : end + k])
        return found

    def _extend_index(self, seq_id: str, tokens: list[int], rewritten_from: int) -> None:
        # The suffix itself (ending at len(tokens)) is left out so a lookup finds an earlier occurrence.
        start = self.indexed_len.get(seq_id, 0)
        if seq_id not in self.index or rewritten_from < start:  # new, or a resync replaced indexed tokens
            self.index[seq_id] = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}
            start = 0
        index = self.index[seq_id]
        for end in range(max(start, 1), len(tokens)):
            for n, table in index.items():
                if end >= n:
                    table[tuple(tokens[end - n : end])] = end
        self.indexed_len[seq_id] = len(tokens)


def trie(branches: list[list[int]], max_nodes: int) -> tuple[list[int], list[int]]:
    """The branches merged on their common prefixes, in order, as (node tokens, parents): nodes in topological
    order, at most max_nodes of them."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for branch in branches:
        parent = -1
        for token in branch:
            node = children.get((parent, token))
            if node is None:
                if len(tokens) == max_nodes:
                    break
                node = children[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = node
    return tokens, parents
