"""The tensor-parallel seam: every weight matrix of the model goes through one of these layers.

At world_size 1 they are plain linear layers. At world_size N each rank keeps a slice: column-parallel
layers split output features (heads, MLP columns), row-parallel layers split input features and
all-reduce their partial sums, so a transformer block needs one all-reduce after attention and one
after the MLP. `load_full_weight` takes the unsharded checkpoint tensor and keeps this rank's slice,
so checkpoints never need resharding on disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1
    group: Any = None

    def shard(self, full: int, what: str) -> int:
        if full % self.world_size:
            raise ValueError(f"{what} ({full}) is not divisible by the tensor-parallel size {self.world_size}")
        return full // self.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x


SINGLE = TensorParallel()


class ColumnParallelLinear(torch.nn.Module):
    """y = x W^T with W's output rows split across ranks. `out_features` lists the parts that are
    split separately and concatenated (e.g. [q, k, v] or [gate, up]) so fused layers shard correctly."""

    def __init__(self, in_features: int, out_features: list[int], bias: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.full_parts = out_features
        self.parts = [tp.shard(n, "output features") for n in out_features]
        self.weight = torch.nn.Parameter(torch.empty(sum(self.parts), in_features), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(sum(self.parts)), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load_full_weight(self, parts: list[torch.Tensor], bias_parts: list[torch.Tensor] | None = None) -> None:
        self.weight.copy_(torch.cat([self._slice(p, n) for p, n in zip(parts, self.parts, strict=True)]))
        if self.bias is not None and bias_parts is not None:
            self.bias.copy_(torch.cat([self._slice(b, n) for b, n in zip(bias_parts, self.parts, strict=True)]))

    def _slice(self, full: torch.Tensor, shard: int) -> torch.Tensor:
        return full[self.tp.rank * shard : (self.tp.rank + 1) * shard]


class RowParallelLinear(torch.nn.Module):
    """y = x W^T with W's input columns split across ranks; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.shard = tp.shard(in_features, "input features")
        self.weight = torch.nn.Parameter(torch.empty(out_features, self.shard), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias  # bias once, after the reduction

    def load_full_weight(self, full: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight.copy_(full[:, self.tp.rank * self.shard : (self.tp.rank + 1) * self.shard])
        if self.bias is not None:
            # A checkpoint without this bias (Qwen2: q/k/v have biases, o_proj has none) means zero; the
            # parameter itself was made on the meta device and holds no values until set here.
            if bias is None:
                self.bias.zero_()
            else:
                self.bias.copy_(bias)
