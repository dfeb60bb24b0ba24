"""The tensor-parallel seam: every weight matrix of the model goes through one of these layers.

At world_size 1 they are plain linear layers. At world_size N each rank keeps a slice: column-parallel
layers split output features (heads, MLP columns), row-parallel layers split input features and
all-reduce their partial sums, so a transformer block needs one all-reduce after attention and one
after the MLP. `load_full_weight` takes the unsharded checkpoint tensor and keeps this rank's slice,
so checkpoints never need resharding on disk.

Key/value heads: with fewer KV heads than ranks (GQA with a large TP degree) each KV head is replicated on
`world_size / num_kv_heads` consecutive ranks (vLLM's scheme), so every rank holds exactly one KV head and
the query heads that use it; `kv_head_replicas` computes the factor and refuses what cannot be split.
"""

from __future__ import annotations

import functools
import platform
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shared.model import mkl_product, tiles
from shared.model.cpuinfo import cpuinfo_field


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1
    group: Any = None

    def shard(self, full: int, what: str) -> int:
        if full % self.world_size:
            raise ValueError(
                f"cannot split the model across {self.world_size} tensor-parallel ranks: {what} = {full} is not "
                f"divisible by {self.world_size} (tensor-parallel sizes that divide it: {_divisors(full)})"
            )
        return full // self.world_size

    def kv_head_replicas(self, num_kv_heads: int) -> int:
        """How many ranks hold each KV head: 1 when the KV heads split evenly, world_size / num_kv_heads when
        there are fewer KV heads than ranks (then world_size must be a multiple of num_kv_heads)."""
        if num_kv_heads >= self.world_size:
            self.shard(num_kv_heads, "key/value heads")
            return 1
        if self.world_size % num_kv_heads:
            raise ValueError(
                f"cannot split the model across {self.world_size} tensor-parallel ranks: it has {num_kv_heads} "
                f"key/value heads, fewer than the ranks, so each is replicated and {self.world_size} must be a "
                f"multiple of {num_kv_heads}"
            )
        return self.world_size // num_kv_heads

    def local_kv_heads(self, num_kv_heads: int) -> int:
        """The KV heads each rank holds (the width of its KV cache)."""
        return num_kv_heads * self.kv_head_replicas(num_kv_heads) // self.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            if self.group is None:
                dist.all_reduce(x)  # the default process group
            else:  # a standalone group (shared/model/tp_group.py): no global torch.distributed state
                self.group.allreduce([x]).wait()
        return x


SINGLE = TensorParallel()


_ONEDNN = torch.backends.mkldnn.is_available()
# oneDNN picks its blocked weight layout for a row count. Over the default target's 121 weights in turn (one
# thread), a layout for 8 rows ran products of 1, 2, 5, 8, 16 and 40 rows at or below the plain weight's
# cost; layouts for 1, 5 and 16 rows were each slower at some of those counts. One row's result no longer
# depends on how many rows share the product (the layout fixes the order each output is accumulated in).
PACK_ROWS = 8
# With AMX oneDNN's bf16 kernel depends on the row count (where it must, `bf16_in_blocks`): it blocks the rows
# and the inputs differently for a few, up to ~32, and more rows, and shape by shape a row came out different in
# its last bit at 3-32 rows (the MLP's up projection), 1-32 (the LM head) or at almost any count (the down
# projection, 1536 wide), so a one-token step and a speculative step's scored rows could part at a near-tie. At
# a fixed row count a row's result depends neither on its place nor on the other rows, so these products run in
# blocks of exactly this many rows, the last one padded. Which counts part is the kernel's choice, not a rule:
# on another AMX host (oneDNN's ISA avx10_1_512_amx) calls of 1-32 rows agreed with each other and 33 or more
# did not; a fixed count holds on both. 16 rows is one AMX tile and costs what one row does:
# the target's forward (Xeon with AMX, 2 threads, `specdec_bench.packing_bench`) 29.5 ms at one row against
# 28.0 in one call of any size (fp32: 43 ms); the price is paid past 16 rows, where each block reads the weights
# again: 8 sequences scoring 5 tokens 70 against 49 ms (fp32 85), 264 rows (a prefill) 207 against 108 (fp32
# 303). Blocks of 64 rows cost 38 ms at one row, 54 ms for those 40 rows.
HALF_BLOCK_ROWS = 16


