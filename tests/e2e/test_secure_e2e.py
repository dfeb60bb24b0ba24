"""End to end with security on: TLS on every port, mutual TLS between the three processes, an API key at the
gateway (the `secure` stack of conftest.py; certificates and key from pki.py).

The greedy check is the proof that the internal links work: the verifier and the proposer accept only clients
with a certificate from the cluster CA, so exact output with drafted tokens means gateway -> verifier and
verifier <-> proposer both completed mutual TLS. The refusals each come with the matching admission, so that a
test cannot pass because the stack is simply down.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.health_probe import check_once
from shared.proto_gen.specdec.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from shared.tls import ClientTLS, sync_channel
from specdec_local.processes import GATEWAY_SERVICE, Stack
from tests.e2e.test_e2e import GREEDY_INDICES, check_greedy, generate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

INDICES = [GREEDY_INDICES[0], GREEDY_INDICES[1], GREEDY_INDICES[5]]  # 2 chat-templated prompts, 1 plain
MAX_TOKENS = 32
REFUSAL_TIMEOUT_S = 30.0


def public_client(stack: Stack, api_key: str) -> tuple[grpc.aio.Channel, gateway_pb2_grpc.GatewayStub]:
    """What a client outside the cluster holds: the CA to check the gateway against (no certificate of its own)
    and its key, sent by gRPC as `authorization: Bearer <key>` on every call (call credentials need TLS)."""
    assert stack.pki is not None
    tls = stack.pki.client(identity="")
    creds = grpc.composite_channel_credentials(tls.credentials(), grpc.access_token_call_credentials(api_key))
    channel = grpc.aio.secure_channel(stack.gateway.address, creds)
    return channel, gateway_pb2_grpc.GatewayStub(channel)


def test_tls_and_api_key_greedy_matches_transformers(secure_stack: Stack, prompts, greedy_references, tokenizer):
    async def run():
        channel, stub = public_client(secure_stack, secure_stack.api_key)
        async with channel:
            return await asyncio.gather(
                *(generate(stub, prompt_token_ids=prompts[i], max_tokens=MAX_TOKENS) for i in INDICES)
            )

    results = asyncio.run(run())
    problems = []
    for i, r in zip(INDICES, results, strict=True):
        problems += check_greedy(f"prompt {i}", r, greedy_references[i], MAX_TOKENS, tokenizer.eos_token_id, tokenizer)
    assert not problems, "\n".join(problems)
    assert secure_stack.verifier_stats().stats.proposer_connected, "the verifier lost its mutual-TLS proposer link"


def test_wrong_or_missing_key_unauthenticated(secure_stack: Stack, prompts):
    async def run():
        wrong_channel, wrong = public_client(secure_stack, secure_stack.api_key + "x")
        assert secure_stack.pki is not None
        bare_channel = grpc.aio.secure_channel(
            secure_stack.gateway.address, secure_stack.pki.client(identity="").credentials()
        )
        bare = gateway_pb2_grpc.GatewayStub(bare_channel)
        async with wrong_channel, bare_channel:
            streamed = await generate(wrong, prompt_token_ids=prompts[INDICES[0]], max_tokens=4, timeout=60)
            errors = {"Generate, wrong key": streamed.error}
            for label, stub in (("Complete, wrong key", wrong), ("Complete, no key", bare)):
                try:
                    await stub.Complete(gateway_pb2.CompleteRequest(prompt="Hi", max_tokens=4), timeout=60)
                    errors[label] = None
                except grpc.aio.AioRpcError as err:
                    errors[label] = err
            return errors

    errors = asyncio.run(run())
    for label, err in errors.items():
        assert err is not None, f"{label}: accepted"
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, f"{label}: {err.code().name}: {err.details()}"
    assert secure_stack.gateway_stats().backends, "the right key's GetStats failed"  # the contrast


def test_plaintext_client_refused_by_gateway(secure_stack: Stack):
    assert check_once(secure_stack.gateway.address, GATEWAY_SERVICE, tls=secure_stack.tls)[0], "TLS health failed"
    ok, state = check_once(secure_stack.gateway.address, GATEWAY_SERVICE)
    assert not ok, f"plaintext health check answered {state}"
    with grpc.insecure_channel(secure_stack.gateway.address) as channel, pytest.raises(grpc.RpcError) as refused:
        gateway_pb2_grpc.GatewayStub(channel).Complete(
            gateway_pb2.CompleteRequest(prompt="Hi", max_tokens=4),
            timeout=REFUSAL_TIMEOUT_S,
            metadata=[("authorization", f"Bearer {secure_stack.api_key}")],  # the right key does not help
        )
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value  # type: ignore[attr-defined]


def verifier_stats_error(stack: Stack, tls: ClientTLS | None) -> grpc.Call | None:
    """The error of a GetStats straight to the verifier's port (None: it answered)."""
    with sync_channel(stack.verifier.address, tls) as channel:
        try:
            verifier_pb2_grpc.VerifierStub(channel).GetStats(
                verifier_pb2.VerifierGetStatsRequest(), timeout=REFUSAL_TIMEOUT_S
            )
        except grpc.RpcError as err:
            assert isinstance(err, grpc.Call)  # gRPC's errors are both
            return err
    return None


def test_verifier_port_requires_a_certificate_from_the_cluster_ca(secure_stack: Stack):
    """Straight to the verifier's port (as from another pod): only the cluster's certificates get in."""
    pki = secure_stack.pki
    assert pki is not None
    assert verifier_stats_error(secure_stack, pki.client("client")) is None, "a cluster certificate was refused"
    clients = {
        # trusts the cluster CA, so only the verifier can be the side that refuses
        "certificate from another CA": pki.client("stranger"),
        "no client certificate": pki.client(identity=""),
        "plaintext": None,
    }
    for label, tls in clients.items():
        err = verifier_stats_error(secure_stack, tls)
        assert err is not None, f"{label}: the verifier answered"
        assert err.code() == grpc.StatusCode.UNAVAILABLE, f"{label}: {err.code().name}: {err.details()}"
