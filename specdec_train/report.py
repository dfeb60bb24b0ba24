"""What the trainer writes beside the weights: the vocabulary subset, held-out acceptance, the loss curve
and the model card."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared.sampling import SamplingParams


def frequency_subset(samples: list[dict], vocab_size: int, size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """FR-Spec's subset: the `size` most frequent ids of the target's generated text (what drafts predict;
    ties and ids never seen in it in id order, which for BPE vocabularies follows merge order, a frequency
    proxy), plus `always` (EOS)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        counts += torch.bincount(s["tokens"][s["generated"]].long(), minlength=vocab_size)
    counts[list(always)] = counts.max() + 1
    # A stable sort by count alone keeps ids in increasing order among equal counts.
    order = torch.sort(-counts, stable=True).indices
    return order[: min(size, vocab_size)].clone()


def subset_coverage(samples: list[dict], subset: torch.Tensor) -> float:
    """Share of generated tokens that the subset contains."""
    member = torch.zeros(int(subset.max()) + 1, dtype=torch.bool)
    member[subset] = True
    hits = total = 0
    for s in samples:
        out = s["tokens"][s["generated"]].long()
        inside = out < member.numel()
        hits += int(member[out[inside]].sum())
        total += out.numel()
    return hits / max(1, total)


@dataclass
class Acceptance:
    k: int
    rounds: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # per draft position: rounds that accepted it

    @property
    def mean_accepted_length(self) -> float:
        return 1 + self.accepted / self.rounds if self.rounds else 1.0

    @property
    def per_position(self) -> list[float]:
        """Per draft position (a tree's depth): the share of rounds whose accepted path reached it, so that they
        sum to tokens per verify step - 1 (a tree shallower than k in some rounds counts those as not reached)."""
        return [a / self.rounds if self.rounds else 0.0 for a in self.accepted_at]

    def add(self, num_drafted: int, num_accepted: int) -> None:
        if not num_drafted:
            return
        self.rounds += 1
        self.accepted += num_accepted
        # A tree's nodes outnumber its depths (<= k): position i is then depth i, drafted in every round.
        for i in range(min(num_drafted, self.k)):
            self.accepted_at[i] += i < num_accepted


def measure_acceptance(
    engine, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0, seeded: bool = True
) -> Acceptance:
    """Run the prompts through an engine with a fixed k; count accepted drafts per position. Sampled prompts
    carry seeds 0, 1, ... unless `seeded` is False."""
    k = engine.config.num_speculative_tokens
    result = Acceptance(k, accepted_at=[0] * k)
    for i, ids in enumerate(prompts):
        seed = i if temperature and seeded else None
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens)
        engine.add_request(f"eval{i}", ids, params)
    while engine.has_unfinished():
        for out in engine.step():
            result.add(out.draft_depth, out.num_accepted)
    return result


def plot_losses(history: list[dict[str, float]], path: Path) -> None:
    """Training loss, training top-1 agreement per unroll step, and the held-out measure over the steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_top1, ax_held) = plt.subplots(1, 3, figsize=(14, 3.6))
    steps = [h["step"] for h in history]
    window = max(1, len(history) // 50)

    def smooth(values: list[float]) -> list[float]:
        return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]

    ax_loss.plot(steps, smooth([h["loss"] for h in history]))
    ax_loss.set(xlabel="step", ylabel="loss (smoothed)", yscale="log", title="training loss")
    for key in sorted(k for k in history[0] if k.startswith("top1_")):
        ax_top1.plot(steps, smooth([h[key] for h in history]), label=f"unroll step {key[5:]}")
    ax_top1.set(xlabel="step", ylabel="top-1 agreement with the target", title="training batches")
    ax_top1.legend()
    held = [(h["step"], h["heldout"]) for h in history if "heldout" in h]
    if held:
        ax_held.plot(*zip(*held, strict=True), "o-")
    ax_held.set(xlabel="step", ylabel="tokens per verify step (k = 4, greedy)", title="held-out chain acceptance")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


CARD = """# {name}: EAGLE draft head for `{target}`

A feature-conditioned draft head for specdec's `eagle` proposer, made by specdec's own trainer
(`specdec_train`). It reads the target's layers {feature_layers} (decoder layer outputs; -1 = the final
normed state){fuse_note}, and holds only its own weights (fp16): {weights}, {num_layers} Llama decoder
layer(s) and the frequency-ranked vocabulary subset (`vocab_subset`, {draft_vocab} ids); the embedding and
LM head are read from the target at load time.

## Reproduce
```
{command}
```

## Data
- {num_samples} conversations from the trainer's generated set (`specdec_train/conversations.py`: long
  answers, explanations, lists, Markdown tables, code in several languages, roles and places, everyday
  requests, multi-turn follow-ups, plain-text openings; held-out topics and benchmark subjects excluded),
  answered by the target through specdec's engine, half greedy, half T = 0.8 / top-p 0.95:
  {num_tokens} tokens, {num_generated} of them generated by the target. Tokens only are stored; the features
  are recomputed by a target prefill at training time (kept in memory, `--feature-cache-gb`, when they fit).
- Vocabulary subset: {subset_origin}; it contains {coverage:.1%} of the generated tokens.

## Training
- Seed {seed}; {steps} steps of {tokens_per_step} conversation tokens (windows of <= {max_len} positions);
  AdamW, lr {lr}, cosine after {warmup} warm-up steps; loss = CE(target distribution over the subset){reg_note},
  unrolled {unroll} steps on the head's own states (training-time test), step s weighted
  {step_decay}^(s-1).{init_note}
- Time: training {train_minutes:.1f} min in all on {machine}{sittings}.
- Final training-batch top-1 agreement (last 50 steps): {top1}.
- Kept weights: step {best_step}, the best held-out measure (greedy chain k = {eval_k}, verify rounds walked
  over the held-out answers as an engine makes them, `specdec_train/heldout.py`): **{heldout:.2f}** tokens per
  verify step, per position {heldout_per_position} (averaged over every start position instead:
  {heldout_per_start:.2f}).

![loss and acceptance curves](loss.png)

## Held-out acceptance through the engine
`python -m specdec_train.evaluate {name_path}`: the {num_heldout} held-out prompts (`held_out_conversations()`:
topics absent from the training set), {eval_tokens} new tokens each, exact verification by specdec's engine:

{evaluation}
"""


def write_card(path: Path, **fields) -> None:
    path.write_text(CARD.format(**fields))
