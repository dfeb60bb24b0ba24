"""The MLP's SiLU(gate) * up and the residual add before each norm, through small_ops_kernel.cpp: torch's values (the
SiLU to two fp32 units, the add and norm to the bit), a row's bits whatever rows and threads share the call, and
torch's ops wherever the kernel must not run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.model import small_ops
from shared.model.llama import MLP, RMSNorm
from tests.tiny import default_width_model

pytestmark = pytest.mark.skipif(small_ops.load_kernel() is None, reason="no C++ compiler: the MLP runs torch's ops")


def gate_up_rows(dtype: torch.dtype, rows: int, width: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2 * width, generator=generator) * 4).to(dtype)


def torch_silu_mul(gate_up: torch.Tensor, width: int) -> torch.Tensor:
    gate, up = gate_up.split([width, width], dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("width", [1536, 1537, 7])  # the target's, a tail past the vector loop, a tail alone
def test_silu_mul_gives_torchs_values(width):
    """fp32: Cephes' exp where torch runs SLEEF's, so a few elements differ by an fp32 unit or two; bf16: the SiLU and
    the product each rounded to bf16 where the two ops round them, which hides that difference on these rows."""
    gate_up = gate_up_rows(torch.float32, 40, width)
    fast, reference = small_ops.silu_mul(gate_up, width), torch_silu_mul(gate_up, width)
    assert fast.shape == (40, width) and fast.dtype == torch.float32
    units = (fast - reference).abs() / (torch.finfo(torch.float32).eps * reference.abs().clamp_min(1e-30))
    assert units.max() <= 2.5 and (fast != reference).float().mean() < 0.05
    half = gate_up.bfloat16()
    assert torch.equal(small_ops.silu_mul(half, width), torch_silu_mul(half, width))


def test_silu_mul_over_the_whole_float_range():
    """Where exp leaves the normal floats (past -88.7 and 88.7, among the subnormals, infinities, NaN), the kernel's
    SiLU is torch's: a gate's exp applied in two halves never overflows early or flushes to zero."""
    gates = [0.0, -0.0, 1e-30, -1e-30, 5.0, -5.0, 20.0, -20.0, 87.0, -87.0, 88.7, -88.7, 88.75, -88.75, 89.0, -89.0]
    gates += [103.0, -103.0, 104.0, -104.0, 150.0, -150.0, 1e38, -1e38, float("inf"), float("-inf"), float("nan")]
    gate = torch.tensor([gates])
    fast = small_ops.silu_mul(torch.cat([gate, torch.ones_like(gate)], dim=-1), gate.shape[1])
    torch.testing.assert_close(fast, F.silu(gate), rtol=3e-7, atol=0.0, equal_nan=True)
    assert torch.equal(fast.signbit(), F.silu(gate).signbit())  # -0.0 where torch has -0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_activation_does_not_depend_on_the_rows_beside_it_or_the_threads(dtype):
    gate_up = gate_up_rows(dtype, 64, 1536, seed=1)
    together = small_ops.silu_mul(gate_up, 1536)  # 64 rows: shared among threads
    alone = torch.cat([small_ops.silu_mul(gate_up[i : i + 1], 1536) for i in range(64)])
    assert torch.equal(together, alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(small_ops.silu_mul(gate_up, 1536), together)
    finally:
        torch.set_num_threads(threads)
    wide = torch.cat([gate_up, torch.zeros(64, 8, dtype=dtype)], dim=-1)[:, : 2 * 1536]  # rows with a longer stride
    assert torch.equal(small_ops.silu_mul(wide, 1536), together)


@pytest.mark.parametrize("rows", [3, 64])  # a decoding step's, and a prefill chunk's shared among threads
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_and_norm_is_the_add_then_the_norm_to_the_bit(dtype, rows):
    generator = torch.Generator().manual_seed(2)
    x, delta = (torch.randn(rows, 576, generator=generator).to(dtype) for _ in range(2))
    weight = torch.randn(576, generator=generator).to(dtype)
    total, normed = small_ops.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta)
    assert torch.equal(normed, small_ops.rms_norm(x + delta, weight, 1e-5))
    with pytest.raises(ValueError, match="cannot add"):
        small_ops.add_rms_norm(x, delta[:1], weight, 1e-5)


def test_the_modules_run_the_kernel_and_torchs_ops_where_it_must_not(monkeypatch):
    model, arch = default_width_model(torch.float32)
    mlp: MLP = model.layers[0].mlp  # type: ignore[assignment]
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        gate_up = mlp.gate_up_proj(x)
        fast = mlp(x)
        assert torch.equal(fast, mlp.down_proj(small_ops.silu_mul(gate_up, arch.intermediate_size)))
        assert not torch.equal(fast, mlp.down_proj(torch_silu_mul(gate_up, arch.intermediate_size)))
    norm = RMSNorm(576, 1e-5)
    delta = torch.randn_like(x)
    total, normed = norm.add_and_norm(x, delta)
    assert torch.equal(total, x + delta) and torch.equal(normed, norm(x + delta))
    assert norm.add_and_norm(x, None)[0] is x
    wants_grad = delta.clone().requires_grad_()  # the head's trainer: autograd through torch's ops
    total, normed = norm.add_and_norm(x, wants_grad)
    normed.sum().backward()
    assert wants_grad.grad is not None and torch.equal(total.detach(), x + delta)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # traced: the graph fuses these itself
    assert not small_ops.takes_silu(gate_up) and not small_ops.takes_add_norm(x, delta, norm.weight)


def test_the_switch_keeps_torchs_silu(monkeypatch):
    gate_up = gate_up_rows(torch.float32, 4, 16)
    monkeypatch.setenv(small_ops.SILU_SWITCH, "0")
    small_ops.enabled.cache_clear()
    try:
        assert not small_ops.takes_silu(gate_up)
    finally:
        monkeypatch.delenv(small_ops.SILU_SWITCH)
        small_ops.enabled.cache_clear()
    assert small_ops.takes_silu(gate_up)
