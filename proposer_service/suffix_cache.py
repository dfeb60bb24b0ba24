"""The global side of suffix decoding: one suffix tree per tenant over its requests' outputs, under one token
budget for all tenants.

A tenant is the API key's name the request came with ('' = anonymous): a tenant's tree only ever drafts for
that tenant, so one key's text never reaches another's requests. Requests are evicted whole, least recently
written first (a request is written while it runs: its output grows), until the stored tokens fit the budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from proposer_service.suffix_tree import SuffixTree


class SuffixCache:
    def __init__(self, budget_tokens: int, max_depth: int) -> None:
        if budget_tokens < 0:
            raise ValueError(f"the cache budget must be >= 0 tokens, got {budget_tokens}")
        self.budget_tokens = budget_tokens
        self.max_depth = max_depth
        self.trees: dict[str, SuffixTree] = {}
        self._lru: OrderedDict[int, str] = OrderedDict()  # request key -> tenant, least recently written first
        self.num_tokens = 0
        self.evicted_requests = 0

    def __len__(self) -> int:
        return len(self._lru)

    def tree(self, tenant: str) -> SuffixTree | None:
        return self.trees.get(tenant)

    def holds(self, tenant: str, key: int) -> bool:
        return self._lru.get(key) == tenant

    def extend(self, tenant: str, key: int, tokens: Sequence[int]) -> bool:
        """Add `tokens` to request `key` (new or held) in its tenant's tree, evicting other requests to make room.
        False, and the request is dropped, when it cannot fit even alone."""
        if not tokens:
            return self.holds(tenant, key)
        held = len(self.trees[tenant].tokens(key)) if self.holds(tenant, key) else 0
        if held + len(tokens) > self.budget_tokens:
            self.remove(key)
            return False
        while self.num_tokens + len(tokens) > self.budget_tokens:
            oldest = next(k for k in self._lru if k != key)
            self.remove(oldest)
            self.evicted_requests += 1
        tree = self.trees.get(tenant)
        if tree is None:
            tree = self.trees[tenant] = SuffixTree(self.max_depth)
        tree.extend(key, tokens)
        self.num_tokens += len(tokens)
        self._lru[key] = tenant
        self._lru.move_to_end(key)
        return True

    def remove(self, key: int) -> None:
        tenant = self._lru.pop(key, None)
        if tenant is None:
            return
        tree = self.trees[tenant]
        self.num_tokens -= len(tree.tokens(key))
        tree.remove(key)
        if not tree.sequences:
            del self.trees[tenant]

    # Read by the metrics exporter's thread while the drafter's adds and drops tenants' trees: a snapshot of the
    # dict's values (one call, under the GIL), not an iteration a new tenant would break off.
    @property
    def num_nodes(self) -> int:
        return sum(t.num_nodes for t in list(self.trees.values()))

    def memory_bytes(self) -> int:
        return sum(t.memory_bytes() for t in list(self.trees.values()))
