"""The trainer's held-out measure: greedy chain acceptance at k on the fixed held-out conversations.

The held-out conversations (conversations.held_out_conversations, topics absent from the training set) are
answered greedily by the target once and cached. For every position m of those answers, the head's unrolled
forward gives exactly the drafts greedy chain drafting would make from the last real feature at m (step s at
position m + s - 1 reads the head's own states and the previous drafted tokens, which, as long as drafts are
accepted, are the target's tokens): a draft is accepted when it is the target's greedy token, and the chain
stops at the first miss. Averaged over every start position rather than over the verify rounds an engine
happens to make, it is the engine's measure (specdec_train/evaluate.py) without the engine's cost: a few
seconds per check, so the trainer keeps the weights that draft best, not those with the lowest loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec_train.train import Batch, Trainer, make_batch


@dataclass(frozen=True)
class ChainAcceptance:
    k: int
    per_position: list[float]  # share of start positions whose first i + 1 drafts are all accepted
    starts: int

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify step: 1 + expected accepted drafts."""
        return 1.0 + sum(self.per_position)


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
        accepted = torch.zeros(k)
        starts = 0
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
            accepted += chain.flatten(1).sum(1).float()
            starts += int(start_ok.sum())
        return ChainAcceptance(k, (accepted / max(1, starts)).tolist(), starts)

    def __call__(self, trainer: Trainer) -> float:
        return self.measure(trainer).mean_accepted_length
