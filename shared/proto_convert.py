"""SamplingParams <-> specdec.v1.SamplingParams, written once for every hop that carries them."""

from __future__ import annotations

from typing import Any

from shared.grammar import StructuredOutput
from shared.proto_gen.specdec.v1 import common_pb2
from shared.sampling import SamplingParams

_DEFAULTS = SamplingParams()


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """The sampling fields only (max_tokens, stop ids and ignore_eos travel beside them); no seed: unset."""
    msg = common_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.structured_output is not None:
        msg.structured_output.CopyFrom(structured_output_to_proto(params.structured_output))
    return msg


def sampling_params_from_proto(msg: common_pb2.SamplingParams, **overrides: Any) -> SamplingParams:
    """Unset fields take the defaults of shared/sampling.py (seed unset: None). `overrides` sets the fields
    that are not in the message (max_tokens, stop_token_ids, ignore_eos)."""
    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else _DEFAULTS.temperature,
        top_k=msg.top_k if msg.HasField("top_k") else _DEFAULTS.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else _DEFAULTS.top_p,
        min_p=msg.min_p if msg.HasField("min_p") else _DEFAULTS.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        structured_output=structured_output_from_proto(msg.structured_output)
        if msg.HasField("structured_output")
        else None,
        **overrides,
    )


def structured_output_to_proto(constraint: StructuredOutput) -> common_pb2.StructuredOutput:
    if constraint.kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    msg = common_pb2.StructuredOutput()
    setattr(msg, constraint.kind, constraint.spec)
    return msg


def structured_output_from_proto(msg: common_pb2.StructuredOutput) -> StructuredOutput | None:
    """None when no format is set (or json_object is false)."""
    kind = msg.WhichOneof("format")
    if kind is None or (kind == "json_object" and not msg.json_object):
        return None
    return StructuredOutput(kind, "" if kind == "json_object" else getattr(msg, kind))
