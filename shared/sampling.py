"""Sampling parameters and the one logits -> probabilities transform shared by drafter and verifier.

The rejection sampler is exact only if `target_probs` is the same distribution the plain decoder
would sample from, so both sides must go through `logits_to_probs` and nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Temperatures below this decode greedily (vLLM's _SAMPLING_EPS): dividing float32 logits by 1e-40 gives
# inf - inf = NaN in the softmax, and a distribution that sharp is the argmax anyway.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None
    max_tokens: int = 128
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_seeded(self) -> bool:
        """Sampled with a seed: each token is a pure function of (seed, position, distribution); shared/seeded.py."""
        return self.seed is not None and not self.is_greedy

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError with a message a person understands. The one place sampling values are checked."""
        for name in ("temperature", "top_p", "min_p"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")


def params_to_tensors(params: list[SamplingParams], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Per-row parameter tensors for a batched `logits_to_probs` call."""
    return {
        "temperature": torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
        "top_k": torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
        "top_p": torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        "min_p": torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
    }


def logits_to_probs(
    logits: torch.Tensor,  # [n, vocab]
    temperature: torch.Tensor,  # [n]; 0 = greedy (one-hot of the argmax)
    top_k: torch.Tensor,  # [n] int64; 0 = off
    top_p: torch.Tensor,  # [n]; 1 = off
    min_p: torch.Tensor,  # [n]; 0 = off
) -> torch.Tensor:  # [n, vocab] fp32, rows sum to 1
    logits = logits.float()
    greedy = temperature == 0
    if bool(greedy.all()):  # the common greedy batch: no softmax over the vocabulary to throw away
        return _argmax_one_hot(logits)
    # Greedy rows use temperature 1 here and are replaced by one-hot rows at the end.
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)

    vocab = logits.shape[-1]
    if bool((top_k > 0).any()) or bool((top_p < 1).any()) or bool((min_p > 0).any()):
        scaled = _truncate(scaled, top_k, top_p, min_p, vocab)
    probs = torch.softmax(scaled, dim=-1)

    if bool(greedy.any()):
        probs = torch.where(greedy.unsqueeze(-1), _argmax_one_hot(logits), probs)
    return probs


def _argmax_one_hot(logits: torch.Tensor) -> torch.Tensor:  # [n, vocab] -> [n, vocab] fp32
    # argmax picks the first maximal index, as transformers' greedy search does.
    one_hot = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return one_hot.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _truncate(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, vocab: int
) -> torch.Tensor:
    """Mask out tokens removed by top-k, then top-p, then min-p (the order transformers applies them)."""
    sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)  # [n, vocab]
    ranks = torch.arange(vocab, device=scaled.device).unsqueeze(0)  # [1, vocab]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab)).unsqueeze(-1)
    remove = ranks >= k

    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token goes when the mass before it already does.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # top_p == 1 is "off": the fp32 cumsum saturates at 1.0 before the tail, which would otherwise
    # drop every tail token of a top_p = 1 row that shares the batch with a truncating row.
    top_p_on = (top_p < 1).unsqueeze(-1)
    remove |= top_p_on & (mass_before >= top_p.unsqueeze(-1))
    remove |= sorted_probs < (min_p.unsqueeze(-1) * sorted_probs[:, :1])
    remove[:, 0] = False  # the most likely token always survives

    mask = torch.zeros_like(remove).scatter(-1, sorted_idx, remove)
    return scaled.masked_fill(mask, float("-inf"))
