"""Target hidden states on the wire (ProposeSequence.target_features): packed bytes with shape and dtype.

fp16 halves the bytes of fp32 and keeps the features' ~3 significant digits, which is all a draft head
needs (a draft only ever costs acceptance, never a token)."""

from __future__ import annotations

import numpy as np
import torch

from shared.proto_gen.specdec.v1 import proposer_pb2

DTYPES: dict[int, torch.dtype] = {
    proposer_pb2.FEATURE_DTYPE_FLOAT16: torch.float16,
    proposer_pb2.FEATURE_DTYPE_BFLOAT16: torch.bfloat16,
    proposer_pb2.FEATURE_DTYPE_FLOAT32: torch.float32,
}


def features_to_proto(start: int, features: torch.Tensor, dtype: int) -> proposer_pb2.TargetFeatures:
    """features [rows, hidden] at positions start.. -> message, converted to `dtype` (a FeatureDtype; fp16
    when unset or unknown)."""
    wire_dtype = proposer_pb2.FeatureDtype.ValueType(dtype if dtype in DTYPES else proposer_pb2.FEATURE_DTYPE_FLOAT16)
    rows, hidden = features.shape
    data = features.detach().to("cpu", DTYPES[wire_dtype]).contiguous().view(torch.uint8).numpy().tobytes()
    return proposer_pb2.TargetFeatures(start_position=start, rows=rows, hidden_size=hidden, dtype=wire_dtype, data=data)


def features_from_proto(msg: proposer_pb2.TargetFeatures, hidden_size: int) -> tuple[int, torch.Tensor]:
    """(start, features [rows, hidden] fp32). Raises ValueError for a block that does not describe itself
    consistently or holds non-finite values."""
    torch_dtype = DTYPES.get(msg.dtype)
    if torch_dtype is None:
        raise ValueError(f"unknown feature dtype {msg.dtype}")
    if msg.hidden_size != hidden_size:
        raise ValueError(f"features have {msg.hidden_size} values per row, the head reads {hidden_size}")
    itemsize = torch.finfo(torch_dtype).bits // 8
    if len(msg.data) != msg.rows * msg.hidden_size * itemsize:
        raise ValueError(f"{len(msg.data)} feature bytes for {msg.rows} x {msg.hidden_size} {torch_dtype} values")
    # Widened and checked in numpy, not torch: on a block of more than 32,768 values torch runs an OpenMP team on
    # the calling thread (the proposer's event loop), a second one beside the drafter's (proposer_service/server.py).
    if torch_dtype == torch.bfloat16:  # numpy has no bf16: its bits are the high half of an fp32's
        wide = (np.frombuffer(msg.data, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        wide = np.frombuffer(msg.data, dtype=np.float16 if torch_dtype == torch.float16 else np.float32)
        wide = wide.astype(np.float32)  # a writable copy, widened
    if not np.isfinite(wide).all():
        raise ValueError("features hold non-finite values")
    return msg.start_position, torch.from_numpy(wide).view(msg.rows, msg.hidden_size)
