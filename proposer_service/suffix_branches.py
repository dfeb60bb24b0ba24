"""A model drafter's guesses joined by the sequence's own text: suffix decoding's continuation (suffix.py) of the
request's prompt and output so far, added to the model's token tree as a branch, or sent in place of its greedy
chain where the text is surer.

Why: a small target copies. It restates its prompt, repeats its own phrases and list patterns, and those runs are
where a one-layer head guesses worst (it sees one position's features; the text has the whole run). On the 54
held-out prompts (`python -m specdec_train.evaluate --suffix-branches`, committed head, 64 tokens, greedy, depth
4) trees of at most 8 nodes went from 2.31 to 2.44 tokens a verify step with these branches, and chains of 4 from
1.92 to 2.03 (docs/BENCHMARKS.md, "The request's own text beside the head").

Only the request's own text is read: no tenant's earlier answers (the suffix kind's `--suffix-cache-tokens`),
so a request drafts nothing another request wrote, and a benchmark that repeats its prompts measures no memory.

- **Trees.** The continuation (at most k tokens, cut where its empirical path probability falls below the
  request's node price, `min_node_prob`) is reserved from the node budget before the model drafts (so the merged
  tree stays within `max_tree_nodes`, the rows the verifier priced), then walked into the model's tree: a token a
  node already has as a child is shared, the rest become new children, listed after the model's own, so the
  model's best-guess path (each node's first child: what the verifier's acceptance estimate reads) is unchanged.
  Nodes are deterministic guesses either way, verified exactly for greedy and sampled requests alike
  (verifier_service/tree_verify.py).
- **Chains** (greedy requests; the verifier asked for no tree): the continuation replaces the model's chain when
  its score (the sum of its path probabilities: the tokens the history's frequencies expect accepted) is at least
  half of k (CHAIN_SHARE). A sampled chain carries the model's distributions, which the verifier's ratio test
  uses, and a seeded one follows the target's noise: both are left as they are, as are drafts under a format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from proposer_service.suffix import SuffixDrafter
from proposer_service.suffix_tree import Continuation
from shared.drafting import Draft, DraftRequest

# A greedy chain of k is swapped for the text's where the text expects at least this share of its k tokens
# accepted. On the held-out prompts (committed head, greedy, tokens a verify step, none / thresholds on the score):
# k = 2: 1.758 / 1.769 at 0.5, 1.821 at 1.0, 1.761 at 1.5; k = 3: 1.874 / 1.889, 1.952, 1.970 at 1.5, 1.901 at 2.0;
# k = 4: 1.923 / 2.018 at 1.0, 2.030 at 2.0. The best was k / 2 at every k.
CHAIN_SHARE = 0.5


@dataclass
class BranchStats:
    """What the branches did, for the proposer's metrics."""

    tree_tokens: int = 0  # nodes added to models' trees
    trees: int = 0  # trees that got at least one
    chains: int = 0  # greedy chains replaced by the text's


class SuffixBranches:
    def __init__(self, max_depth: int = 32, min_token_prob: float = 0.1) -> None:
        # No tenant memory (a budget of 0 tokens): the request's own prompt and output only.
        self.suffix = SuffixDrafter(cache_tokens=0, max_depth=max_depth, min_token_prob=min_token_prob)
        self.stats = BranchStats()

    def propose(self, requests: list[DraftRequest], draft: Callable[[list[DraftRequest]], list[Draft]]) -> list[Draft]:
        """`draft` (the model's round) for the requests, each tree given room for its continuation and joined by
        it, each greedy chain swapped where the continuation is surer."""
        texts = [self._follow(req) for req in requests]
        drafts = draft([self._with_room(req, text) for req, text in zip(requests, texts, strict=True)])
        return [self._joined(req, text, d) for req, text, d in zip(requests, texts, drafts, strict=True)]

    def release(self, seq_ids: list[str]) -> None:
        self.suffix.release(seq_ids)

    def _follow(self, req: DraftRequest) -> list[int]:
        """The continuation worth sending for this request (empty: none), the suffix trees brought up to date."""
        text = self.suffix.follow(req)  # empty for k = 0 and formats
        if text is None or not text.token_ids or req.params.seed is not None:
            return []
        if req.max_tree_nodes > 0:
            return _priced(text, req.min_node_prob)[: max(0, req.max_tree_nodes - req.k)]
        if req.params.is_greedy and text.score >= CHAIN_SHARE * req.k:
            return text.token_ids
        return []

    @staticmethod
    def _with_room(req: DraftRequest, text: list[int]) -> DraftRequest:
        """A tree request with room for the continuation's nodes (at most max_tree_nodes - k: the model keeps
        room for a whole path)."""
        if not text or req.max_tree_nodes <= 0:
            return req
        return replace(req, max_tree_nodes=req.max_tree_nodes - len(text))

    def _joined(self, req: DraftRequest, text: list[int], draft: Draft) -> Draft:
        if not text or draft.needs_resync or draft.unreachable or draft.probs is not None:
            return draft
        if draft.parents is None:
            if req.max_tree_nodes > 0:  # the model sent a chain for a tree (no cache room): it goes as sent
                return draft
            self.stats.chains += 1
            return Draft(draft.seq_id, draft.committed_len, text)
        tokens, parents = list(draft.token_ids), list(draft.parents)
        added = join(tokens, parents, text)
        if not added:
            return draft
        self.stats.trees += 1
        self.stats.tree_tokens += added
        return replace(draft, token_ids=tokens, parents=parents)


def join(tokens: list[int], parents: list[int], path: list[int]) -> int:
    """Walk `path` down the tree (tokens, parents: topological), sharing each token a node already has as a child
    and appending the rest (after every node there is, so the order stays topological and each node's first child
    stays first); the nodes added."""
    node, added = -1, 0
    for token in path:
        child = next((i for i in range(node + 1, len(tokens)) if parents[i] == node and tokens[i] == token), None)
        if child is None:
            tokens.append(token)
            parents.append(node)
            child = len(tokens) - 1
            added += 1
        node = child
    return added


def _priced(text: Continuation, min_prob: float) -> list[int]:
    """The continuation's tokens up to the first whose path probability is below the node price."""
    kept = 0
    while kept < len(text.token_ids) and text.probs[kept] >= min_prob:
        kept += 1
    return text.token_ids[:kept]
