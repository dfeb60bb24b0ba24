"""What `make run` prints after its answers: the speculation figures, read from the verifier's and the proposer's
Prometheus endpoints (the same series a dashboard shows).

    python -m specdec_local.run_figures VERIFIER_HOST:PORT PROPOSER_HOST:PORT
"""

from __future__ import annotations

import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

# The proposer's phases (proposer_service.paged_drafter.PHASES) as the line names them, in a round's order.
PHASE_NAMES = (
    ("ingest", "ingest"),
    ("catch-up", "catch_up"),
    ("drafting", "draft"),
    ("the request's own text", "text"),
)


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one endpoint; {} when it cannot be read."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    """A sample summed over the labels not given (the service's resource labels differ per process)."""
    wanted = set(labels.items())
    return sum(v for (n, lbls), v in samples.items() if n == name and wanted <= set(lbls))


def figures(verifier: dict, proposer: dict) -> list[str]:
    lines = []
    seq_steps = value(verifier, "specdec_sequence_steps_total")
    drafted, accepted = (
        value(verifier, "specdec_drafted_tokens_total"),
        value(verifier, "specdec_accepted_tokens_total"),
    )
    emitted = value(verifier, "specdec_emitted_tokens_total")
    if seq_steps:
        lines.append(
            f"tokens per sequence step {emitted / seq_steps:.2f}; drafted {drafted:.0f}, accepted {accepted:.0f}"
            + (f" ({accepted / drafted:.0%})" if drafted else "")
        )
    phase = "specdec_step_phase_duration_seconds"
    steps = value(verifier, f"{phase}_count", phase="propose")
    if steps:
        step_s = sum(value(verifier, f"{phase}_sum", phase=p) for p in ("propose", "score", "verify")) / steps
        propose_s = value(verifier, f"{phase}_sum", phase="propose") / steps
        lines.append(
            f"propose on the verifier's critical path: {propose_s * 1e3:.1f} ms a step, {propose_s / step_s:.0%} of "
            f"its {step_s * 1e3:.1f} ms"
        )
    lines.extend(_proposer_round(verifier, proposer))
    asked, used = (
        value(verifier, "specdec_early_drafts_asked_total"),
        value(verifier, "specdec_early_drafts_used_total"),
    )
    if asked:
        lines.append(f"drafts asked for early (as a step committed): {asked:.0f}, taken by the next step {used:.0f}")
    lines.extend(_branches(proposer))
    hits, misses = (
        value(proposer, "specdec_proposer_draft_ahead_hits_total"),
        value(proposer, "specdec_proposer_draft_ahead_misses_total"),
    )
    if hits + misses:
        wasted, ahead = (
            value(proposer, "specdec_proposer_draft_ahead_wasted_total"),
            value(proposer, "specdec_proposer_draft_ahead_drafted_total"),
        )
        lines.append(
            f"drafting ahead: {hits / (hits + misses):.0%} of rounds answered from the speculation cache "
            f"({hits:.0f} hits, {misses:.0f} misses); {wasted:.0f} of {ahead:.0f} tokens drafted ahead unused"
        )
    else:
        lines.append("drafting ahead: off (SPECDEC_DRAFT_AHEAD=N turns it on)")
    return lines


def _branches(proposer: dict) -> list[str]:
    """What the request's own text added to the model's drafts (the proposer's --suffix-branches)."""
    if not any(name.startswith("specdec_proposer_suffix_branch_") for name, _ in proposer):
        return []  # --no-suffix-branches, or another kind
    tokens, trees, chains = (
        value(proposer, f"specdec_proposer_suffix_branch_{name}_total") for name in ("tree_tokens", "trees", "chains")
    )
    return [
        f"the request's own text: {tokens:.0f} nodes added to {trees:.0f} token trees, {chains:.0f} greedy chains "
        "sent as the text's"
    ]


def _proposer_round(verifier: dict, proposer: dict) -> list[str]:
    """Where a propose round's time goes: the proposer's own phases, and the network (the verifier's round trip
    less the proposer's time)."""
    messages = value(proposer, "specdec_proposer_draft_duration_seconds_count")
    if not messages:
        return []
    message_s = value(proposer, "specdec_proposer_draft_duration_seconds_sum") / messages
    line = f"a propose message: {message_s * 1e3:.1f} ms in the proposer"
    phase = "specdec_proposer_phase_duration_seconds"
    rounds = value(proposer, f"{phase}_count", phase="draft")
    if rounds:
        parts = [(name, value(proposer, f"{phase}_sum", phase=key) / rounds) for name, key in PHASE_NAMES]
        line += " (a drafter round: " + ", ".join(f"{name} {seconds * 1e3:.1f}" for name, seconds in parts) + " ms)"
    network = "specdec_step_phase_duration_seconds"
    steps = value(verifier, f"{network}_count", phase="network")
    if steps:
        line += f", {value(verifier, f'{network}_sum', phase='network') / steps * 1e3:.1f} ms on the network"
    return [line]


def main() -> None:
    verifier, proposer = scrape(sys.argv[1]), scrape(sys.argv[2])
    if not verifier:
        print(f"(no metrics at {sys.argv[1]})")
        return
    print("\n".join(figures(verifier, proposer)))


if __name__ == "__main__":
    main()
