"""Certificates and an API key for the secure e2e stack (conftest.py), written as files the services read.

One cluster CA signs a certificate per service and one for the test client; a second CA, which no service
trusts, signs the "stranger" certificate that mutual TLS must refuse. Every leaf carries localhost and
127.0.0.1: the services dial each other by IP, so no --tls-server-name is needed.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import trustme

from shared.tls import ClientTLS

NAMES = ("localhost", "127.0.0.1")
API_KEY_NAME = "e2e-client"


class PKI:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True)
        cluster, other = trustme.CA(), trustme.CA()
        self.ca = self._write(cluster.cert_pem, "ca.crt")
        self.other_ca = self._write(other.cert_pem, "other-ca.crt")
        self.leaves = {name: self._issue(cluster, name) for name in ("proposer", "verifier", "gateway", "client")}
        self.leaves["stranger"] = self._issue(other, "stranger")
        # Random per run: a key in the repository would be a real key somebody could copy.
        self.api_key = f"sk-e2e-{secrets.token_hex(16)}"
        self.api_keys_file = root / "api-keys"
        self.api_keys_file.write_text(f"# one key, for tests/e2e/test_secure_e2e.py\n{self.api_key} {API_KEY_NAME}\n")

    def _write(self, blob: trustme.Blob, name: str) -> Path:
        blob.write_to_path(str(self.root / name))
        return self.root / name

    def _issue(self, ca: trustme.CA, name: str) -> tuple[Path, Path]:
        leaf = ca.issue_cert(*NAMES, common_name=f"specdec-e2e-{name}")
        # cert_chain_pems[0] is the leaf; the CAs are roots, so there is no intermediate to append
        return self._write(leaf.cert_chain_pems[0], f"{name}.crt"), self._write(leaf.private_key_pem, f"{name}.key")

    def service_args(self, service: str) -> list[str]:
        """The --tls-* flags of one service: its certificate, and the cluster CA (which turns on TLS to the
        other services and, on the verifier and the proposer, requires client certificates from that CA)."""
        cert, key = self.leaves[service]
        return ["--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-file", str(self.ca)]

    def client(self, identity: str = "client", ca: Path | None = None) -> ClientTLS:
        """A client that trusts `ca` (the cluster CA by default) and presents `identity`'s certificate ('': none)."""
        cert, key = self.leaves[identity] if identity else ("", "")
        return ClientTLS(str(ca or self.ca), str(cert), str(key))
