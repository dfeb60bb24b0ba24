"""Sampling parameters and the one logits -> probabilities transform shared by drafter and verifier.

The rejection sampler is exact only if `target_probs` is the same distribution the plain decoder
would sample from, so both sides must go through `logits_to_probs` and nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from shared.grammar import StructuredOutput

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
    structured_output: StructuredOutput | None = None  # a format the output must match (shared/grammar.py)

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
        if self.structured_output is not None:
            self.structured_output.validate()
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")


def params_to_tensors(params: list[SamplingParams], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Per-row parameter tensors for a batched `logits_to_probs` call. Keep them on the CPU (the default):
    `logits_to_probs` decides on the host which rows need which work, and moves only what the math reads."""
    return {
        "temperature": torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
        "top_k": torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
        "top_p": torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        "min_p": torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
    }


# Width of the partial top-k that truncating rows look at first (widened to max(top_k) + 1). A row whose
# kept set does not end inside the window (a nucleus wider than it) falls back to a full sort.
TRUNCATION_WINDOW = 256
WIDER_WINDOW = 8  # the second window, before a full sort


def logits_to_probs(
    logits: torch.Tensor,  # [n, vocab]
    temperature: torch.Tensor,  # [n]; 0 = greedy (one-hot of the argmax)
    top_k: torch.Tensor,  # [n] int64; 0 = off
    top_p: torch.Tensor,  # [n]; 1 = off
    min_p: torch.Tensor,  # [n]; 0 = off
) -> torch.Tensor:  # [n, vocab] fp32, rows sum to 1
    """Greedy rows are the one-hot of the first argmax; the others softmax(logits / T) over the tokens that
    top-k, then top-p, then min-p keep (the order transformers applies them). Ties are kept together: a token
    survives a rule exactly when any token of equal logit does, so the result never depends on sort order.

    Each row pays only for what it asks: greedy rows an argmax, plain-temperature rows a softmax, truncating
    rows a partial top-k over TRUNCATION_WINDOW tokens, and a full sort only when their kept set is wider."""
    logits = logits.float()
    n, vocab = logits.shape
    # Row routing is decided on the host from the parameters (no device round trip when they live there).
    temperature, top_k, top_p, min_p = (t.cpu() for t in (temperature, top_k, top_p, min_p))
    greedy = temperature == 0  # [n]
    if bool(greedy.all()):  # the common greedy batch: no softmax over the vocabulary to throw away
        return _argmax_one_hot(logits)
    truncates = ~greedy & ((top_k > 0) | (top_p < 1) | (min_p > 0))  # [n]
    if bool(greedy.any()):
        probs = torch.empty(n, vocab, dtype=torch.float32, device=logits.device)
        greedy_rows = greedy.nonzero().flatten().to(logits.device)
        probs[greedy_rows] = _argmax_one_hot(logits[greedy_rows])
        sampled = (~greedy).nonzero().flatten()
        probs[sampled.to(logits.device)] = _sampled_probs(
            logits[sampled.to(logits.device)], temperature[sampled], top_k[sampled], top_p[sampled],
            min_p[sampled], truncates[sampled],
        )  # fmt: skip
        return probs
    return _sampled_probs(logits, temperature, top_k, top_p, min_p, truncates)


def _argmax_one_hot(logits: torch.Tensor) -> torch.Tensor:  # [n, vocab] -> [n, vocab] fp32
    # argmax picks the first maximal index, as transformers' greedy search does.
    one_hot = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return one_hot.scatter_(-1, first_argmax(logits).unsqueeze(-1), 1.0)


ARGMAX_BLOCK = 256


