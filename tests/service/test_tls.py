"""TLS on real gRPC servers on loopback (shared/tls.py): mutual TLS between the services, server-only TLS on the
gateway, refused clients, and certificate rotation without a restart. Certificates are made here (trustme)."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from pathlib import Path

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway import client as cli
from gateway import health_probe
from gateway.config import GatewayConfig
from gateway.server import start_gateway
from proposer_service.builder import ProposerInfo
from proposer_service.ngram import NgramDrafter
from proposer_service.server import ProposerServer
from shared.model.loader import load_tokenizer
from shared.proto_gen.specdec.v1 import (
    gateway_pb2,
    gateway_pb2_grpc,
    proposer_pb2,
    proposer_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from shared.settings import default_target_model
from shared.tls import ClientTLS, aio_channel
from tests.service.test_proposer_service import Stream, config, seq
from tests.service.test_verifier_service import eventually, reference, start_verifier

pytestmark = pytest.mark.timeout(90)

SERVER_NAME = "localhost"  # the leaf certificates carry localhost and 127.0.0.1


class Identity:
    """A service's certificate and key, written where a Kubernetes Secret volume puts them: DIR/tls.crt is a
    symlink to DIR/..data/tls.crt and ..data to a versioned folder, swapped atomically on rotation."""

    def __init__(self, root: Path, ca: trustme.CA, cluster_ca: trustme.CA | None = None) -> None:
        self.dir = root
        self.dir.mkdir(parents=True)
        self.version = 0
        self.cluster_ca = cluster_ca or ca
        self.rotate(ca)
        for name in ("tls.crt", "tls.key", "ca.crt"):
            os.symlink(f"..data/{name}", self.dir / name)

    def rotate(self, ca: trustme.CA) -> bytes:
        """A new leaf from `ca`; returns its DER."""
        self.version += 1
        # The folder's name is also a DNS name of the certificate: the identity --tls-allowed-client-names checks.
        leaf = ca.issue_cert(SERVER_NAME, "127.0.0.1", self.dir.name, common_name=f"{self.dir.name}-v{self.version}")
        data = self.dir / f"..v{self.version}"
        data.mkdir()
        leaf.cert_chain_pems[0].write_to_path(str(data / "tls.crt"))
        leaf.private_key_pem.write_to_path(str(data / "tls.key"))
        self.cluster_ca.cert_pem.write_to_path(str(data / "ca.crt"))
        os.symlink(data.name, self.dir / "..tmp")
        os.replace(self.dir / "..tmp", self.dir / "..data")  # what the kubelet does
        return ssl.PEM_cert_to_DER_cert(leaf.cert_chain_pems[0].bytes().decode())

    @property
    def files(self) -> dict[str, str]:
        return {
            f"tls_{k}_file": str(self.dir / f) for k, f in (("cert", "tls.crt"), ("key", "tls.key"), ("ca", "ca.crt"))
        }

    def client(self) -> ClientTLS:
        return ClientTLS(str(self.dir / "ca.crt"), str(self.dir / "tls.crt"), str(self.dir / "tls.key"), SERVER_NAME)


@pytest.fixture
def pki(tmp_path):
    cluster, other = trustme.CA(), trustme.CA()
    return {
        "cluster": cluster,
        "proposer": Identity(tmp_path / "proposer", cluster),
        "verifier": Identity(tmp_path / "verifier", cluster),
        "gateway": Identity(tmp_path / "gateway", cluster),
        "client": Identity(tmp_path / "client", cluster),
        # a client certificate from another CA, trusting the cluster's (so only the server can refuse it)
        "stranger": Identity(tmp_path / "stranger", other, cluster_ca=cluster),
    }


async def start_proposer(identity: Identity) -> ProposerServer:
    info = ProposerInfo("ngram", "", 0, "", 8, 0)
    return await ProposerServer.start(config(**identity.files), NgramDrafter(4, 1), info)


async def get_info(port: int, tls: ClientTLS | None) -> proposer_pb2.GetInfoResponse:
    async with aio_channel(f"127.0.0.1:{port}", tls) as channel:
        return await proposer_pb2_grpc.ProposerStub(channel).GetInfo(proposer_pb2.GetInfoRequest(), timeout=5)


async def get_stats(port: int, tls: ClientTLS | None) -> verifier_pb2.VerifierGetStatsResponse:
    async with aio_channel(f"127.0.0.1:{port}", tls) as channel:
        return await verifier_pb2_grpc.VerifierStub(channel).GetStats(verifier_pb2.VerifierGetStatsRequest(), timeout=5)


async def refused(call, client: str = "") -> None:
    try:
        await call
    except grpc.aio.AioRpcError as err:
        assert err.code() == grpc.StatusCode.UNAVAILABLE, client
    else:
        raise AssertionError(f"{client}: admitted")


def clients(pki) -> dict[str, ClientTLS | None]:
    """The clients every internal port must refuse."""
    ca = str(pki["client"].dir / "ca.crt")
    return {
        "plaintext": None,
        "no client certificate": ClientTLS(ca, server_name=SERVER_NAME),
        "client certificate of another CA": pki["stranger"].client(),
    }


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 80))


def test_proposer_mutual_tls_admits_the_cluster_and_refuses_the_rest(pki):
    async def body():
        proposer = await start_proposer(pki["proposer"])
        try:
            assert proposer.servicer.info.kind == "ngram"
            info = await get_info(proposer.port, pki["client"].client())
            assert info.kind == proposer_pb2.PROPOSER_KIND_NGRAM
            for name, tls in clients(pki).items():
                await refused(get_info(proposer.port, tls), name)
        finally:
            await proposer.shutdown(0.1)

    run(body())


def test_verifier_mutual_tls_to_its_clients_and_to_the_proposer(pki):
    async def body():
        proposer = await start_proposer(pki["proposer"])
        verifier = await start_verifier(
            [f"127.0.0.1:{proposer.port}"], **pki["verifier"].files, tls_server_name=SERVER_NAME
        )
        try:
            assert verifier.proposer is not None and verifier.proposer.connected  # mutual TLS to the proposer
            stats = await get_stats(verifier.port, pki["client"].client())
            assert stats.model == "tiny" and stats.stats.proposer_connected
            for name, tls in clients(pki).items():
                await refused(get_stats(verifier.port, tls), name)
        finally:
            await verifier.shutdown(0)
            await proposer.shutdown(0.1)

    run(body())


def test_verifier_does_not_draft_with_a_proposer_of_another_ca(pki, tmp_path):
    async def body():
        impostor = Identity(tmp_path / "impostor", trustme.CA())
        proposer = await start_proposer(impostor)
        verifier = await start_verifier(
            [f"127.0.0.1:{proposer.port}"], wait=False, **pki["verifier"].files, tls_server_name=SERVER_NAME
        )
        try:
            assert verifier.proposer is not None
            assert not await verifier.proposer.wait_connected(1.0)
        finally:
            await verifier.shutdown(0)
            await proposer.shutdown(0.1)

    run(body())


def test_gateway_server_only_tls_in_front_of_mutual_tls(pki):
    tokenizer = load_tokenizer(default_target_model())

    async def body():
        proposer = await start_proposer(pki["proposer"])
        verifier = await start_verifier(
            [f"127.0.0.1:{proposer.port}"], **pki["verifier"].files, tls_server_name=SERVER_NAME
        )
        gateway_config = GatewayConfig(
            verifiers=(f"127.0.0.1:{verifier.port}",),
            host="127.0.0.1",
            port=0,
            http_port=0,
            health_check_interval_s=0.2,
            drain_timeout_s=0.5,
            tls_server_name=SERVER_NAME,
            **pki["gateway"].files,
        )
        gateway = await start_gateway(gateway_config, tokenizer=tokenizer)
        prompt = [5, 9, 2, 6, 5, 3, 5]
        try:
            assert gateway.pool.healthy_count() == 1  # health checks over mutual TLS
            # A public client: verifies the gateway, presents no certificate.
            public = ClientTLS(str(pki["client"].dir / "ca.crt"), server_name=SERVER_NAME)
            async with aio_channel(gateway.address, public) as channel:
                reply = await gateway_pb2_grpc.GatewayStub(channel).Complete(
                    gateway_pb2.CompleteRequest(prompt_token_ids=prompt, max_tokens=8, temperature=0), timeout=30
                )
            assert list(reply.token_ids) == reference(tuple(prompt), 8)
            # The gateway's client certificate rotates: its next health check opens a new channel with it.
            backend = gateway.pool[f"127.0.0.1:{verifier.port}"]
            old_channel = backend.channel
            pki["gateway"].rotate(pki["cluster"])
            await eventually(lambda: backend.channel is not old_channel)
            async with aio_channel(gateway.address, public) as channel:
                reply = await gateway_pb2_grpc.GatewayStub(channel).Complete(
                    gateway_pb2.CompleteRequest(prompt_token_ids=prompt, max_tokens=8, temperature=0), timeout=30
                )
            assert list(reply.token_ids) == reference(tuple(prompt), 8)
            # The CLI over TLS (a blocking client: in a thread, beside this event loop).
            files = ["--tls-ca-file", str(pki["client"].dir / "ca.crt"), "--tls-server-name", SERVER_NAME]
            argv = ["--address", gateway.address, "--prompt-token-ids", "5,9,2", "--max-tokens", "3", "--json", *files]
            assert await asyncio.to_thread(cli.run, cli.build_parser().parse_args(argv)) == 0
            async with aio_channel(gateway.address, None) as channel:
                await refused(
                    gateway_pb2_grpc.GatewayStub(channel).Complete(
                        gateway_pb2.CompleteRequest(prompt_token_ids=prompt, max_tokens=1), timeout=5
                    )
                )
        finally:
            await gateway.stop(0)
            await verifier.shutdown(0)
            await proposer.shutdown(0.1)

    run(body())


def peer_certificate(port: int, client: Identity, grpc_port: bool = True) -> bytes:
    """The certificate a NEW connection gets from the server (stdlib ssl): a gRPC port (gRPC's ALPN, the client's
    certificate presented) or, with grpc_port=False, the gateway's HTTPS port (no client certificate)."""
    context = ssl.create_default_context(cafile=str(client.dir / "ca.crt"))
    if grpc_port:
        context.load_cert_chain(str(client.dir / "tls.crt"), str(client.dir / "tls.key"))
        context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as sock,
        context.wrap_socket(sock, server_hostname=SERVER_NAME) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def test_rotated_server_certificate_is_used_by_new_connections_while_a_running_stream_completes(pki):
    async def body():
        identity = pki["proposer"]
        proposer = await start_proposer(identity)
        before = await asyncio.to_thread(peer_certificate, proposer.port, pki["client"])
        try:
            async with aio_channel(f"127.0.0.1:{proposer.port}", pki["client"].client()) as channel:
                stream = Stream(channel)
                prompt = [1, 2, 3, 1, 2, 3, 1, 2]
                first = await stream.send([seq("a", len(prompt), prompt, 3)])
                assert list(first.drafts[0].draft_token_ids) == [3, 1, 2]

                rotated = identity.rotate(pki["cluster"])  # the Secret is updated: no restart
                after = await asyncio.to_thread(peer_certificate, proposer.port, pki["client"])
                assert after == rotated != before
                assert (await get_info(proposer.port, pki["client"].client())).kind  # new gRPC connection

                # The stream opened before the rotation goes on and ends normally.
                second = await stream.send([seq("a", len(prompt) + 1, [3], 2)])
                assert list(second.drafts[0].draft_token_ids) == [1, 2]
                await stream.call.done_writing()
                assert await stream.call.read() is grpc.aio.EOF
                assert await stream.call.code() == grpc.StatusCode.OK
        finally:
            await proposer.shutdown(0.1)

    run(body())


