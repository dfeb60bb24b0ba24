"""RMSNorm through small_ops_kernel.cpp: torch's values (to an fp32 rounding), a row's bits whatever rows and threads
share the call, and torch's ops wherever the kernel must not run."""

from __future__ import annotations

import pytest
import torch

from shared.model import small_ops
from shared.model.llama import RMSNorm

pytestmark = pytest.mark.skipif(small_ops.load_kernel() is None, reason="no C++ compiler: RMSNorm runs as torch ops")


def torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's torch ops, as llama.RMSNorm runs them without the kernel."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rows_and_weight(dtype: torch.dtype, rows: int, width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator) * 3 + 0.5
    return x.to(dtype), torch.randn(width, generator=generator).to(dtype)


@pytest.mark.parametrize("width", [576, 577, 15, 1])  # the target's, a tail past the 16 lanes, lanes only in part
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_gives_torchs_values(dtype, width):
    """Within one rounding of the last step in fp32 (the sum of squares runs in another order); bf16 rows round to
    bf16 where torch's ops do, so they differ from them by at most one bf16 unit, and rarely."""
    x, weight = rows_and_weight(dtype, 40, width)
    fast, reference = small_ops.rms_norm(x, weight, 1e-5), torch_norm(x, weight, 1e-5)
    assert fast.dtype == dtype and fast.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(fast, reference, rtol=1e-6, atol=1e-6)
    else:
        unit = torch.finfo(torch.bfloat16).eps * reference.float().abs().clamp_min(1e-30)
        assert bool(((fast.float() - reference.float()).abs() <= unit).all())
        assert (fast != reference).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_or_the_threads(dtype):
    """What speculative scoring needs of every op: the row a one-token step normalises alone and the same row among
    a scoring call's 40, or a prefill chunk's 64 shared by threads, are the same bits."""
    x, weight = rows_and_weight(dtype, 64, 576, seed=1)
    together = small_ops.rms_norm(x, weight, 1e-6)
    alone = torch.cat([small_ops.rms_norm(x[i : i + 1], weight, 1e-6) for i in range(64)])
    assert torch.equal(together, alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = small_ops.rms_norm(x, weight, 1e-6)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, one_thread)
    assert torch.equal(small_ops.rms_norm(x.view(8, 8, 576), weight, 1e-6).view(64, 576), together)  # any leading dims


def test_the_module_runs_the_kernel_and_torchs_ops_where_the_kernel_must_not(monkeypatch):
    norm = RMSNorm(576, 1e-5)
    x, norm.weight.data = rows_and_weight(torch.float32, 8, 576, seed=2)
    assert torch.equal(norm(x), small_ops.rms_norm(x, norm.weight, 1e-5))
    assert not torch.equal(norm(x), torch_norm(x, norm.weight, 1e-5))  # this x: the kernel's bits, not the ops'
    wants_grad = x.clone().requires_grad_()
    out = norm(wants_grad)  # the head's trainer: autograd through torch's ops
    out.sum().backward()
    assert wants_grad.grad is not None and torch.equal(out.detach(), torch_norm(x, norm.weight, 1e-5))
    assert torch.equal(norm(x.double()), torch_norm(x.double(), norm.weight.double(), 1e-5).to(torch.float64))
    assert not small_ops.takes_norm(x, norm.weight.bfloat16())  # a weight of another dtype
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # traced: the graph fuses the norm itself
    assert torch.equal(norm(x), torch_norm(x, norm.weight, 1e-5))


def test_the_switch_keeps_torchs_ops(monkeypatch):
    x, weight = rows_and_weight(torch.float32, 4, 576)
    monkeypatch.setenv(small_ops.NORM_SWITCH, "0")
    small_ops.enabled.cache_clear()
    try:
        assert not small_ops.takes_norm(x, weight)
    finally:
        monkeypatch.delenv(small_ops.NORM_SWITCH)
        small_ops.enabled.cache_clear()
    assert small_ops.takes_norm(x, weight)
