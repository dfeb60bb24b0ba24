"""TLS on every gRPC port and channel, mutual TLS between the services (docs/security.md).

Every service's config inherits `TLSConfig` (--tls-cert-file, --tls-key-file, --tls-ca-file,
--tls-require-client-cert; SPECDEC_TLS_*). A server has TLS when it has a certificate; the CA file is the
cluster CA: a server verifies client certificates against it, and a client turns TLS on for its channels to
the other services when it has one (verifying them against it, presenting its own certificate if set).

Certificates rotate without a restart: the server's credentials re-read the files whenever their stat
changes (a Kubernetes Secret volume swaps a symlink), checked on each new connection's handshake; streams
already running keep their connection. The gateway's HTTPS port (uvicorn, the stdlib's ssl) does the same
through ReloadingSSLContext. Clients read the files when they open a channel.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import ssl
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import grpc

from shared.grpc_server import with_check

log = logging.getLogger(__name__)

Signature = tuple[tuple[int, int, int, int], ...]


class TLSError(ValueError):
    """A TLS file is missing, unreadable or not what it should be (raised at start-up)."""


@dataclass(frozen=True)
class TLSConfig:
    """The TLS fields of every service's config (fields of a frozen dataclass read by shared/config.py)."""

    # Without a CA nothing can verify client certificates, so "require" follows the CA unless set explicitly;
    # the gateway's public port asks for none by default (GatewayConfig sets this to False).
    REQUIRE_CLIENT_CERT_WITH_CA: ClassVar[bool] = True

    tls_cert_file: str = field(
        default="", metadata={"help": "PEM certificate (chain) of this service's server; set: the port speaks TLS"}
    )
    tls_key_file: str = field(default="", metadata={"help": "PEM private key of --tls-cert-file"})
    tls_ca_file: str = field(
        default="",
        metadata={
            "help": "PEM CA bundle of the cluster: verifies client certificates, and turns on TLS (verified "
            "against it, presenting --tls-cert-file) for the channels to the other services"
        },
    )
    tls_allowed_client_names: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "comma-separated names (a certificate's common name or one of its DNS names) whose client "
            "certificates may call this service's API; health and reflection stay open to every certificate the "
            "CA signed. Empty: any such certificate (the cluster CA alone decides)"
        },
    )
    tls_require_client_cert: bool | None = field(
        default=None,
        metadata={
            "help": "refuse clients without a certificate signed by --tls-ca-file (default: on when a CA is "
            "given on the verifier and the proposer, off on the gateway)"
        },
    )

    def __post_init__(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            given, missing = ("--tls-cert-file", "--tls-key-file")[:: 1 if self.tls_cert_file else -1]
            raise ValueError(f"{given} needs {missing}: a certificate and its key go together")
        if self.tls_allowed_client_names and not self.require_client_cert:
            raise ValueError("--tls-allowed-client-names needs client certificates (--tls-ca-file, required)")
        if self.tls_require_client_cert:
            if not self.tls_cert_file:
                raise ValueError("--tls-require-client-cert needs --tls-cert-file/--tls-key-file (a TLS server)")
            if not self.tls_ca_file:
                raise ValueError("--tls-require-client-cert needs --tls-ca-file to verify client certificates")

    @property
    def require_client_cert(self) -> bool:
        """Whether this service's server refuses clients without a certificate from the CA."""
        if self.tls_require_client_cert is not None:
            return self.tls_require_client_cert
        return bool(self.tls_cert_file and self.tls_ca_file) and self.REQUIRE_CLIENT_CERT_WITH_CA

    def client_tls(self, server_name: str = "") -> ClientTLS | None:
        """The settings of this service's channels to the others: None (plaintext) without a CA file."""
        if not self.tls_ca_file:
            return None
        return ClientTLS(self.tls_ca_file, self.tls_cert_file, self.tls_key_file, server_name)


# ---- files ---------------------------------------------------------------------------------------


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise TLSError(f"cannot read the {what} {path!r}: {err.strerror or err}") from None
    if b"-----BEGIN" not in data:
        raise TLSError(f"the {what} {path!r} is not PEM")
    return data


def _signature(paths: Sequence[str]) -> Signature:
    """What changes when a file is rewritten or a Secret volume's symlink is swapped (stat follows links)."""
    out = []
    for path in paths:
        try:
            st = os.stat(path)
            out.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append((0, 0, 0, 0))
    return tuple(out)


def _check_pair(cert_file: str, key_file: str, ca_file: str) -> None:
    """The stdlib's parser: a key that does not match its certificate fails here, not in a handshake."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        if cert_file:
            context.load_cert_chain(cert_file, key_file)
        if ca_file:
            context.load_verify_locations(ca_file)
    except ssl.SSLError as err:
        raise TLSError(f"TLS files {cert_file or ca_file!r}/{key_file!r}: {err.reason or err}") from None


@dataclass
class _Material:
    cert: bytes = b""
    key: bytes = b""
    ca: bytes | None = None


def load_material(cert_file: str, key_file: str, ca_file: str) -> _Material:
    """Reads and checks the files; reads them again after the check so a half-rotated set is never used."""
    paths = [p for p in (cert_file, key_file, ca_file) if p]

    def read_all() -> _Material:
        return _Material(
            _read(cert_file, "certificate") if cert_file else b"",
            _read(key_file, "private key") if key_file else b"",
            _read(ca_file, "CA file") if ca_file else None,
        )

    before = read_all()
    _check_pair(cert_file, key_file, ca_file)
    if read_all() != before:
        raise TLSError(f"TLS files {', '.join(paths)} changed while being read")
    return before


# ---- servers -------------------------------------------------------------------------------------


class ReloadingServerCertificates:
    """Certificate-configuration fetcher for grpc.dynamic_ssl_server_credentials. gRPC calls it on every new
    connection's handshake (from its own thread): a stat of each file, a re-read only when one changed. A
    set that does not load (a rotation half done) keeps the previous one and is tried again next time."""

    def __init__(self, cert_file: str, key_file: str, ca_file: str = "") -> None:
        self.files = (cert_file, key_file, ca_file)
        self._signature = _signature([p for p in self.files if p])
        self.initial = self._configuration(load_material(*self.files))
        self.reloads = 0

    @staticmethod
    def _configuration(m: _Material) -> Any:
        return grpc.ssl_server_certificate_configuration([(m.key, m.cert)], root_certificates=m.ca)

    def __call__(self) -> Any:
        signature = _signature([p for p in self.files if p])
        if signature == self._signature:
            return None  # unchanged: gRPC keeps the current configuration
        try:
            config = self._configuration(load_material(*self.files))
        except TLSError as err:
            log.warning("event=tls_reload_failed keeping=previous error=%s", err)
            return None
        self._signature = signature
        self.reloads += 1
        log.info("event=tls_reloaded cert_file=%s", self.files[0])
        return config


class ReloadingSSLContext:
    """The same rotation for a server on the stdlib's ssl (the gateway's HTTPS port): `maybe_reload`, called
    for each new connection before its handshake, stats the files and, when they changed and load as a
    matching set, loads them into the live context, so new connections get the new certificate while open
    ones keep theirs. A set that does not load keeps the previous one and is tried again next time. The CA
    file only adds: a CA once trusted stays trusted until a restart."""

    def __init__(self, context: ssl.SSLContext, cert_file: str, key_file: str, ca_file: str = "") -> None:
        self.context = context
        self.files = (cert_file, key_file, ca_file)
        self._signature = _signature([p for p in self.files if p])
        self.reloads = 0

    def maybe_reload(self) -> bool:
        signature = _signature([p for p in self.files if p])
        if signature == self._signature:
            return False
        try:
            material = load_material(*self.files)
        except TLSError as err:
            log.warning("event=tls_reload_failed keeping=previous error=%s", err)
            return False
        # The context reads files only: load the bytes just checked (not the paths, which may change again
        # between the check and the load) from a private temporary folder.
        with tempfile.TemporaryDirectory(prefix="specdec-tls-") as folder:
            cert, key = os.path.join(folder, "tls.crt"), os.path.join(folder, "tls.key")
            for path, data in ((cert, material.cert), (key, material.key)):
                with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                    f.write(data)
            self.context.load_cert_chain(cert, key)
        if material.ca is not None:
            self.context.load_verify_locations(cadata=material.ca.decode())
        self._signature = signature
        self.reloads += 1
        log.info("event=tls_reloaded cert_file=%s", self.files[0])
        return True


def server_credentials(config: TLSConfig) -> grpc.ServerCredentials:
    """Raises TLSError (missing file, not PEM, key not matching the certificate) at start-up."""
    fetcher = ReloadingServerCertificates(config.tls_cert_file, config.tls_key_file, config.tls_ca_file)
    return grpc.dynamic_ssl_server_credentials(
        fetcher.initial, fetcher, require_client_authentication=config.require_client_cert
    )


class ClientNameCheck(grpc.aio.ServerInterceptor):
    """Admits a call to the service's API only from a client certificate that names one of `names` (its common
    name or a DNS name): a certificate from the same CA issued to another service (the proposer's, calling the
    verifier) gets PERMISSION_DENIED. Health and reflection stay open to every certificate (the probes present
    the pod's own)."""

    OPEN = ("/grpc.health.v1.", "/grpc.reflection.")

    def __init__(self, names: Sequence[str]) -> None:
        self.names = frozenset(names)

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(self.OPEN):
            return handler
        return with_check(handler, self._check)

    async def _check(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        auth = context.auth_context()
        presented = {
            value.decode(errors="replace")
            for key in ("x509_common_name", "x509_subject_alternative_name")
            for value in auth.get(key, [])
        }
        if not presented & self.names:
            log.warning("event=client_name_refused presented=%s", ",".join(sorted(presented)) or "-")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "this client certificate may not call this service")


def server_interceptors(config: TLSConfig) -> list[grpc.aio.ServerInterceptor]:
    """The client-name check when --tls-allowed-client-names is set."""
    return [ClientNameCheck(config.tls_allowed_client_names)] if config.tls_allowed_client_names else []


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def add_port(server: grpc.aio.Server, host: str, port: int, config: TLSConfig, role: str) -> int:
    """Binds `host:port` with TLS when the config has a certificate; the port bound (0: failed). Plaintext on a
    non-loopback address logs one warning."""
    address = f"{host}:{port}"
    if not config.tls_cert_file:
        if not is_loopback(host):
            log.warning("event=plaintext_listener role=%s address=%s: no TLS (set --tls-cert-file)", role, address)
        return server.add_insecure_port(address)
    bound = server.add_secure_port(address, server_credentials(config))
    log.info("event=tls_listener role=%s address=%s client_cert_required=%s", role, address, config.require_client_cert)
    return bound


# ---- clients -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientTLS:
    """A client's TLS: the CA to verify servers against, its own certificate (mutual TLS) and the name the
    server's certificate must carry when the address does not (a pod IP found by DNS)."""

    ca_file: str = ""  # empty: the system's roots
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("a client certificate needs its key (--tls-cert-file with --tls-key-file)")

    def credentials(self) -> grpc.ChannelCredentials:
        """Reads the files now: a channel opened after a rotation presents the new certificate."""
        m = load_material(self.cert_file, self.key_file, self.ca_file)
        return grpc.ssl_channel_credentials(m.ca, m.key or None, m.cert or None)

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def signature(self) -> Signature:
        return _signature([p for p in (self.ca_file, self.cert_file, self.key_file) if p])


def aio_channel(
    address: str, tls: ClientTLS | None, options: Sequence[tuple[str, Any]] = (), interceptors: Any = None
) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
    opts = [*options, *tls.options()]
    return grpc.aio.secure_channel(address, tls.credentials(), options=opts, interceptors=interceptors)


def sync_channel(address: str, tls: ClientTLS | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.credentials(), options=[*options, *tls.options()])


def check_files_or_exit(config: TLSConfig, role: str) -> None:
    """At start-up, before a model loads for minutes: every TLS file configured exists and parses."""
    try:
        if config.tls_cert_file or config.tls_ca_file:
            load_material(config.tls_cert_file, config.tls_key_file, config.tls_ca_file)
    except TLSError as err:
        log.error("cannot start the %s: %s", role, err)
        raise SystemExit(2) from err


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """--tls and the --tls-* files of a command-line client. The files default to the SPECDEC_TLS_* variables, so
    a probe run inside a service's container (an exec probe) presents that service's certificate; the server
    name does not (a service's SPECDEC_TLS_SERVER_NAME names its upstream, not itself)."""
    parser.add_argument("--tls", action="store_true", help="use TLS (also implied by --tls-ca-file, --tls-cert-file)")
    for name, what in (
        ("ca_file", "PEM CA bundle to verify the server against (default: the system's roots)"),
        ("cert_file", "PEM client certificate, for servers that require one (mutual TLS)"),
        ("key_file", "PEM private key of --tls-cert-file"),
    ):
        variable = f"SPECDEC_TLS_{name.upper()}"
        flag = f"--tls-{name.replace('_', '-')}"
        parser.add_argument(flag, default=os.environ.get(variable, ""), help=f"{what} (env {variable})")
    parser.add_argument(
        "--tls-server-name", default="", help="name the server's certificate must carry when the address does not"
    )


def client_from_arguments(args: argparse.Namespace) -> ClientTLS | None:
    if not (args.tls or args.tls_ca_file or args.tls_cert_file):
        return None
    return ClientTLS(args.tls_ca_file, args.tls_cert_file, args.tls_key_file, args.tls_server_name)
