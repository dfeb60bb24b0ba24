"""`--dtype` as vLLM names it: auto, float32, bfloat16, float16.

auto is the checkpoint's own dtype on a GPU and float32 on the CPU: CPU matmuls in half precision are slow on
most machines and the exactness bars there are set against fp32; bfloat16 on the CPU is there when asked for.
Exactness is always defined against transformers running the same dtype."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions: service configs read DTYPE_CHOICES before anything heavy loads.
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def checkpoint_dtype(name_or_path: str) -> torch.dtype:
    """The dtype the checkpoint's config declares (`dtype`, formerly `torch_dtype`); float32 when it names none
    or one we do not run (a quantised GGUF is de-quantised to float32)."""
    import torch

    from shared.model.loader import ModelSource, load_hf_config

    config = load_hf_config(ModelSource.resolve(name_or_path))
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(declared).removeprefix("torch.") if declared is not None else "float32"
    return getattr(torch, name) if name in ("bfloat16", "float16") else torch.float32


def resolve_dtype(choice: str, device: str, name_or_path: str) -> torch.dtype:
    import torch

    if choice not in DTYPE_CHOICES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {choice!r}")
    if choice != "auto":
        return getattr(torch, choice)
    if torch.device(device).type == "cpu":
        return torch.float32
    return checkpoint_dtype(name_or_path)


def fast_cpu_dtype() -> torch.dtype:
    """bfloat16 on a CPU that multiplies bf16 in hardware (AMX, AVX-512 BF16), else float32 (there bf16 products
    are fp32 ones plus conversions, no faster): for work whose precision cannot change the stack's output."""
    import torch

    from shared.model.parallel import half_kernels

    return torch.bfloat16 if half_kernels(torch.bfloat16) else torch.float32


def resolve_head_dtype(choice: str, device: str, target_name: str) -> torch.dtype:
    """--dtype of an EAGLE proposer: its head's weights and KV cache. A head's precision cannot change what the
    stack emits (every draft is verified exactly against the target, with the probabilities it was drawn from),
    only how often it is accepted, so auto takes the fast dtype: bfloat16 on a CPU that multiplies bf16 in
    hardware (AMX, AVX-512 BF16), where the committed head drafted as well as in fp32 (the same tokens per
    verify step, chains and trees) in 0.85-0.9x the time per step; float32 on other CPUs, where bf16 products are
    emulated; the target checkpoint's dtype on a GPU."""
    import torch

    if choice == "auto" and torch.device(device).type == "cpu":
        return fast_cpu_dtype()
    return resolve_dtype(choice, device, target_name)
