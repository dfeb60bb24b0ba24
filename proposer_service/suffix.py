"""Suffix decoding (Oliaro et al., "SuffixDecoding", NeurIPS 2025; Snowflake's Arctic Inference): drafts what
followed the sequence's latest tokens, in its own text or in earlier answers, as often as it followed.

Two suffix trees per request (proposer_service/suffix_tree.py): its own, over its prompt and output so far, and
its tenant's global tree (proposer_service/suffix_cache.py), over the outputs of that tenant's requests, this
one's included. Each output enters the global tree preceded by the last `prompt_context` tokens of its prompt,
so that the same question matches its earlier answer from the first token on; it enters as it is committed, not
at release, so requests running side by side already draft from each other.

Drafting needs no search: the end nodes of a sequence's growing strings in a tree are the matches of all its
suffixes (lengths 1 .. max_depth - 1). For each match of length m, the most frequent continuation is followed
while the path's empirical probability (the product of child.count / node.count) stays >= min_token_prob, at
most min(k, m * max_spec_factor + max_spec_offset) tokens (defaults 2 and -1: 1, 3, 5 ... tokens for matches of
1, 2, 3 ...): a short match earns a short draft. What followed one or two tokens is accepted far less often
than its count ratio says (5-25 % and ~33 % in general chat, ~50 % and ~70 % in quoting, on the benchmark's
greedy outputs); the defaults were chosen by replaying those outputs through the drafter with the CPU's cost
of a scored token (best on quoting prompts, within 3 % of the best on general ones). The candidate with the highest
score (the sum of its path probabilities: the tokens the target is expected to accept) wins, from either tree;
none when nothing followed. Drafts are one-hot (deterministic), verified as n-gram drafts are.

When the verifier takes a token tree (`DraftRequest.max_tree_nodes` > 0), the best match's continuations are
taken best first by path probability (`SuffixTree.best_tree`) while it stays >= min_token_prob: at most
max_tree_nodes nodes (the verifier's policy weighs their scoring cost), none deeper than the chain would go
(min(k, m * max_spec_factor + max_spec_offset): how far the match is trusted). One that does not branch goes as
a chain.

A sequence with a format gets only the part of its draft the format allows, then what the format forces
(proposer_service/draft_grammar.py), as with the n-gram drafter.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

from proposer_service.draft_grammar import DraftGrammar
from proposer_service.suffix_cache import SuffixCache
from proposer_service.suffix_tree import EMPTY, Continuation, Node, SuffixTree
from shared.drafting import Draft, DraftRequest
from shared.grammar import GrammarCompiler

LOCAL, GLOBAL = "local", "global"


@dataclass
class SuffixStats:
    """What the drafter did, for the proposer's metrics (proposer_service/suffix_telemetry.py)."""

    proposals: int = 0  # sequences asked for a draft (k > 0)
    drafts: dict[str, int] = field(default_factory=lambda: {LOCAL: 0, GLOBAL: 0})  # by the tree that won
    draft_tokens: dict[str, int] = field(default_factory=lambda: {LOCAL: 0, GLOBAL: 0})
    draft_lengths: dict[int, int] = field(default_factory=dict)  # length -> drafts (0: asked, nothing drafted)
    tree_drafts: int = 0  # drafts sent as token trees (that branch); their length is their node count

    def record(self, source: str | None, length: int, tree: bool = False) -> None:
        self.proposals += 1
        self.draft_lengths[length] = self.draft_lengths.get(length, 0) + 1
        if source is not None and length:
            self.drafts[source] += 1
            self.draft_tokens[source] += length
            self.tree_drafts += tree


@dataclass
class _Request:
    tenant: str
    key: int  # unique per request: seq ids may be reused after a release, global tree entries outlive them
    local: SuffixTree
    output_start: int | None = None  # first output position, known from the first request that drafts
    cached: bool = False  # its text is in its tenant's global tree

    @property
    def tokens(self) -> array:
        return self.local.tokens(0) if 0 in self.local else array("i")


