"""The gateway's one frozen config: flags and SPECDEC_* environment variables (see shared/config.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from shared.config import load_config
from shared.tls import TLSConfig


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class GatewayConfig(TLSConfig):
    """specdec gateway: the public Generate/Complete API in front of one or more verifiers."""

    verifiers: tuple[str, ...] = field(
        default=("127.0.0.1:50052",), metadata=_help("comma-separated verifier addresses HOST:PORT[,HOST:PORT...]")
    )
    verifier_dns: str = field(
        default="",
        metadata=_help(
            "discover the verifiers by DNS instead of --verifiers: NAME:PORT whose A/AAAA records are the verifier "
            "pods (a Kubernetes headless Service), re-resolved every --dns-refresh-interval-s"
        ),
    )
    dns_refresh_interval_s: float = field(
        default=5.0, metadata=_help("seconds between DNS resolutions of --verifier-dns (CoreDNS's default TTL is 5)")
    )
    tokenizer: str = field(
        default="", metadata=_help("tokenizer (HF folder, .gguf folder or hub id); empty: the default target model")
    )
    host: str = field(default="0.0.0.0", metadata=_help("address to listen on"))
    port: int = field(default=50051, metadata=_help("port to listen on (0: pick a free one)"))
    http_port: int = field(
        default=8000,
        metadata=_help(
            "port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health) on "
            "--host, same TLS as the gRPC port (0: no HTTP API)"
        ),
    )
    served_model_name: str = field(
        default="", metadata=_help("the model name of the HTTP API (its `model` field); empty: the tokenizer's name")
    )
    max_prompt_chars: int = field(
        default=1_000_000, metadata=_help("longest text prompt, in characters (checked before tokenizing)")
    )
    max_messages: int = field(
        default=1024,
        metadata=_help("most chat messages per request (their roles and contents count in max_prompt_chars)"),
    )
    max_prompt_tokens: int = field(
        default=131_072, metadata=_help("most prompt tokens (prompt_token_ids, or the tokenized text)")
    )
    max_request_bytes: int = field(
        default=4 * 1024 * 1024, metadata=_help("largest request message the public port accepts, in bytes")
    )
    max_concurrent_rpcs: int = field(
        default=1024,
        metadata=_help(
            "generation requests (gRPC Generate/Complete and HTTP completions, both ports together) served at once, "
            "and HTTP requests in flight on the HTTP port; more get RESOURCE_EXHAUSTED / HTTP 429 (503 on the HTTP "
            "port's own count) instead of queueing. Health checks are outside it"
        ),
    )
    http_max_connections: int = field(
        default=2048, metadata=_help("open connections to the HTTP port; one more is closed at once")
    )
    http_read_timeout_s: float = field(
        default=10.0,
        metadata=_help(
            "an HTTP connection must send a request's headers within this many seconds of opening (or of its "
            "previous response), and then its body within as long again, or it is closed (408 for a body)"
        ),
    )
    http_keep_alive_s: float = field(
        default=5.0, metadata=_help("an idle HTTP keep-alive connection is closed after this many seconds")
    )
    http_sse_keepalive_s: float = field(
        default=15.0,
        metadata=_help(
            "a streamed HTTP request that has no token yet after this many seconds (queued on its verifier, or a "
            "long prompt) starts its event stream with a ': keep-alive' comment, and another every as many "
            "seconds until its first token, so that proxies do not cut an idle connection; an error after that "
            "arrives as an error event. 0: off (the status waits for the first token)"
        ),
    )
    http_write_timeout_s: float = field(
        default=60.0,
        metadata=_help(
            "an HTTP client that reads none of its reply for this many seconds (the send buffers full) is cut off "
            "and its request cancelled, freeing its generation slot and KV blocks (nginx's send_timeout)"
        ),
    )
    enable_reflection: bool = field(
        default=False, metadata=_help("serve gRPC reflection on the public port (grpcurl without proto files)")
    )
    expose_backends: bool = field(
        default=False, metadata=_help("list the verifiers (addresses, health, engine stats) in GetStats")
    )
    verifier_call_timeout_s: float = field(
        default=600.0,
        metadata=_help("deadline of a verifier call when the client set none (a client's own deadline is passed on)"),
    )
    stream_idle_timeout_s: float = field(
        default=120.0,
        metadata=_help(
            "a verifier stream silent this long (no message, first one included) is given up and the request "
            "resumed on another verifier"
        ),
    )
    default_max_tokens: int = field(default=128, metadata=_help("max_tokens of requests that leave it unset"))
    max_tokens_limit: int = field(
        default=32768, metadata=_help("largest max_tokens a request may ask for (also capped by the context length)")
    )
    max_stop_strings: int = field(default=16, metadata=_help("most stop strings per request"))
    max_stop_string_chars: int = field(default=256, metadata=_help("longest stop string, in characters"))
    max_stop_token_ids: int = field(default=64, metadata=_help("most stop token ids per request"))
    skip_special_tokens: bool = field(
        default=True, metadata=_help("leave special tokens (e.g. the end-of-sequence token) out of the text")
    )
    max_resumes: int = field(
        default=3, metadata=_help("times one request may be resumed on another verifier after its verifier failed")
    )
    health_check_interval_s: float = field(default=2.0, metadata=_help("seconds between health checks of a verifier"))
    health_check_timeout_s: float = field(default=2.0, metadata=_help("timeout of one health check / stats poll"))
    health_service: str = field(
        default="", metadata=_help("service name asked in grpc.health.v1 checks of the verifiers ('' = overall)")
    )
    drain_timeout_s: float = field(
        default=10.0, metadata=_help("on SIGTERM: seconds running requests may finish before they are cancelled")
    )
    api_keys_file: str = field(
        default="",
        metadata=_help(
            "file of API keys, one a line: KEY_OR_SHA256 [NAME] [max_streams=N] [tpm=N] (gateway/auth.py); requests "
            "then need 'authorization: Bearer <key>' metadata; re-read when it changes; empty: no keys needed"
        ),
    )
    api_key_max_concurrent_streams: int = field(
        default=64,
        metadata=_help(
            "requests (Generate, Complete, HTTP completions) one key name may have running at once, with "
            "--api-keys-file (0: no limit); one key cannot take every slot of --max-concurrent-rpcs"
        ),
    )
    api_key_max_tokens_per_minute: int = field(
        default=0, metadata=_help("prompt plus generated tokens one key name may use per sliding minute (0: no limit)")
    )
    metrics_port: int = field(
        default=0, metadata=_help("Prometheus /metrics port on --host (0: no endpoint); traces: OTEL_* variables")
    )
    log_level: str = field(default="INFO", metadata=_help("log level"))
    tls_server_name: str = field(
        default="",
        metadata=_help(
            "name the verifiers' certificates must carry when their address does not (pod IPs from "
            "--verifier-dns); TLS to the verifiers is on when --tls-ca-file is set"
        ),
    )

    # The public port asks for no client certificate unless --tls-require-client-cert (shared/tls.py).
    REQUIRE_CLIENT_CERT_WITH_CA: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.verifiers:
            raise ValueError("--verifiers needs at least one HOST:PORT")
        for address in self.verifiers:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"verifier address {address!r} is not HOST:PORT")
        if self.verifier_dns:
            host, sep, port = self.verifier_dns.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
                raise ValueError(f"--verifier-dns {self.verifier_dns!r} is not NAME:PORT")
        if self.dns_refresh_interval_s <= 0:
            raise ValueError(f"dns_refresh_interval_s must be > 0, got {self.dns_refresh_interval_s}")
        if len(set(self.verifiers)) != len(self.verifiers):
            raise ValueError(f"verifier addresses repeat: {','.join(self.verifiers)}")
        if not all(0 <= p <= 65535 for p in (self.port, self.metrics_port, self.http_port)):
            raise ValueError(
                f"port, metrics_port and http_port must be in [0, 65535], got {self.port}, {self.metrics_port}, "
                f"{self.http_port}"
            )
        for name in (
            "default_max_tokens", "max_tokens_limit", "max_stop_strings", "max_stop_string_chars",
            "max_prompt_chars", "max_prompt_tokens", "max_messages", "max_request_bytes", "max_concurrent_rpcs",
            "http_max_connections",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("default_max_tokens must not exceed max_tokens_limit")
        if self.max_stop_token_ids < 0 or self.max_resumes < 0:
            raise ValueError("max_stop_token_ids and max_resumes must be >= 0")
        if self.stream_idle_timeout_s <= 0:
            raise ValueError(f"stream_idle_timeout_s must be > 0, got {self.stream_idle_timeout_s}")
        if self.verifier_call_timeout_s <= 0:
            raise ValueError(f"verifier_call_timeout_s must be > 0, got {self.verifier_call_timeout_s}")
        if self.http_sse_keepalive_s < 0:
            raise ValueError(f"http_sse_keepalive_s must be >= 0, got {self.http_sse_keepalive_s}")
        if min(self.http_read_timeout_s, self.http_keep_alive_s, self.http_write_timeout_s) <= 0:
            raise ValueError("http_read_timeout_s, http_keep_alive_s and http_write_timeout_s must be > 0")
        if self.health_check_interval_s <= 0 or self.health_check_timeout_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("health check interval/timeout must be > 0 and drain_timeout_s >= 0")
        if self.api_key_max_concurrent_streams < 0 or self.api_key_max_tokens_per_minute < 0:
            raise ValueError("api_key_max_concurrent_streams and api_key_max_tokens_per_minute must be >= 0")

    def model_name(self) -> str:
        return self.served_model_name or self.tokenizer_name()

    def tokenizer_name(self) -> str:
        if self.tokenizer:
            return self.tokenizer
        from shared.settings import default_target_model

        return default_target_model()


def load_gateway_config(argv: Sequence[str] | None = None) -> GatewayConfig:
    return load_config(GatewayConfig, argv)
