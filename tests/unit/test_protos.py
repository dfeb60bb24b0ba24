"""The specdec.v1 contract: generated code imports, round-trips and stays fresh."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from shared.proto_convert import sampling_params_from_proto, sampling_params_to_proto
from shared.proto_gen.specdec.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    proposer_pb2,
    proposer_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from shared.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def _method_kinds(service) -> dict[str, tuple[str, str, bool, bool]]:
    """Full method path -> (input, output, client_streaming, server_streaming)."""
    out = {}
    for m in service.methods:
        proto = descriptor_pb2.MethodDescriptorProto()
        m.CopyToProto(proto)
        out[f"/{service.full_name}/{m.name}"] = (
            m.input_type.full_name,
            m.output_type.full_name,
            proto.client_streaming,
            proto.server_streaming,
        )
    return out


def test_public_gateway_methods():
    service = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"]
    assert service.full_name == "specdec.v1.Gateway"
    kinds = _method_kinds(service)
    assert kinds["/specdec.v1.Gateway/Generate"] == (
        "specdec.v1.GenerateRequest",
        "specdec.v1.GenerateResponse",
        False,
        True,
    )
    assert kinds["/specdec.v1.Gateway/Complete"] == (
        "specdec.v1.CompleteRequest",
        "specdec.v1.CompleteResponse",
        False,
        False,
    )
    assert "/specdec.v1.Gateway/GetStats" in kinds


def test_internal_service_methods():
    verifier = _method_kinds(verifier_pb2.DESCRIPTOR.services_by_name["Verifier"])
    assert verifier["/specdec.v1.Verifier/Generate"][2:] == (False, True)
    assert verifier["/specdec.v1.Verifier/GetStats"][2:] == (False, False)
    proposer = _method_kinds(proposer_pb2.DESCRIPTOR.services_by_name["Proposer"])
    assert proposer["/specdec.v1.Proposer/Propose"] == (
        "specdec.v1.ProposeRequest",
        "specdec.v1.ProposeResponse",
        True,
        True,
    )
    assert proposer["/specdec.v1.Proposer/GetInfo"][2:] == (False, False)


class _RecordingChannel:
    """Stands in for grpc.Channel: records the method paths a stub registers."""

    def __init__(self) -> None:
        self.paths: dict[str, str] = {}

    def _record(self, kind: str):
        def register(path, *args, **kwargs):
            self.paths[path] = kind
            return object()

        return register

    def __getattr__(self, kind: str):
        if kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            return self._record(kind)
        raise AttributeError(kind)


def test_stubs_use_the_public_paths():
    channel = _RecordingChannel()
    gateway_pb2_grpc.GatewayStub(channel)
    verifier_pb2_grpc.VerifierStub(channel)
    proposer_pb2_grpc.ProposerStub(channel)
    assert channel.paths["/specdec.v1.Gateway/Generate"] == "unary_stream"
    assert channel.paths["/specdec.v1.Gateway/Complete"] == "unary_unary"
    assert channel.paths["/specdec.v1.Verifier/Generate"] == "unary_stream"
    assert channel.paths["/specdec.v1.Verifier/GetStats"] == "unary_unary"
    assert channel.paths["/specdec.v1.Proposer/Propose"] == "stream_stream"
    assert channel.paths["/specdec.v1.Proposer/GetInfo"] == "unary_unary"


def test_generated_classes_live_in_the_shared_package():
    assert proposer_pb2.ProposeRequest.__module__ == "shared.proto_gen.specdec.v1.proposer_pb2"
    assert common_pb2.SamplingParams.__module__ == "shared.proto_gen.specdec.v1.common_pb2"


def test_propose_request_round_trip():
    req = proposer_pb2.ProposeRequest(
        step_id=2**40 + 7,
        sequences=[
            proposer_pb2.ProposeSequence(
                seq_id="req-1",
                committed_len=5,
                new_token_ids=[1, 15043, 29892, 3186, 29991],
                full_sequence=True,
                k=4,
                sampling_params=common_pb2.SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, seed=1234),
            ),
            proposer_pb2.ProposeSequence(
                seq_id="req-2",
                committed_len=103,
                new_token_ids=[42, 43],
                k=0,
                sampling_params=common_pb2.SamplingParams(temperature=0.0),
            ),
        ],
        release_seq_ids=["req-0", "req-9"],
    )
    back = proposer_pb2.ProposeRequest.FromString(req.SerializeToString())
    assert back == req
    assert back.step_id == 2**40 + 7
    assert list(back.sequences[0].new_token_ids) == [1, 15043, 29892, 3186, 29991]
    assert back.sequences[0].full_sequence and not back.sequences[1].full_sequence
    assert back.sequences[0].sampling_params.seed == 1234
    assert back.sequences[0].sampling_params.top_p == pytest.approx(0.9)
    # temperature 0 was set explicitly (greedy) and is distinguishable from unset
    assert back.sequences[1].sampling_params.HasField("temperature")
    assert back.sequences[1].sampling_params.temperature == 0.0
    assert not back.sequences[1].sampling_params.HasField("seed")
    assert list(back.release_seq_ids) == ["req-0", "req-9"]


def test_sampling_params_conversion_round_trips_and_fills_defaults():
    params = SamplingParams(temperature=0.5, top_k=7, top_p=0.75, min_p=0.125, seed=2**40 + 3)
    msg = sampling_params_to_proto(params)
    assert sampling_params_from_proto(common_pb2.SamplingParams.FromString(msg.SerializeToString())) == params
    # No seed: the field stays unset (not 0) and comes back as None; greedy 0.0 is sent explicitly.
    unseeded = sampling_params_to_proto(SamplingParams())
    assert not unseeded.HasField("seed") and unseeded.HasField("temperature")
    assert sampling_params_from_proto(unseeded).seed is None
    # Unset fields take SamplingParams' defaults; the fields outside the message come as overrides.
    back = sampling_params_from_proto(
        common_pb2.SamplingParams(top_k=3), max_tokens=9, stop_token_ids=(1, 2), ignore_eos=True
    )
    assert back == SamplingParams(top_k=3, max_tokens=9, stop_token_ids=(1, 2), ignore_eos=True)


def test_propose_response_round_trip_with_packed_probs():
    # Two draft positions: a sparse top-3 distribution, then a top-2 one.
    draft = proposer_pb2.Draft(
        seq_id="req-1",
        committed_len=5,
        draft_token_ids=[318, 257],
        draft_prob_token_ids=[318, 11, 262, 257, 1169],
        draft_probs=[0.5, 0.3, 0.2, 0.75, 0.25],
        draft_prob_counts=[3, 2],
    )
    resync = proposer_pb2.Draft(seq_id="req-2", committed_len=103, needs_resync=True)
    resp = proposer_pb2.ProposeResponse(step_id=9, drafts=[draft, resync])
    back = proposer_pb2.ProposeResponse.FromString(resp.SerializeToString())
    assert back == resp
    d = back.drafts[0]
    assert list(d.draft_token_ids) == [318, 257]
    assert list(d.draft_prob_counts) == [3, 2]
    assert sum(d.draft_prob_counts) == len(d.draft_probs) == len(d.draft_prob_token_ids)
    assert list(d.draft_probs) == pytest.approx([0.5, 0.3, 0.2, 0.75, 0.25])
    # Unflatten: each position's distribution contains its drafted token.
    start = 0
    for tok, n in zip(d.draft_token_ids, d.draft_prob_counts, strict=True):
        ids = list(d.draft_prob_token_ids[start : start + n])
        probs = list(d.draft_probs[start : start + n])
        assert tok in ids
        assert sum(probs) == pytest.approx(1.0)
        start += n
    assert back.drafts[1].needs_resync and not back.drafts[1].draft_token_ids


def test_float_and_id_arrays_are_packed():
    n = 1000
    only_probs = proposer_pb2.Draft(draft_probs=[0.001] * n).SerializeToString()
    # packed: 1 tag byte + varint length (2 bytes) + 4 bytes per float; unpacked would be 5 per float
    assert len(only_probs) == 4 * n + 3
    only_ids = proposer_pb2.Draft(draft_prob_token_ids=[100] * n).SerializeToString()
    assert len(only_ids) == n + 3  # one byte per small id, one tag for the whole array


def test_optional_sampling_fields_distinguish_unset_from_zero():
    req = gateway_pb2.GenerateRequest(prompt="Hello")
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "max_draft_tokens"):
        assert not req.HasField(name), name
    req.temperature = 0.0
    req.seed = 0
    back = gateway_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back.HasField("temperature") and back.temperature == 0.0
    assert back.HasField("seed") and back.seed == 0


def test_complete_request_is_wire_compatible_with_generate_request():
    def fields(msg):
        proto = descriptor_pb2.DescriptorProto()
        msg.DESCRIPTOR.CopyToProto(proto)
        return [(f.name, f.number, f.type, f.label, f.proto3_optional, f.type_name, f.json_name) for f in proto.field]

    assert fields(gateway_pb2.CompleteRequest) == fields(gateway_pb2.GenerateRequest)
    req = gateway_pb2.CompleteRequest(
        prompt_token_ids=[1, 2, 3], max_tokens=16, temperature=0.0, stop=["\n\n"], session_id="s"
    )
    as_generate = gateway_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert list(as_generate.prompt_token_ids) == [1, 2, 3]
    assert as_generate.HasField("temperature") and as_generate.max_tokens == 16
    assert list(as_generate.stop) == ["\n\n"] and as_generate.session_id == "s"


def test_final_responses_carry_finish_reason_and_usage():
    usage = common_pb2.Usage(
        prompt_tokens=7,
        completion_tokens=12,
        drafted_tokens=16,
        accepted_tokens=9,
        num_steps=4,
        mean_accepted_length=3.0,
    )
    last = gateway_pb2.GenerateResponse(
        request_id="r",
        token_ids=[2],
        finish_reason=common_pb2.FINISH_REASON_STOP,
        usage=usage,
        stop_token_id=2,
    )
    back = gateway_pb2.GenerateResponse.FromString(last.SerializeToString())
    assert back.WhichOneof("stop_reason") == "stop_token_id"
    assert back.usage.accepted_tokens == 9
    assert common_pb2.FinishReason.Name(back.finish_reason) == "FINISH_REASON_STOP"
    assert common_pb2.FinishReason.Value("FINISH_REASON_UNSPECIFIED") == 0
    assert {"FINISH_REASON_LENGTH", "FINISH_REASON_ABORT"} <= set(common_pb2.FinishReason.keys())
    v = verifier_pb2.VerifierGenerateResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=usage)
    assert not v.HasField("stop_token_id")
    stats = verifier_pb2.VerifierGetStatsResponse(
        stats=common_pb2.EngineStats(kv_blocks_total=64, kv_blocks_free=60, kv_blocks_used=4)
    )
    assert stats.stats.kv_blocks_free + stats.stats.kv_blocks_used == stats.stats.kv_blocks_total
    info = proposer_pb2.GetInfoResponse(kind=proposer_pb2.PROPOSER_KIND_NGRAM)
    assert proposer_pb2.ProposerKind.Name(info.kind) == "PROPOSER_KIND_NGRAM"


def test_generated_code_is_fresh():
    """shared/proto_gen/ must be exactly what scripts/proto.sh generates from protos/."""
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "check_proto_fresh.sh")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_lint_is_clean():
    """buf lint + format check through scripts/buf_lint.sh, which installs the pinned buf from npm on first use."""
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "buf_lint.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
