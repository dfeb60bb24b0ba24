"""What every service's gRPC server gets: message size limits, health, reflection, graceful stop."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Iterable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # between services: a full resync of features for a batch stays below this
MAX_CONCURRENT_RPCS = 4096  # past it a server answers RESOURCE_EXHAUSTED instead of queueing without bound
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]
SERVER_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.http2.min_ping_interval_without_data_ms", 10_000)]

log = logging.getLogger(__name__)


def new_server(
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_receive_bytes: int = MAX_MESSAGE_BYTES,
    max_concurrent_rpcs: int = MAX_CONCURRENT_RPCS,
) -> grpc.aio.Server:
    """`interceptors`: the tracing ones of shared/telemetry.py when tracing is on. A message over
    `max_receive_bytes` is refused (RESOURCE_EXHAUSTED) before it is parsed."""
    options = [o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"]
    options.append(("grpc.max_receive_message_length", max_receive_bytes))
    return grpc.aio.server(
        options=options, interceptors=list(interceptors) or None, maximum_concurrent_rpcs=max_concurrent_rpcs
    )


def add_health_and_reflection(
    server: grpc.aio.Server, service_names: Iterable[str], reflection_on: bool = True
) -> health.aio.HealthServicer:
    """Registers grpc.health.v1 (overall "" and per service), and reflection unless `reflection_on` is False;
    all start SERVING."""
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    if reflection_on:
        reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server
        )
    return health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, names: Iterable[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *names]:
        await health_servicer.set(name, status)


def install_sigterm(stop: asyncio.Event) -> None:
    """SIGTERM / SIGINT set `stop`; the service then drains and exits."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


def setup_logging(level: str = "INFO") -> None:
    """Structured (key=value) log lines on stderr."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s",
    )
