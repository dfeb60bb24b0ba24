"""The suffix drafter's metrics: how often a draft came from the request's own text or from earlier answers,
how long drafts were, and how much the trees hold. Read from the drafter's own counters at collection time
(observable instruments), so they cost nothing per step."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation

from proposer_service.suffix import GLOBAL, LOCAL, SuffixDrafter


def register_suffix_metrics(meter: Any, drafter: SuffixDrafter) -> None:
    stats, cache = drafter.stats, drafter.cache

    def local_trees() -> list:
        return [r.local for r in list(drafter.requests.values())]

    def per_tree(read_global: Callable[[], float], read_local: Callable[[], float]):
        def callback(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(read_global(), {"tree": GLOBAL}), Observation(read_local(), {"tree": LOCAL})]

        return callback

    def by_tree(counts: dict[str, int]):
        return lambda _options: [Observation(counts[tree], {"tree": tree}) for tree in (LOCAL, GLOBAL)]

    metrics = [  # (name, instrument, unit, description, callback)
        (
            "specdec_proposer_suffix_proposals",
            "counter",
            "{sequence}",
            "sequences asked for a draft (k > 0)",
            lambda _o: [Observation(stats.proposals)],
        ),
        (
            "specdec_proposer_suffix_drafts",
            "counter",
            "{draft}",
            "drafts made, by the tree they came from: the request's own text (local) or its tenant's "
            "earlier outputs (global); proposals without a draft found no continuation",
            by_tree(stats.drafts),
        ),
        (
            "specdec_proposer_suffix_draft_tokens",
            "counter",
            "{token}",
            "draft tokens proposed, by the tree they came from",
            by_tree(stats.draft_tokens),
        ),
        (
            "specdec_proposer_suffix_tree_drafts",
            "counter",
            "{draft}",
            "drafts sent as token trees (where the verifier takes trees and the continuations branch)",
            lambda _o: [Observation(stats.tree_drafts)],
        ),
        (
            "specdec_proposer_suffix_drafts_by_length",
            "counter",
            "{draft}",
            "proposals by the length of their draft, a tree's by its nodes (0: nothing drafted)",
            lambda _o: [
                Observation(n, {"length": str(length)}) for length, n in sorted(list(stats.draft_lengths.items()))
            ],
        ),
        (
            "specdec_proposer_suffix_tree_tokens",
            "gauge",
            "{token}",
            "tokens indexed: global trees (earlier outputs, within --suffix-cache-tokens), local trees "
            "(running requests' prompts and outputs)",
            per_tree(lambda: cache.num_tokens, lambda: sum(t.num_tokens for t in local_trees())),
        ),
        (
            "specdec_proposer_suffix_tree_nodes",
            "gauge",
            "{node}",
            "suffix tree nodes",
            per_tree(lambda: cache.num_nodes, lambda: sum(t.num_nodes for t in local_trees())),
        ),
        (
            "specdec_proposer_suffix_tree_memory_bytes",
            "gauge",
            "By",
            "estimated memory of the trees (nodes and token arrays)",
            per_tree(cache.memory_bytes, lambda: sum(t.memory_bytes() for t in local_trees())),
        ),
        (
            "specdec_proposer_suffix_cached_requests",
            "gauge",
            "{request}",
            "requests whose output the global trees hold",
            lambda _o: [Observation(len(cache))],
        ),
        (
            "specdec_proposer_suffix_evicted_requests",
            "counter",
            "{request}",
            "requests evicted from the global trees to keep --suffix-cache-tokens",
            lambda _o: [Observation(cache.evicted_requests)],
        ),
    ]
    for name, instrument, unit, description, callback in metrics:
        create = meter.create_observable_counter if instrument == "counter" else meter.create_observable_gauge
        create(name, [callback], unit=unit, description=description)
