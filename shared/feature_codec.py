"""Target hidden states on the wire (ProposeSequence.target_features): packed bytes with shape and dtype.

fp16 halves the bytes of fp32 and keeps the features' ~3 significant digits, which is all a draft head
needs (a draft only ever costs acceptance, never a token)."""

from __future__ import annotations

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
    raw = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8) if msg.data else torch.empty(0, dtype=torch.uint8)
    features = raw.view(torch_dtype).view(msg.rows, msg.hidden_size).float()
    if not bool(torch.isfinite(features).all()):
        raise ValueError("features hold non-finite values")
    return msg.start_position, features
