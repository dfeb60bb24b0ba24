"""shared/tls.py without a server: the config's TLS rules, start-up checks of the files, the reloading fetcher,
the one warning of a plaintext listener, and the command-line clients' flags."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

import grpc
import pytest
import trustme

from gateway.config import GatewayConfig
from proposer_service.config import ProposerConfig
from shared.config import load_config
from shared.tls import (
    ClientTLS,
    ReloadingServerCertificates,
    TLSError,
    add_client_arguments,
    add_port,
    check_files_or_exit,
    client_from_arguments,
    is_loopback,
    load_material,
)
from verifier_service.config import VerifierConfig

CONFIGS = [GatewayConfig, VerifierConfig, ProposerConfig]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    ca = trustme.CA()
    leaf = ca.issue_cert("localhost")
    out = {
        "tls_cert_file": tmp_path / "tls.crt",
        "tls_key_file": tmp_path / "tls.key",
        "tls_ca_file": tmp_path / "ca.crt",
    }
    leaf.cert_chain_pems[0].write_to_path(str(out["tls_cert_file"]))
    leaf.private_key_pem.write_to_path(str(out["tls_key_file"]))
    ca.cert_pem.write_to_path(str(out["tls_ca_file"]))
    return {k: str(v) for k, v in out.items()}


@pytest.mark.parametrize("cls", CONFIGS)
def test_plaintext_is_the_default(cls):
    config = cls()
    assert not config.tls_cert_file and not config.require_client_cert and config.client_tls() is None


@pytest.mark.parametrize("cls", CONFIGS)
def test_a_certificate_without_its_key_and_a_key_without_its_certificate_are_errors(cls):
    with pytest.raises(ValueError, match="--tls-cert-file needs --tls-key-file"):
        cls(tls_cert_file="tls.crt")
    with pytest.raises(ValueError, match="--tls-key-file needs --tls-cert-file"):
        cls(tls_key_file="tls.key")


@pytest.mark.parametrize("cls", CONFIGS)
def test_requiring_client_certificates_needs_a_server_certificate_and_a_ca(cls):
    with pytest.raises(ValueError, match="needs --tls-ca-file"):
        cls(tls_cert_file="a", tls_key_file="b", tls_require_client_cert=True)
    with pytest.raises(ValueError, match="needs --tls-cert-file"):
        cls(tls_ca_file="ca", tls_require_client_cert=True)


def test_client_certificates_are_required_with_a_ca_inside_and_asked_for_on_the_gateway_only_when_told():
    tls = {"tls_cert_file": "c", "tls_key_file": "k", "tls_ca_file": "ca"}
    assert VerifierConfig(**tls).require_client_cert and ProposerConfig(**tls).require_client_cert
    assert not VerifierConfig(**tls, tls_require_client_cert=False).require_client_cert
    assert not GatewayConfig(**tls).require_client_cert
    assert GatewayConfig(**tls, tls_require_client_cert=True).require_client_cert
    assert not ProposerConfig(tls_cert_file="c", tls_key_file="k").require_client_cert  # no CA: server-only TLS
    assert not VerifierConfig(tls_ca_file="ca").require_client_cert  # a plaintext server, TLS to the proposer only


def test_the_ca_turns_on_tls_for_the_channels_to_the_other_services():
    config = VerifierConfig(tls_cert_file="c", tls_key_file="k", tls_ca_file="ca", tls_server_name="proposer")
    assert config.client_tls(config.tls_server_name) == ClientTLS("ca", "c", "k", "proposer")
    assert ClientTLS("ca", server_name="p").options() == [("grpc.ssl_target_name_override", "p")]
    assert VerifierConfig(tls_cert_file="c", tls_key_file="k").client_tls() is None  # server TLS only
    with pytest.raises(ValueError, match="needs its key"):
        ClientTLS("ca", cert_file="c")


def test_flags_and_environment(monkeypatch):
    monkeypatch.setenv("SPECDEC_TLS_CERT_FILE", "/etc/tls/tls.crt")
    monkeypatch.setenv("SPECDEC_TLS_KEY_FILE", "/etc/tls/tls.key")
    monkeypatch.setenv("SPECDEC_TLS_REQUIRE_CLIENT_CERT", "false")
    config = load_config(ProposerConfig, ["--tls-ca-file", "/etc/tls/ca.crt"])
    assert (config.tls_cert_file, config.tls_key_file, config.tls_ca_file) == (
        "/etc/tls/tls.crt",
        "/etc/tls/tls.key",
        "/etc/tls/ca.crt",
    )
    assert config.tls_require_client_cert is False and not config.require_client_cert
    monkeypatch.delenv("SPECDEC_TLS_KEY_FILE")
    with pytest.raises(SystemExit):  # argparse's error: exit status 2, the message on stderr
        load_config(ProposerConfig, [])


def test_missing_and_broken_files_stop_the_start_up_with_a_clear_error(files, tmp_path, caplog):
    load_material(files["tls_cert_file"], files["tls_key_file"], files["tls_ca_file"])  # the good set loads
    missing = ProposerConfig(**{**files, "tls_ca_file": str(tmp_path / "nope.crt")})
    with pytest.raises(SystemExit) as exit_info, caplog.at_level(logging.ERROR):
        check_files_or_exit(missing, "proposer")
    assert exit_info.value.code == 2
    assert "cannot start the proposer: cannot read the CA file" in caplog.text and "nope.crt" in caplog.text
    with pytest.raises(TLSError, match="not PEM"):
        load_material(files["tls_cert_file"], __file__, "")
    other_key = tmp_path / "other.key"
    trustme.CA().issue_cert("x").private_key_pem.write_to_path(str(other_key))
    with pytest.raises(TLSError, match="tls.crt"):
        load_material(files["tls_cert_file"], str(other_key), "")


def test_the_fetcher_reloads_only_changed_files_and_keeps_the_previous_set_when_the_new_one_is_broken(files, tmp_path):
    fetch = ReloadingServerCertificates(files["tls_cert_file"], files["tls_key_file"], files["tls_ca_file"])
    assert fetch() is None and fetch.reloads == 0  # unchanged
    leaf = trustme.CA().issue_cert("localhost")
    leaf.private_key_pem.write_to_path(files["tls_key_file"])  # half a rotation: the key is new, the cert is not
    assert fetch() is None and fetch.reloads == 0
    leaf.cert_chain_pems[0].write_to_path(files["tls_cert_file"])
    assert fetch() is not None and fetch.reloads == 1
    assert fetch() is None


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("localhost", True), ("[::1]", True), ("::1", True), ("0.0.0.0", False), ("10.0.0.1", False)],
)
def test_loopback_addresses(host, loopback):
    assert is_loopback(host) is loopback


def test_plaintext_on_a_non_loopback_address_logs_exactly_one_warning(caplog, files):
    async def bind(host: str, **tls: str) -> list[logging.LogRecord]:
        server = grpc.aio.server()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="shared.tls"):
            assert add_port(server, host, 0, ProposerConfig(**tls), "proposer") > 0
        await server.stop(None)
        return [r for r in caplog.records if r.levelno >= logging.WARNING]

    async def body() -> None:
        (warning,) = await bind("0.0.0.0")
        assert "plaintext" in warning.getMessage() and "0.0.0.0" in warning.getMessage()
        assert await bind("127.0.0.1") == []
        assert await bind("0.0.0.0", **files) == []

    asyncio.run(body())


def test_command_line_clients(monkeypatch):
    def parse(*argv: str) -> ClientTLS | None:
        parser = argparse.ArgumentParser()
        add_client_arguments(parser)
        return client_from_arguments(parser.parse_args(argv))

    assert parse() is None
    assert parse("--tls") == ClientTLS()  # the system's roots
    assert parse("--tls-ca-file", "ca.crt", "--tls-server-name", "gw") == ClientTLS("ca.crt", server_name="gw")
    monkeypatch.setenv("SPECDEC_TLS_CA_FILE", "/etc/tls/ca.crt")  # an exec probe in a service's container
    monkeypatch.setenv("SPECDEC_TLS_CERT_FILE", "/etc/tls/tls.crt")
    monkeypatch.setenv("SPECDEC_TLS_KEY_FILE", "/etc/tls/tls.key")
    assert parse() == ClientTLS("/etc/tls/ca.crt", "/etc/tls/tls.crt", "/etc/tls/tls.key")
