"""The trainer's held-out measure: greedy chain acceptance at k on the fixed held-out conversations.

The held-out conversations (conversations.held_out_conversations, topics absent from the training set) are
answered greedily by the target once and cached. For every position m of those answers, the head's unrolled
forward gives exactly the drafts greedy chain drafting would make from the last real feature at m (step s at
position m + s - 1 reads the head's own states and the previous drafted tokens, which, as long as drafts are
accepted, are the target's tokens): a draft is accepted when it is the target's greedy token, and the chain
stops at the first miss.

The measure walks each answer as an engine's verify rounds do: the first round drafts after the answer's first
token, and a round that accepts a drafts makes the next start a + 1 positions later. Averaged over every start
position instead, the figure runs high: a start inside a run the head predicts well is counted at every
position of the run, where an engine's rounds step over it. For the committed head (2026-12-06): 2.16 over
every start, 2.03 walked; over the answers' first 64 tokens 2.04 and 1.921 walked, where the engine
(specdec_train/evaluate.py, the same prompts, 64 new tokens) makes 1.92. So the walk is the engine's figure
without the engine's cost: a few seconds per check, and the trainer keeps the weights that draft best, not
those with the lowest loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec_train.train import Batch, Trainer, make_batch


@dataclass(frozen=True)
class ChainAcceptance:
    k: int
    per_position: list[float]  # share of verify rounds whose first i + 1 drafts were all accepted
    rounds: int
    per_start: list[float]  # the same share over every start position of the answers
    starts: int

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify step: 1 + expected accepted drafts per round."""
        return 1.0 + sum(self.per_position)

    @property
    def per_start_length(self) -> float:
        return 1.0 + sum(self.per_start)


def walk_rounds(accepted: list[int], ok: list[bool]) -> list[int]:
    """Accepted drafts of each verify round over one row: `accepted[m]` drafts are accepted from start m, and
    `ok[m]` says whether all k drafts' targets at m are generated tokens. Each run of ok starts is one answer:
    its first round starts at the run's first start (after the answer's first token, which the target's prefill
    gives), and a round accepting a drafts moves the start by a + 1. A round never steps into the next answer:
    the turns between answers are longer than a round's step."""
    rounds, m = [], 0
    while m < len(ok):
        if ok[m]:
            rounds.append(accepted[m])
            m += accepted[m] + 1
        else:
            m += 1
    return rounds


class HeldOut:
    def __init__(self, samples: list[dict], features, k: int, max_len: int, group: int = 8) -> None:
        self.k = k
        self.batches: list[Batch] = []
        for i in range(0, len(samples), group):
            convs = samples[i : i + group]
            batch = make_batch(convs, features([s["tokens"] for s in convs]), k, max_len)
            if batch is not None:
                self.batches.append(batch)

    @torch.no_grad()
    def measure(self, trainer: Trainer) -> ChainAcceptance:
        k = self.k
        per_start, per_round = torch.zeros(k), torch.zeros(k)
        starts = rounds = 0
        for batch in self.batches:
            assert batch.next_tokens is not None
            outputs = trainer.forward(batch, k)
            hits = []  # per step s: [B, S'] hit of the draft made for start m at position m + s - 1
            for s, out in enumerate(outputs, start=1):
                drafts = trainer.vocab_subset[trainer.logits(out).argmax(-1)]  # [B, S]
                hit = drafts == batch.next_tokens
                hits.append(hit[:, s - 1 : hit.shape[1] - (k - s)])
            start_ok = batch.valid[k - 1][:, k - 1 :]  # start m: its k drafts' targets are all generated
            chain = torch.stack(hits).cumprod(dim=0).bool() & start_ok  # [k, B, S']
            per_start += chain.flatten(1).sum(1).float()
            starts += int(start_ok.sum())
            for accepted, ok in zip(chain.sum(0).tolist(), start_ok.tolist(), strict=True):  # [S'] per row
                for a in walk_rounds(accepted, ok):
                    per_round[:a] += 1
                    rounds += 1
        return ChainAcceptance(
            k, (per_round / max(1, rounds)).tolist(), rounds, (per_start / max(1, starts)).tolist(), starts
        )

    def __call__(self, trainer: Trainer) -> float:
        return self.measure(trainer).mean_accepted_length
