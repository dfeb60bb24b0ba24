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

    meter.create_observable_counter(
        "specdec_proposer_suffix_proposals",
        [lambda _o: [Observation(stats.proposals)]],
        unit="{sequence}",
        description="sequences asked for a draft (k > 0)",
    )
    meter.create_observable_counter(
        "specdec_proposer_suffix_drafts",
        [by_tree(stats.drafts)],
        unit="{draft}",
        description="drafts made, by the tree they came from: the request's own text (local) or its tenant's "
        "earlier outputs (global); proposals without a draft found no continuation",
    )
    meter.create_observable_counter(
        "specdec_proposer_suffix_draft_tokens",
        [by_tree(stats.draft_tokens)],
        unit="{token}",
        description="draft tokens proposed, by the tree they came from",
    )
    meter.create_observable_counter(
        "specdec_proposer_suffix_drafts_by_length",
        [
            lambda _o: [
                Observation(n, {"length": str(length)}) for length, n in sorted(list(stats.draft_lengths.items()))
            ]
        ],
        unit="{draft}",
        description="proposals by the length of their draft (0: nothing drafted)",
    )
    meter.create_observable_gauge(
        "specdec_proposer_suffix_tree_tokens",
        [per_tree(lambda: cache.num_tokens, lambda: sum(t.num_tokens for t in local_trees()))],
        unit="{token}",
        description="tokens indexed: global trees (earlier outputs, within --suffix-cache-tokens), local trees "
        "(running requests' prompts and outputs)",
    )
    meter.create_observable_gauge(
        "specdec_proposer_suffix_tree_nodes",
        [per_tree(lambda: cache.num_nodes, lambda: sum(t.num_nodes for t in local_trees()))],
        unit="{node}",
        description="suffix tree nodes",
    )
    meter.create_observable_gauge(
        "specdec_proposer_suffix_tree_memory_bytes",
        [per_tree(cache.memory_bytes, lambda: sum(t.memory_bytes() for t in local_trees()))],
        unit="By",
        description="estimated memory of the trees (nodes and token arrays)",
    )
    meter.create_observable_gauge(
        "specdec_proposer_suffix_cached_requests",
        [lambda _o: [Observation(len(cache))]],
        unit="{request}",
        description="requests whose output the global trees hold",
    )
    meter.create_observable_counter(
        "specdec_proposer_suffix_evicted_requests",
        [lambda _o: [Observation(cache.evicted_requests)]],
        unit="{request}",
        description="requests evicted from the global trees to keep --suffix-cache-tokens",
    )