def test_a_half_rotated_secret_keeps_the_previous_certificate(pki, tmp_path):
    async def body():
        identity = pki["proposer"]
        proposer = await start_proposer(identity)
        try:
            before = await asyncio.to_thread(peer_certificate, proposer.port, pki["client"])
            # The key of another certificate beside the current one: not a usable pair.
            trustme.CA().issue_cert(SERVER_NAME).private_key_pem.write_to_path(str(identity.dir / "tls.key"))
            assert await asyncio.to_thread(peer_certificate, proposer.port, pki["client"]) == before
            assert (await get_info(proposer.port, pki["client"].client())).kind
        finally:
            await proposer.shutdown(0.1)

    run(body())


def test_health_probe_over_mutual_tls(pki, monkeypatch):
    async def body():
        proposer = await start_proposer(pki["proposer"])
        address = f"127.0.0.1:{proposer.port}"
        try:
            # Inside a service's container the probe takes the files from SPECDEC_TLS_* (an exec probe).
            for name, path in pki["client"].files.items():
                monkeypatch.setenv(f"SPECDEC_{name.upper()}", path)
            argv = [address, "--service", "specdec.v1.Proposer", "--tls-server-name", SERVER_NAME]
            assert await asyncio.to_thread(health_probe.main, argv) == 0
            no_cert = [address, "--tls-server-name", SERVER_NAME, "--tls-cert-file", "", "--tls-key-file", ""]
            assert await asyncio.to_thread(health_probe.main, no_cert) == 1  # refused: no client certificate
            monkeypatch.delenv("SPECDEC_TLS_CA_FILE")
            monkeypatch.delenv("SPECDEC_TLS_CERT_FILE")
            monkeypatch.delenv("SPECDEC_TLS_KEY_FILE")
            assert await asyncio.to_thread(health_probe.main, [address]) == 1  # plaintext to a TLS port
        finally:
            await proposer.shutdown(0.1)

    run(body())