@functools.cache  # asked once per product; the CPU does not change
def bf16_in_blocks() -> bool:
    """Whether bf16 products through bf16-packed weights run in blocks of HALF_BLOCK_ROWS rows: everywhere but
    an x86 CPU with AVX-512 BF16 and no AMX. There (AMD EPYC, Zen 4, 2 threads and 1) a row's bf16 result was the
    same in calls of every count from 2 to 4,096 rows and at every place in the call, on each of the target's
    shapes, so those products run in one call, fewer than four rows given spare rows as in fp32
    (MIN_PRODUCT_ROWS; 1,536-wide inputs summed a lone row in another order there too), and pay no padding to 16:
    the target's 120 layer products took 14.7 / 13.5 / 20.7 / 28.4 ms for 1 / 8 / 24 / 40 rows in one call
    against 19.0 / 17.4 / 37.1 / 43.4 in blocks of 16 (and tiles.py's kernel takes those weights there unless
    SPECDEC_BF16_TILES=0). Elsewhere the blocks stay: measured row-dependent with AMX, not measured on
    AVX-NE-CONVERT or ARM's BF16."""
    if not _x86():
        return True
    return amx_tiles() or not _torch_cpu_has("_is_avx512_bf16_supported")


def half_kernels(dtype: torch.dtype) -> bool:
    """Whether oneDNN has product kernels of its own for this half dtype on this CPU (bf16: AVX-512 BF16, AMX or
    AVX-NE-CONVERT; fp16: AVX-512 FP16, AMX-FP16 or AVX-NE-CONVERT). Without them a bf16 or fp16 product is made
    of conversions to fp32 and fp32 multiply-adds whichever library does it."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and bf16_instructions()
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def bf16_instructions() -> bool:
    """Whether this CPU multiplies bf16 in hardware. oneDNN's own check (`_is_mkldnn_bf16_supported`) also says
    yes on any AVX-512 CPU (Skylake, Cascade Lake, Ice Lake servers), where its bf16 kernels emulate the
    products with shifts and fp32 multiply-adds: there the forward cost 1.30x the packed fp32 copy's at batch 8
    (one token a sequence), 1.37x / 2.03x scoring 5 tokens at batch 1 / 8 (Xeon, AVX-512 without BF16, 2 threads,
    `specdec_bench.packing_bench`), and a row's result depended on how many rows share the product. On x86 only
    AVX-512 BF16, AMX or AVX-NE-CONVERT count; elsewhere (ARM's BF16 extension) oneDNN's answer stands."""
    if not _x86():
        return True
    if _torch_cpu_has("_is_avx512_bf16_supported") or amx_tiles():
        return True
    return "avx_ne_convert" in _cpu_flags()


def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (torch.cpu's probe)."""
    return _torch_cpu_has("_is_amx_tile_supported")


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def _torch_cpu_has(probe: str) -> bool:
    """torch.cpu's ISA probe by name; False where this torch lacks it."""
    return bool(getattr(torch.cpu, probe, lambda: False)())


@functools.cache  # asked once per weight at load; the CPU does not change
def _cpu_flags() -> frozenset[str]:
    return frozenset(cpuinfo_field("flags").split())


HALF_DTYPES = (torch.bfloat16, torch.float16)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] reordered once, at load, into oneDNN's blocked layout: an opaque tensor that only
    `linear` reads. Left plain, oneDNN lays the weight out again inside every product of more than one row:
    over the default target's weights (one thread) 2 rows cost 2x one row, 5 rows 2.4x; packed, 1.3x and
    1.7x. In the whole forward at batch 1 (two threads) scoring 5 tokens went from 1.47x to 1.24x a one-token
    step (`specdec_bench.packing_bench`).

    A bf16 or fp16 weight is packed in its own dtype where oneDNN has kernels for it (`half_kernels`), else as
    fp32 holding the same values (each bf16 or fp16 number is exactly an fp32 one), for `linear` to multiply in
    fp32 and round once to the half dtype: what a half-precision product that accumulates in fp32 computes, at
    fp32's speed, where torch's own bf16 product of 5 and 8 rows cost 2.7x and 3.4x the packed fp32 one (AVX2,
    one thread, 30 copies of the 3072 x 576 MLP weight in turn). Weights `linear` would not send to oneDNN come
    back unchanged.

    On Intel CPUs an fp32 weight (or such an fp32 copy) is packed for MKL's sgemm instead (shared/model/mkl_product.py):
    its products cost 0.6-0.9x oneDNN's there. Where our own kernel multiplies a weight (`takes_tiles`) it is tiled
    for it (shared/model/tiles.py). Wrap the result with `packed_parameter`, not a bare Parameter."""
    if not (_ONEDNN and weight.dim() == 2 and weight.device.type == "cpu"):
        return weight
    if takes_tiles(weight):
        return tiles.pack(weight)
    if weight.dtype in HALF_DTYPES and half_kernels(weight.dtype):
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
    if weight.dtype == torch.float32 or weight.dtype in HALF_DTYPES:
        fp32 = weight.detach().float()
        if takes_tiles(fp32):
            return tiles.pack(fp32)
        packed = mkl_product.pack(fp32) if mkl_product.available() else None
        return packed if packed is not None else torch.ops.mkldnn._reorder_linear_weight(fp32, PACK_ROWS)
    return weight


def takes_tiles(weight: torch.Tensor) -> bool:
    """Whether our kernel (tiles.py) multiplies this weight: bf16 on an x86 CPU with AVX-512 BF16 and no AMX (0.6-0.7x
    oneDNN's time at 1-8 rows on Zen 4), fp32 on a CPU with AVX-512 that is not Intel's, whose fp32 products MKL's
    packed sgemm does not make (on Zen 4 0.64x / 0.64x / 0.85x oneDNN's time at 1 / 8 / 40 rows: docs/BENCHMARKS.md).
    Intel's keep MKL's, measured there; AMX hosts keep oneDNN's bf16 blocks and the compiled graph's templates."""
    if not tiles.fits(weight):
        return False
    if weight.dtype == torch.bfloat16:
        return not amx_tiles() and tiles.enabled(torch.bfloat16)
    return not mkl_product.intel_cpu() and tiles.enabled(torch.float32)


def packed_parameter(weight: torch.Tensor) -> torch.nn.Parameter:
    """pack_weight's result as a module's Parameter (which is a new tensor object: an MKL-packed weight's origin
    view goes with it)."""
    packed = pack_weight(weight)
    return mkl_product.carry_origin(packed, torch.nn.Parameter(packed, requires_grad=False))


def out_features(weight: torch.Tensor) -> int:
    """A weight's output width, plain or packed (an MKL-packed tensor's own shape is its buffer's)."""
    if tiles.is_packed(weight):
        return tiles.out_features(weight)
    origin = getattr(weight, mkl_product.ORIGIN, None)
    return int((weight if origin is None else origin).shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, but on CPU through oneDNN rather than MKL. For the 2-16 rows of a speculative scoring
    step (k + 1 tokens per sequence) MKL's sgemm ran 2-3x slower per row than at one row, oneDNN close to
    one row's cost, which is what makes scoring k + 1 tokens nearly as cheap as one. At one row (plain
    decoding) oneDNN also beat MKL's gemv, by 1.4-1.6x over the model's 121 weight matrices in turn (each
    read from memory, as in a real step); only a single weight hot in cache favours MKL. Both accumulate
    in fp32. A weight from `pack_weight` goes to oneDNN whatever the shape of `x`, or where it was packed for
    MKL's packed sgemm (Intel CPUs, mkl_product.py), which is not MKL's plain product, to that; a half-precision
    `x` on an fp32-packed weight is multiplied in fp32 and the result rounded to `x`'s dtype. A weight tiled for our
    kernel (tiles.py) goes to it, whatever the row count: its rows need no spare ones."""
    tiled = tiles.is_packed(weight)
    if (tiled or weight.is_mkldnn) and x.dim() != 2:  # the EAGLE head's [batch, seq, hidden]; the target's are 2-D
        return linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], -1)
    if tiled:
        return tiles.product(x, weight, bias)
    if weight.is_mkldnn:
        rows = x.contiguous()
        origin = getattr(weight, mkl_product.ORIGIN, None)
        if origin is not None:  # every row count in one call: MKL's packed rows do not depend on it
            return mkl_product.product(rows, weight, origin, bias)
        if rows.dtype == weight.dtype == torch.bfloat16 and bf16_in_blocks():
            return _bf16_in_blocks(rows, weight, bias)
        num_rows = rows.shape[0]
        if num_rows < MIN_PRODUCT_ROWS:
            rows = _with_spare_rows(rows)
        if rows.dtype == weight.dtype:
            out = onednn_product(rows, weight, bias)
        else:
            fp32_bias = None if bias is None else bias.float()
            out = onednn_product(rows.float(), weight, fp32_bias).to(x.dtype)
        return out[:num_rows] if num_rows < MIN_PRODUCT_ROWS else out
    if _ONEDNN and x.dim() == 2 and x.device.type == "cpu" and x.dtype == torch.float32:
        return onednn_product(x, weight, bias)
    return F.linear(x, weight, bias)


# A product through a packed weight gets at least this many rows, the spare ones copies of the first (dropped).
# oneDNN multiplies one row with another kernel than several, and for inputs wider than ~1K (the MLP's down
# projection, 1536) it sums in another order: a one-token step's logits differed in the last bits from the same
# position scored among k + 1 rows (Xeon, AMX; Zen 4 too, bf16). And on an AMD EPYC (Zen 4, 2 threads) two
# or three rows cost more than four: the target's 120 layer products 24.3 / 20.5 / 18.9 ms at 2 / 3 / 4 rows in
# fp32, 13.9 / 11.8 / 11.4 in bf16, the LM head 4.9 / 3.5 / 3.1 and 2.8 / 2.3 / 2.1 ms; on the Xeon two rows cost
# what one did. Four rows make a one-token step at batch 1 or 2 what a step of four rows costs.
MIN_PRODUCT_ROWS = 4


def _with_spare_rows(rows: torch.Tensor) -> torch.Tensor:
    """rows [n < MIN_PRODUCT_ROWS, in] -> [MIN_PRODUCT_ROWS, in], the first n rows first: a row's result does not
    depend on the other rows of a product (tests/unit/test_packed_linear.py), so the spare rows repeat row 0."""
    spare = rows[:1].expand(MIN_PRODUCT_ROWS - rows.shape[0], -1)
    return torch.cat([rows, spare]) if rows.shape[0] > 1 else rows.expand(MIN_PRODUCT_ROWS, -1)


def onednn_product(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [n, in] @ weight.T (+ bias) -> [n, out] in one oneDNN call, no fused activation; weight plain or packed."""
    return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")


def _bf16_in_blocks(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [n, in] through a bf16-packed weight in products of exactly HALF_BLOCK_ROWS rows -> [n, out]."""
    num_rows = rows.shape[0]
    if num_rows <= HALF_BLOCK_ROWS:
        return onednn_product(_padded_block(rows), weight, bias)[:num_rows]
    # Whole blocks are views of the input; only the last, partial one is copied into a padded block.
    whole = num_rows - num_rows % HALF_BLOCK_ROWS
    blocks = list(rows[:whole].split(HALF_BLOCK_ROWS))
    if whole < num_rows:
        blocks.append(_padded_block(rows[whole:]))
    out = torch.cat([onednn_product(block, weight, bias) for block in blocks])
    return out[:num_rows]


# Per thread (a service may run forwards on several), by width, dtype and inference mode (an inference tensor
# cannot be written outside it).
_padding = threading.local()


def _padded_block(rows: torch.Tensor) -> torch.Tensor:
    """rows [n <= HALF_BLOCK_ROWS, in] as the first n rows of a block of HALF_BLOCK_ROWS [16, in], kept per thread
    and width and overwritten by the next call. F.pad allocated and zero-filled a new block for each of a step's
    121 products: 3-4% of a one-token bf16 step (Xeon with AMX, 2 threads). The rows past n hold zeros or an earlier
    product's rows: a row's result does not depend on the other rows of its block (tests/unit/test_packed_linear.py)."""
    blocks: dict[tuple[int, torch.dtype, bool], torch.Tensor] | None = getattr(_padding, "blocks", None)
    if blocks is None:
        blocks = _padding.blocks = {}
    key = (rows.shape[1], rows.dtype, torch.is_inference_mode_enabled())
    block = blocks.get(key)
    if block is None:
        block = blocks[key] = rows.new_zeros(HALF_BLOCK_ROWS, rows.shape[1])
    block[: rows.shape[0]].copy_(rows)
    return block


def pack_linears(module: torch.nn.Module) -> None:
    """Every Column/RowParallelLinear under `module` switched to its packed weight (after loading: a packed
    weight cannot be loaded into)."""
    for layer in module.modules():
        if isinstance(layer, ColumnParallelLinear | RowParallelLinear):
            layer.weight = packed_parameter(layer.weight.data)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


class ColumnParallelLinear(torch.nn.Module):
    """y = x W^T with W's output rows split across ranks. `out_features` lists the parts that are
    split separately and concatenated (e.g. [q, k, v] or [gate, up]) so fused layers shard correctly.
    `replicas[i]` > 1 means part i is cut into world_size / replicas[i] slices, each held by that many
    consecutive ranks (replicated KV heads); the default 1 gives every rank its own slice."""

    def __init__(
        self,
        in_features: int,
        out_features: list[int],
        bias: bool,
        tp: TensorParallel = SINGLE,
        replicas: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.full_parts = out_features
        self.replicas = replicas or [1] * len(out_features)
        for r in self.replicas:
            if r < 1 or tp.world_size % r:
                raise ValueError(f"replication {r} does not divide the tensor-parallel size {tp.world_size}")
        self.parts = [tp.shard(n * r, "output features") for n, r in zip(out_features, self.replicas, strict=True)]
        self.weight = torch.nn.Parameter(torch.empty(sum(self.parts), in_features), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(sum(self.parts)), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def load_full_weight(self, parts: list[torch.Tensor], bias_parts: list[torch.Tensor] | None = None) -> None:
        self.weight.copy_(torch.cat([self._slice(p, i) for i, p in enumerate(parts)]))
        if self.bias is not None and bias_parts is not None:
            self.bias.copy_(torch.cat([self._slice(b, i) for i, b in enumerate(bias_parts)]))

    def _slice(self, full: torch.Tensor, part: int) -> torch.Tensor:
        shard, index = self.parts[part], self.tp.rank // self.replicas[part]
        return full[index * shard : (index + 1) * shard]


class RowParallelLinear(torch.nn.Module):
    """y = x W^T with W's input columns split across ranks; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.shard = tp.shard(in_features, "input features")
        self.weight = torch.nn.Parameter(torch.empty(out_features, self.shard), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(linear(x, self.weight))
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
