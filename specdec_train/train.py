"""Training the head: the EAGLE loss with a training-time test of its own predicted features.

Loss per unrolled step s (s = 1 reads the target's real features, s > 1 the head's own predictions of the
step before, attending to real keys before them, as in drafting; HASS / EAGLE-3):
    smooth_l1(predicted feature, target feature) + cls_weight * CE(target distribution, head distribution)
over the vocabulary subset, the target's distribution being its own LM head on the next real feature,
renormalised over the subset. Checkpoints every `checkpoint_every` steps make a run resumable.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from shared.model.attention import default_scale
from shared.model.config import ModelArch
from shared.model.eagle import _rms_norm, init_head_state
from shared.model.rope import RotaryEmbedding, apply_rotary

PACE_STEPS = 30  # steps timed before the schedule is fitted to the time budget


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 20000  # an upper bound: the time budget usually decides
    batch_size: int = 8
    max_len: int = 256
    lr: float = 1e-3
    warmup: int = 100
    unroll: int = 2  # 1 = plain EAGLE-1 training; more = the head also learns from its own predictions
    cls_weight: float = 0.1
    step_weights: tuple[float, ...] = (1.0, 0.8, 0.6, 0.5)
    checkpoint_every: int = 200
    time_budget_s: float = 0.0  # 0 = none; otherwise stop (and save) once spent
    seed: int = 0
    dropout: float = 0.1  # on the fc output and each sub-layer's output, training only
    val_fraction: float = 0.05  # samples held out to pick the best checkpoint (the data is small: it overfits)
    eval_every: int = 100
    # Drafting starts after the prompt: a position whose next token is still prompt text (chat template,
    # the user's words) is never drafted. Scoring it spends capacity on text the head will not meet and
    # inflates the held-out agreement (0.58 with it against ~0.42 measured at the first draft position).
    score_prompt: bool = False


@dataclass
class Batch:
    features: torch.Tensor  # [B, S, hidden] f_j (0 where padded)
    next_ids: torch.Tensor  # [B, S] t_{j+1}
    valid: torch.Tensor  # [B, S] bool: a scored position j (real, with a target at j + 1)


def make_batches(samples: list[dict], config: TrainConfig, rng: random.Random) -> list[Batch]:
    """Windows of at most max_len positions, shuffled, grouped by similar length to waste little padding."""
    windows = []
    for s in samples:
        feats, tokens = s["features"], s["tokens"].long()
        n = feats.shape[0]  # positions 0..n-1 have features, tokens 0..n
        # position j drafts token j + 2 from [f_j, t_{j+1}]: the first draft follows the first generated token
        first_scored = 0 if config.score_prompt else max(0, s.get("prompt_len", 0) - 1)
        for start in range(0, max(1, n - 1), config.max_len):
            end = min(n, start + config.max_len)
            if end - 1 > first_scored:  # a window that scores nothing is left out
                scored_from = max(0, first_scored - start)
                windows.append((feats[start:end], tokens[start + 1 : end + 1], end - start, scored_from))
    rng.shuffle(windows)
    batches = []
    for i in range(0, len(windows), config.batch_size * 16):  # sort within buckets of 16 batches
        bucket = sorted(windows[i : i + config.batch_size * 16], key=lambda w: w[2])  # by length
        for j in range(0, len(bucket), config.batch_size):
            group = bucket[j : j + config.batch_size]
            length = max(w[2] for w in group)
            feats = torch.zeros(len(group), length, group[0][0].shape[1])
            ids = torch.zeros(len(group), length, dtype=torch.int64)
            valid = torch.zeros(len(group), length, dtype=torch.bool)
            for b, (f, t, n, scored_from) in enumerate(group):
                feats[b, :n], ids[b, :n] = f.float(), t
                valid[b, scored_from : n - 1] = True  # the last position of a window has no next feature in it
            batches.append(Batch(feats, ids, valid))
    rng.shuffle(batches)
    return batches


def unrolled_forward(
    state: dict[str, torch.Tensor],
    arch: ModelArch,
    rotary: RotaryEmbedding,
    features: torch.Tensor,  # [B, S, hidden]
    next_embeds: torch.Tensor,  # [B, S, hidden]
    unroll: int,
    dropout: float = 0.0,
) -> list[torch.Tensor]:  # per step s: [B, S, hidden], position j's prediction of f_{j+1}
    """Step 1 equals `shared.model.eagle.reference_forward`. At step s > 1 position j reads the prediction
    of step s - 1 at position j - 1 and attends to real keys at positions <= j - s + 1 and to the key of
    step i at position j - (s - i): exactly what drafting s - 1 tokens past the last real feature sees."""
    batch, seq_len, hidden = features.shape
    heads, kv_heads, head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
    cos, sin = rotary(torch.arange(seq_len), features.dtype)
    cos, sin = cos.repeat(batch, 1), sin.repeat(batch, 1)
    keys: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(arch.num_layers)]
    outputs = []
    inputs = features
    for step in range(1, unroll + 1):
        x = F.linear(torch.cat([inputs, next_embeds], dim=-1), state["fc.weight"], state["fc.bias"])
        x = F.dropout(x, dropout, training=dropout > 0)
        mask = _step_mask(seq_len, step)  # [S, step * S]
        for i in range(arch.num_layers):
            p = f"layers.{i}."
            y = _rms_norm(x, state[f"{p}input_layernorm.weight"], arch.rms_norm_eps)
            q = apply_rotary(F.linear(y, state[f"{p}self_attn.q_proj.weight"]).view(-1, heads, head_dim), cos, sin)
            k = apply_rotary(F.linear(y, state[f"{p}self_attn.k_proj.weight"]).view(-1, kv_heads, head_dim), cos, sin)
            v = F.linear(y, state[f"{p}self_attn.v_proj.weight"]).view(-1, kv_heads, head_dim)
            keys[i].append((k.view(batch, seq_len, kv_heads, head_dim), v.view(batch, seq_len, kv_heads, head_dim)))
            k_all = torch.cat([kk for kk, _ in keys[i]], dim=1).repeat_interleave(heads // kv_heads, dim=2)
            v_all = torch.cat([vv for _, vv in keys[i]], dim=1).repeat_interleave(heads // kv_heads, dim=2)
            attn = F.scaled_dot_product_attention(
                q.view(batch, seq_len, heads, head_dim).transpose(1, 2),
                k_all.transpose(1, 2),
                v_all.transpose(1, 2),
                attn_mask=mask,
                scale=default_scale(head_dim),
            )  # [B, heads, S, D]
            attn_out = F.linear(attn.transpose(1, 2).reshape(batch, seq_len, -1), state[f"{p}self_attn.o_proj.weight"])
            x = x + F.dropout(attn_out, dropout, training=dropout > 0)
            y = _rms_norm(x, state[f"{p}post_attention_layernorm.weight"], arch.rms_norm_eps)
            gate, up = F.linear(y, state[f"{p}mlp.gate_proj.weight"]), F.linear(y, state[f"{p}mlp.up_proj.weight"])
            x = x + F.dropout(
                F.linear(F.silu(gate) * up, state[f"{p}mlp.down_proj.weight"]), dropout, training=dropout > 0
            )
        outputs.append(x)
        inputs = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)  # position j reads j - 1's guess
    return outputs


def _step_mask(seq_len: int, step: int) -> torch.Tensor:  # [S, step * S] bool, True = attend
    q = torch.arange(seq_len).unsqueeze(1)
    k = torch.arange(seq_len).unsqueeze(0)
    blocks = [k <= q - step + 1]  # real keys
    for i in range(2, step + 1):
        blocks.append(k == q - (step - i))
    mask = torch.cat(blocks, dim=1)
    mask[:, 0] |= ~mask.any(dim=1)  # rows with nothing to attend (j < step - 1, never scored) stay finite
    return mask


@dataclass
class Trainer:
    arch: ModelArch
    embedding: torch.Tensor  # [vocab, hidden], frozen
    lm_head: torch.Tensor  # [vocab, hidden], frozen
    vocab_subset: torch.Tensor  # [draft_vocab]
    config: TrainConfig

    def __post_init__(self) -> None:
        self.rotary = RotaryEmbedding(self.arch.rope_parameters, self.arch.head_dim, self.arch.max_position_embeddings)
        self.subset_head = self.lm_head[self.vocab_subset]  # [draft_vocab, hidden]
        self.state = init_head_state(self.arch, self.vocab_subset, self.config.seed)
        self.params = [t for name, t in self.state.items() if name != "vocab_subset"]
        self.optimizer = torch.optim.AdamW(self.params, lr=self.config.lr, weight_decay=0.0)
        self.step = 0
        self.planned_steps = self.config.steps  # lowered to what the time budget allows, once measured
        self.history: list[dict[str, float]] = []
        self.best: tuple[float, int, dict[str, torch.Tensor]] | None = None  # (val top-1, step, weights)

    def lr_at(self, step: int) -> float:
        c = self.config
        if step < c.warmup:
            return c.lr * (step + 1) / c.warmup
        progress = (step - c.warmup) / max(1, self.planned_steps - c.warmup)
        return c.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    def loss(self, batch: Batch, train: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
        c = self.config
        next_embeds = F.embedding(batch.next_ids, self.embedding)
        dropout = c.dropout if train else 0.0
        outputs = unrolled_forward(self.state, self.arch, self.rotary, batch.features, next_embeds, c.unroll, dropout)
        target_feats = batch.features[:, 1:]  # [B, S-1, hidden]: f_{j+1}
        with torch.no_grad():
            teacher = torch.softmax(target_feats @ self.subset_head.T, dim=-1)  # [B, S-1, draft_vocab]
        total = torch.zeros(())
        stats = {}
        for s, out in enumerate(outputs, start=1):
            valid = batch.valid[:, :-1].clone()
            valid[:, : s - 1] = False  # position j's chain needs s - 1 predictions before it
            pred = out[:, :-1][valid]  # [N, hidden]
            reg = F.smooth_l1_loss(pred, target_feats[valid])
            log_probs = torch.log_softmax(pred @ self.subset_head.T, dim=-1)
            cls = -(teacher[valid] * log_probs).sum(-1).mean()
            total = total + c.step_weights[min(s, len(c.step_weights)) - 1] * (reg + c.cls_weight * cls)
            with torch.no_grad():
                agree = (log_probs.argmax(-1) == teacher[valid].argmax(-1)).float().mean()
            stats |= {f"reg{s}": reg.item(), f"cls{s}": cls.item(), f"top1_{s}": agree.item()}
        return total, stats

    def train_step(self, batch: Batch) -> dict[str, float]:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        loss, stats = self.loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 0.5)
        self.optimizer.step()
        self.step += 1
        stats = {"step": self.step, "loss": loss.item(), **stats}
        self.history.append(stats)
        return stats

    def save_checkpoint(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save(
            {
                "state": {k: v.detach() for k, v in self.state.items()},
                "optimizer": self.optimizer.state_dict(),
                "step": self.step,
                "planned_steps": self.planned_steps,
                "history": self.history,
                "best": self.best,
                "config": asdict(self.config),
            },
            tmp,
        )
        tmp.replace(path)

    def load_checkpoint(self, path: Path) -> bool:
        if not path.is_file():
            return False
        ckpt = torch.load(path)
        if ckpt["config"] != asdict(self.config):
            raise ValueError(f"{path} was written with other training settings; delete it to start over")
        with torch.no_grad():
            for name, value in ckpt["state"].items():
                self.state[name].copy_(value)
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.step, self.history, self.planned_steps = ckpt["step"], ckpt["history"], ckpt["planned_steps"]
        self.best = ckpt["best"]
        return True

    def validate(self, batches: list[Batch]) -> float:
        """Top-1 agreement of unroll step 1 with the target on held-out samples."""
        with torch.no_grad():
            values = [self.loss(b, train=False)[1]["top1_1"] for b in batches]
        return sum(values) / max(1, len(values))

    def _evaluate(self, val_batches: list[Batch]) -> None:
        if not val_batches:
            return
        value = self.validate(val_batches)
        self.history[-1]["val_top1"] = value
        if self.best is None or value > self.best[0]:
            self.best = (value, self.step, {k: v.detach().clone() for k, v in self.state.items()})

    def best_state(self) -> dict[str, torch.Tensor]:
        return self.best[2] if self.best is not None else self.state

    def fit(self, samples: list[dict], checkpoint: Path) -> None:
        c = self.config
        resumed = self.load_checkpoint(checkpoint)
        split = random.Random(c.seed).sample(range(len(samples)), round(len(samples) * c.val_fraction))
        val = [samples[i] for i in sorted(split)]
        samples = [s for i, s in enumerate(samples) if i not in set(split)]
        val_batches = make_batches(val, c, random.Random(c.seed)) if val else []
        per_epoch = len(make_batches(samples, c, random.Random(c.seed * 1000)))  # the same count every epoch
        started, first_step = time.monotonic(), self.step
        bar = tqdm(total=c.steps, initial=self.step, desc="training head" + (" (resumed)" if resumed else ""))
        while self.step < self.planned_steps:
            epoch, skip = divmod(self.step, per_epoch)  # a resumed run continues with the batch it stopped at
            for batch in make_batches(samples, c, random.Random(c.seed * 1000 + epoch))[skip:]:
                stats = self.train_step(batch)
                bar.update(1)
                best = f"{self.best[0]:.2f}" if self.best else "-"
                bar.set_postfix(loss=f"{stats['loss']:.3f}", top1=f"{stats['top1_1']:.2f}", val=best)
                spent = time.monotonic() - started
                if c.time_budget_s and self.step - first_step == PACE_STEPS and not resumed:
                    # The cosine schedule ends where the budget will, at the pace measured so far (with a
                    # margin: evaluations and a busier machine slow the rest down).
                    self.planned_steps = min(c.steps, int(0.85 * c.time_budget_s / spent * PACE_STEPS))
                    bar.total = self.planned_steps
                out_of_time = c.time_budget_s and spent > c.time_budget_s
                done = self.step >= self.planned_steps
                if self.step % c.eval_every == 0 or done or out_of_time:
                    self._evaluate(val_batches)
                if self.step % c.checkpoint_every == 0 or done or out_of_time:
                    self.save_checkpoint(checkpoint)
                if done or out_of_time:
                    bar.close()
                    return
        bar.close()
