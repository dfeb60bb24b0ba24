"""Seeded sampling as a pure function of (seed, output position, distribution): Gumbel-max.

For a request with a seed, the token at output position `t` (0 = the first generated token) is

    argmax(log target_probs + gumbel_noise(seed, t))

which is a sample from `target_probs` (the Gumbel-max trick), and the noise at `t` is independent of
the noise at every other position, so the sequence is distributed exactly as plain sampling from the
target. Because the token does not depend on how it was reached, the text is the same whatever the
drafter, k, batch, prefix cache, preemption or failover (up to floating-point ties, as with greedy).
Drafters that draft with the same noise (`argmax(log draft_probs + noise)`) agree with the target
wherever the two distributions put their argmax-after-noise on the same token, which is often.

Noise source
------------
One torch CPU generator (Mersenne twister) per (seed, position), seeded with
`splitmix64(splitmix64(seed) ^ position)`: splitmix64 is a bijective 64-bit mixer, so nearby seeds and
positions give unrelated generator seeds. torch has no counter-based CPU generator (Philox is CUDA only),
and seeding a fresh MT19937 costs a few microseconds; the cost that matters is the draw itself,
`vocab` float64 uniforms and two logs per position (about 1 ms for a 49k vocabulary on one CPU core).
The verifier pays it only up to a row's first mismatch, the drafter once per draft token. Uniforms are
float64 so that noise ties (which would make the token depend on tie-breaking) have probability ~0.
torch's CPU stream for a given seed is fixed within a torch version (pinned in constraints.txt); verifiers
on different torch versions would break failover exactness, a proposer on another one only acceptance.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """The splitmix64 finaliser (Steele, Lea, Flood 2014): a bijection of 64-bit integers that mixes every bit."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def position_seed(seed: int, position: int) -> int:
    """The generator seed of one output position of one seeded request."""
    return splitmix64(splitmix64(seed & _MASK64) ^ (position & _MASK64))


def gumbel_noise(seed: int, positions: Iterable[int], vocab_size: int) -> torch.Tensor:  # [n, vocab] float64
    """Standard Gumbel noise for each output position, on the CPU."""
    rows = []
    for position in positions:
        generator = torch.Generator().manual_seed(position_seed(seed, position))
        uniforms = torch.rand(vocab_size, generator=generator, dtype=torch.float64)  # [vocab] in [0, 1)
        rows.append(-torch.log(-torch.log(uniforms)))  # u = 0 gives -inf: that token is never chosen
    if not rows:
        return torch.empty(0, vocab_size, dtype=torch.float64)
    return torch.stack(rows)


def gumbel_argmax(
    probs: torch.Tensor,  # [n, vocab] (from logits_to_probs); zero-probability tokens can never win
    noise: torch.Tensor,  # [n, vocab] float64, from gumbel_noise
) -> torch.Tensor:  # [n] int64
    """The seeded token of each row: argmax(log probs + noise)."""
    scores = torch.log(probs.detach().to("cpu", torch.float64)) + noise  # [n, vocab]; log 0 = -inf
    return scores.argmax(dim=-1)


def seeded_tokens(probs: torch.Tensor, seed: int, positions: list[int]) -> torch.Tensor:  # [n] int64
    """`probs` [n, vocab]: the seeded token at each of `positions` (one per row)."""
    return gumbel_argmax(probs, gumbel_noise(seed, positions, probs.shape[-1]))