def first_argmax(logits: torch.Tensor) -> torch.Tensor:  # [n, vocab] -> [n] int64
    """`logits.argmax(dim=-1)`, the same index always (the first maximal one; the first NaN where a row has one),
    in two passes on the CPU: the vectorised max of each block of ARGMAX_BLOCK logits, then argmax over the
    block maxima (the first block holding the row's maximum) and within that block. CPU argmax is a scalar loop:
    over a vocabulary of 49,152 this is 4-6x faster at 8-40 rows."""
    if logits.device.type != "cpu" or logits.dim() != 2 or logits.shape[-1] < 2 * ARGMAX_BLOCK:
        return logits.argmax(dim=-1)
    n, vocab = logits.shape
    whole = vocab - vocab % ARGMAX_BLOCK
    blocks = logits[:, :whole].unflatten(-1, (whole // ARGMAX_BLOCK, ARGMAX_BLOCK))  # [n, nb, block]
    block_max = blocks.amax(dim=-1)  # [n, nb]: NaN where a block holds one, as argmax ranks NaN first
    first_block = block_max.argmax(dim=-1)  # [n]
    rows = torch.arange(n, device=logits.device)
    ids = first_block * ARGMAX_BLOCK + blocks[rows, first_block].argmax(dim=-1)  # [n]
    if whole == vocab:
        return ids
    tail = logits[:, whole:]  # [n, vocab % block]: wins only where strictly greater, or NaN where ahead is none
    head_max, tail_max = block_max[rows, first_block], tail.amax(dim=-1)
    tail_wins = (tail_max > head_max) | (tail_max.isnan() & ~head_max.isnan())
    return torch.where(tail_wins, whole + tail.argmax(dim=-1), ids)


def _sampled_probs(
    logits: torch.Tensor,  # [m, vocab] fp32
    temperature: torch.Tensor,  # [m] CPU, > 0
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    truncates: torch.Tensor,  # [m] bool CPU: the rows with top-k, top-p or min-p on
) -> torch.Tensor:  # [m, vocab]
    device = logits.device
    scaled = logits / temperature.to(device).unsqueeze(-1)  # [m, vocab]
    if bool(truncates.all()):
        return truncated_probs(scaled, top_k, top_p, min_p, TRUNCATION_WINDOW)
    probs = torch.softmax(scaled, dim=-1)
    if bool(truncates.any()):
        rows = truncates.nonzero().flatten()
        on_device = rows.to(device)
        probs[on_device] = truncated_probs(scaled[on_device], top_k[rows], top_p[rows], min_p[rows], TRUNCATION_WINDOW)
    return probs


def truncated_probs(
    scaled: torch.Tensor,  # [m, vocab] fp32, temperature applied
    top_k: torch.Tensor,  # [m] CPU int64
    top_p: torch.Tensor,  # [m] CPU
    min_p: torch.Tensor,  # [m] CPU
    window: int,
) -> torch.Tensor:  # [m, vocab]: softmax over the kept tokens, 0 elsewhere
    """top-k, then top-p, then min-p, decided on a partial top-k of the largest logits of each row.

    Every rule removes a token by its value alone (ties share a fate) and removes a lower token whenever it
    removes a higher one, so the kept tokens are a prefix of the row sorted by logit. When a row's window ends
    with a removed token the prefix lies inside it, and the row's probabilities are the softmax of that
    prefix, scattered into a zero row: nothing vocabulary-wide but the zeros. Rows whose window is all kept
    try a window WIDER_WINDOW times larger, then the whole sorted row. The window starts at max(top_k) + 1
    when every row sets top_k (nothing past it can survive), else at max(window, max(top_k) + 1)."""
    vocab = scaled.shape[-1]
    k_on = top_k > 0
    needed = int(top_k[k_on].max()) + 1 if bool(k_on.any()) else 0
    width = needed if bool(k_on.all()) else max(window, needed)
    # Rows without top-k read their masses off the whole row's softmax (one fused pass).
    full = None if bool((k_on & (top_k < vocab)).all()) else torch.softmax(scaled, dim=-1)  # [m, vocab]
    probs = torch.zeros_like(scaled)  # [m, vocab]
    rows = torch.arange(scaled.shape[0])  # [r] CPU: the rows still open
    for stage_width in (width, width * WIDER_WINDOW, vocab):
        every_row = rows.numel() == scaled.shape[0]
        on_device = rows.to(scaled.device)
        row_scaled = scaled if every_row else scaled[on_device]
        row_full = full if full is None or every_row else full[on_device]
        stage = min(stage_width, vocab)
        values, ids, num_kept, resolved = _kept_prefix(
            row_scaled, row_full, top_k[rows], top_p[rows], min_p[rows], stage
        )
        kept = torch.arange(stage, device=scaled.device).unsqueeze(0) < num_kept  # [r, stage]
        if every_row and bool(resolved.all()):  # the common case: no row copies
            probs.scatter_(-1, ids, torch.softmax(values.masked_fill(~kept, float("-inf")), dim=-1))
            break
        done = resolved.nonzero().flatten()
        if done.numel():
            done_device = done.to(scaled.device)
            prefix = torch.softmax(values[done_device].masked_fill(~kept[done_device], float("-inf")), dim=-1)
            probs[rows[done].to(scaled.device)] = probs.new_zeros(done.numel(), vocab).scatter_(
                -1, ids[done_device], prefix
            )
        rows = rows[~resolved]
        if rows.numel() == 0:
            break
    return probs


def _kept_prefix(
    scaled: torch.Tensor,  # [m, vocab]
    full: torch.Tensor | None,  # [m, vocab] softmax(scaled); None when every row sets top-k
    top_k: torch.Tensor,  # [m] CPU
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `width` largest logits [m, width] (descending), their ids [m, width], how many of them are kept
    [m, 1], and whether that decides the row [m] CPU bool (its window ends with a removed token)."""
    device = scaled.device
    vocab = scaled.shape[-1]
    if width >= vocab:
        values, ids = scaled.sort(dim=-1, descending=True)  # [m, vocab]
    else:
        values, ids = scaled.topk(width, dim=-1, sorted=True)  # [m, width], descending
    k_on = (top_k > 0) & (top_k < vocab)  # [m] CPU
    k = torch.where(k_on, top_k, torch.full_like(top_k, width)).clamp(max=width).to(device)
    # top-k keeps every token at least as large as the k-th largest (its ties included, as transformers does).
    kth = values.gather(-1, (k - 1).unsqueeze(-1))  # [m, 1]
    kth = torch.where(k_on.to(device).unsqueeze(-1), kth, torch.full_like(kth, float("-inf")))
    # The survivors of top-k are normalised by their sorted running sum (the same fp32 number whatever the
    # window, as long as it holds them all); without top-k the masses are the whole row's softmax.
    if bool(k_on.all()):
        unnormalised = torch.exp(values - values[:, :1]).masked_fill(values < kth, 0.0)  # [m, width]
        probs = unnormalised / unnormalised.cumsum(dim=-1)[:, -1:]
    else:
        assert full is not None
        probs = full.gather(-1, ids)  # [m, width]
        if bool(k_on.any()):
            on = k_on.nonzero().flatten().to(device)
            unnormalised = torch.exp(values[on] - values[on, :1]).masked_fill(values[on] < kth[on], 0.0)
            probs[on] = unnormalised / unnormalised.cumsum(dim=-1)[:, -1:]
    remove = values < kth
    # top-p: a token goes when the mass of the tokens strictly above it already reaches top_p. cummax keeps the
    # fp32 running mass monotone; each tie group reads the mass before its first member.
    mass_before = (probs.cumsum(dim=-1) - probs).cummax(dim=-1).values  # [m, width]
    positions = torch.arange(width, device=device).expand_as(values)
    group_start = torch.ones_like(values, dtype=torch.bool)
    group_start[:, 1:] = values[:, 1:] != values[:, :-1]
    first_of_group = torch.where(group_start, positions, torch.zeros_like(positions)).cummax(dim=-1).values
    mass_before = mass_before.gather(-1, first_of_group)
    top_p_dev = top_p.to(device).unsqueeze(-1)
    remove |= (top_p_dev < 1) & (mass_before >= top_p_dev)
    remove |= probs < min_p.to(device).unsqueeze(-1) * probs[:, :1]
    remove[:, 0] = False  # the most likely token always survives
    num_kept = (~remove).sum(dim=-1, keepdim=True)  # [m, 1]; removal is monotone, so the kept are a prefix
    # A row is decided when its window's last token is removed (then so is everything below the window), and
    # its top-k survivors all lie inside the window (else the norm above missed some: ties past the window).
    closed = (values[:, -1:] < kth).squeeze(-1) | ~k_on.to(device)  # [m]
    resolved = (remove[:, -1] & closed).cpu() | (width >= vocab)
    return values, ids, num_kept, resolved