class SuffixDrafter:
    def __init__(
        self,
        cache_tokens: int = 1_000_000,
        max_depth: int = 32,
        max_spec_factor: float = 2.0,
        max_spec_offset: float = -1.0,
        min_token_prob: float = 0.1,
        prompt_context: int | None = None,
        grammar: GrammarCompiler | None = None,
    ) -> None:
        if max_spec_factor <= 0 or not 0 <= min_token_prob <= 1:
            raise ValueError(
                f"need max_spec_factor > 0 and 0 <= min_token_prob <= 1, got {max_spec_factor}, {min_token_prob}"
            )
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        self.min_token_prob = min_token_prob
        self.prompt_context = max_depth if prompt_context is None else prompt_context
        self.cache = SuffixCache(cache_tokens, max_depth)
        self.requests: dict[str, _Request] = {}
        self._keys = itertools.count()
        self.grammar = DraftGrammar(grammar)  # without a compiler, sequences with a format are not drafted
        self.stats = SuffixStats()

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [self._propose_one(req) for req in requests]

    def release(self, seq_ids: list[str]) -> None:
        """The request's own tree goes; its output stays in the global tree, an earlier answer now."""
        for seq_id in seq_ids:
            self.requests.pop(seq_id, None)
            self.grammar.release(seq_id)

    def _propose_one(self, req: DraftRequest) -> Draft:
        state = self._update(req)
        if state is None:
            return Draft(req.seq_id, req.committed_len, [], needs_resync=True)
        constrained = req.params.structured_output is not None
        may_draft, matcher = self.grammar.update(req, state.tokens.tolist() if constrained else [])
        if req.k <= 0:
            return Draft(req.seq_id, req.committed_len, [])
        tree_nodes = req.max_tree_nodes if matcher is None else 0  # a format drafts a chain, as with n-gram
        source, best = self._best(state, req.k, tree_nodes) if may_draft else (None, EMPTY)
        run, parents = best.token_ids, best.parents
        is_tree = any(parent != i - 1 for i, parent in enumerate(parents))
        self.stats.record(source, len(run), is_tree)
        if is_tree:
            return Draft(req.seq_id, req.committed_len, run, parents=parents)
        if matcher is not None:
            run = run[: matcher.num_valid(run)]
            if len(run) < req.k:  # what the format forces next (keys, punctuation) is accepted for sure
                run += matcher.forced_after(run)[: req.k - len(run)]
        return Draft(req.seq_id, req.committed_len, run)

    def follow(self, req: DraftRequest) -> Continuation | None:
        """Apply the request's committed tokens and return the best chain of at most `req.k` tokens that followed
        the sequence's latest ones, with its path probabilities (EMPTY: none, or a format: this drafter's chains
        then come from `propose`); None when the delta does not fit what is held. For a drafter that uses this one
        beside its own (proposer_service/suffix_branches.py)."""
        state = self._update(req)
        if state is None:
            return None
        if req.k <= 0 or req.params.structured_output is not None:
            return EMPTY
        return self._best(state, req.k, 0)[1]

    # ---- following the committed tokens --------------------------------------------------------

    def _update(self, req: DraftRequest) -> _Request | None:
        """Apply the request's delta to the sequence's trees; None when it does not fit what we hold."""
        state = self.requests.get(req.seq_id)
        start = req.committed_len - len(req.new_token_ids)
        held = state.tokens if state is not None else array("i")
        if start < 0 or start > len(held):
            return None
        new = list(req.new_token_ids)
        overlap = held[start:].tolist()  # usually empty: the verifier sends only what we lack
        if state is None or state.tenant != req.tenant or new[: len(overlap)] != overlap:
            # New, or committed tokens were rewritten (never by our verifier): start this sequence over.
            if state is not None:
                self.cache.remove(state.key)
            new, overlap = held[:start].tolist() + new, []
            state = self.requests[req.seq_id] = _Request(req.tenant, next(self._keys), SuffixTree(self.max_depth))
        added = new[len(overlap) :]
        state.local.extend(0, added)
        if state.output_start is None and req.k > 0:
            # The first request that drafts knows where the output starts: every later one is decoding.
            state.output_start = min(max(0, req.committed_len - req.draft_position), req.committed_len)
            added = state.tokens[max(0, state.output_start - self.prompt_context) :].tolist()
            state.cached = self.cache.extend(state.tenant, state.key, added)
        elif state.cached:
            # Once evicted (by other requests' text, or too long for the budget) it stays out: added again from
            # here it would be a fragment without its start, and would push out whole answers.
            still_held = self.cache.holds(state.tenant, state.key)
            state.cached = still_held and self.cache.extend(state.tenant, state.key, added)
        return state

    # ---- drafting ------------------------------------------------------------------------------

    def continuation(self, seq_id: str, k: int, tree_nodes: int = 0) -> tuple[str | None, Continuation]:
        """What `propose` would draft for a sequence this drafter follows, as of its last request, and the tree it
        came from: the best chain of at most k tokens, or with tree_nodes > 0 a token tree (tokens in topological
        order and each one's parent index, -1 for the match)."""
        state = self.requests.get(seq_id)
        return (None, EMPTY) if state is None else self._best(state, k, tree_nodes)

    def _best(self, state: _Request, k: int, tree_nodes: int) -> tuple[str | None, Continuation]:
        """The best chain over both trees' matches; with tree_nodes > 0, the best match's most probable
        continuations as a tree of at most tree_nodes nodes, none deeper than its chain may go."""
        best, source, where = EMPTY, None, None
        for name, tree, ends in self._matches(state):
            candidate, match = self._best_continuation(tree, ends, k, best.score)
            if candidate.score > best.score and match is not None:
                best, source, where = candidate, name, (tree, *match)
        if tree_nodes > 0 and where is not None:
            tree, node, offset, max_tokens = where
            best = tree.best_tree(node, offset, tree_nodes, self.min_token_prob, max_tokens)
        return source, best

    def _matches(self, state: _Request) -> Iterable[tuple[str, SuffixTree, list[tuple[Node, int, int]]]]:
        """Per tree, the matches of the sequence's suffixes: (node, offset in its edge, match length)."""
        local = state.local
        if 0 in local:
            yield LOCAL, local, _active_matches(local, 0)
        tree = self.cache.tree(state.tenant)
        if tree is None:
            return
        if self.cache.holds(state.tenant, state.key):
            yield GLOBAL, tree, _active_matches(tree, state.key)
        else:  # not (or no more) in its tenant's tree: find its suffixes from the root, longest last
            tokens = state.tokens
            matches = []
            for m in range(1, min(self.max_depth, len(tokens) + 1)):
                found = tree.find(tokens[len(tokens) - m :])
                if found is None:
                    break  # a longer suffix cannot occur where this one does not
                matches.append((*found, m))
            yield GLOBAL, tree, matches[::-1]

    def _best_continuation(
        self, tree: SuffixTree, matches: list[tuple[Node, int, int]], k: int, to_beat: float
    ) -> tuple[Continuation, tuple[Node, int, int] | None]:
        """The best chain over the matches and where it starts (node, offset, the chain's length bound there).
        Longest matches first; a shorter one wins only with a strictly higher score."""
        best: tuple[Continuation, tuple[Node, int, int] | None] = (EMPTY, None)
        for node, offset, length in matches:
            max_tokens = min(k, int(length * self.max_spec_factor + self.max_spec_offset + 1e-6))
            if max_tokens <= 0 or (offset == node.length and not node.children):
                continue
            # No path from here scores more than max_tokens times its first step's probability.
            first = 1.0 if offset < node.length else max(c.count for c in node.children.values()) / node.count
            if max_tokens * first <= max(best[0].score, to_beat):
                continue
            candidate = tree.best_chain(node, offset, max_tokens, self.min_token_prob)
            if candidate.score > best[0].score:
                best = (candidate, (node, offset, max_tokens))
        return best


def _active_matches(tree: SuffixTree, key: int) -> list[tuple[Node, int, int]]:
    ends = tree.active_ends(key)
    return [(node, node.length, len(ends) - i) for i, node in enumerate(ends)]