def test_https_port_rotates_its_certificate_like_the_grpc_port_while_a_stream_completes(pki):
    """Issue 26, point 6: uvicorn read the certificate once; now each new connection checks the files first."""
    from tests.service.test_gateway import free_port, start_fake

    tokenizer = load_tokenizer(default_target_model())

    async def body():
        import httpx

        fs = await start_fake(delay=0.05)
        config = GatewayConfig(
            verifiers=(fs.address,), host="127.0.0.1", port=0, http_port=free_port(), drain_timeout_s=0.5,
            health_check_interval_s=0.2, tls_cert_file=pki["gateway"].files["tls_cert_file"],
            tls_key_file=pki["gateway"].files["tls_key_file"],  # no CA: plaintext to the fake verifier
        )  # fmt: skip
        gateway = await start_gateway(config, tokenizer=tokenizer)
        port = gateway.http.port
        ca = str(pki["client"].dir / "ca.crt")
        try:
            before = await asyncio.to_thread(peer_certificate, port, pki["client"], False)
            async with httpx.AsyncClient(
                base_url=f"https://localhost:{port}", verify=ssl.create_default_context(cafile=ca)
            ) as http:
                body = {"prompt": "Hi", "max_tokens": 40, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as stream:
                    lines = stream.aiter_lines()
                    assert (await anext(lines)).startswith("data: ")
                    rotated = pki["gateway"].rotate(pki["cluster"])  # the Secret is updated: no restart
                    after = await asyncio.to_thread(peer_certificate, port, pki["client"], False)
                    assert after == rotated != before
                    rest = [line async for line in lines if line]
                    assert rest[-1] == "data: [DONE]"  # the stream opened before the rotation ended normally
            # A half-rotated Secret (the key of another certificate) keeps the current one.
            trustme.CA().issue_cert(SERVER_NAME).private_key_pem.write_to_path(str(pki["gateway"].dir / "tls.key"))
            assert await asyncio.to_thread(peer_certificate, port, pki["client"], False) == rotated
            assert gateway.http.tls is not None and gateway.http.tls.reloads == 1
        finally:
            await gateway.stop(0)
            await fs.server.stop(0)

    run(body())


def test_only_the_allowed_client_certificate_may_call_the_verifiers_api(pki):
    """Issue 26, point 9: every service's certificate comes from one CA, so mutual TLS alone would let the
    proposer's certificate call the verifier's Generate. --tls-allowed-client-names admits the gateway's only;
    health stays open to every certificate of the CA (the pods' own probes)."""

    async def body():
        verifier = await start_verifier(**pki["verifier"].files, tls_allowed_client_names=("gateway",))
        try:
            assert (await get_stats(verifier.port, pki["gateway"].client())).model
            for name in ("proposer", "client"):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await get_stats(verifier.port, pki[name].client())
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
                async with aio_channel(f"127.0.0.1:{verifier.port}", pki[name].client()) as channel:
                    stub = verifier_pb2_grpc.VerifierStub(channel)
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        async for _ in stub.Generate(
                            verifier_pb2.VerifierGenerateRequest(prompt_token_ids=[1, 2], max_tokens=2)
                        ):
                            pass
                    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                    health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                    assert health.status == health_pb2.HealthCheckResponse.SERVING
            for name, tls in clients(pki).items():  # the CA still decides first: refused before any name check
                await refused(get_stats(verifier.port, tls), name)
        finally:
            await verifier.shutdown(0)

    run(body())
