"""What every service's gRPC server gets: message size limits, undecodable requests refused as INVALID_ARGUMENT,
health, reflection, graceful stop."""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import Iterable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError
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
        options=options,
        interceptors=[*interceptors, UndecodableRequests()],  # innermost: the tracing span sees its status
        maximum_concurrent_rpcs=max_concurrent_rpcs,
    )


class _Undecodable:
    def __init__(self, message: str) -> None:
        self.message = message


class UndecodableRequests(grpc.aio.ServerInterceptor):
    """A unary request whose bytes are not its message type gets INVALID_ARGUMENT with the type's name. grpcio
    answers a deserializer's exception with UNKNOWN and the exception's class, as if the server had failed.
    Streamed requests (the services' internal streams) are left as they are: wrapping each message would cost
    every draft on the hot path."""

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        decode = handler.request_deserializer
        name = getattr(getattr(decode, "__self__", None), "DESCRIPTOR", None)
        what = f"a valid {name.full_name} message" if name is not None else "a valid message"

        def deserializer(data: bytes) -> Any:
            try:
                return decode(data)
            except DecodeError as err:
                return _Undecodable(f"the request is not {what}: {err}")

        return with_check(handler, _refuse_undecodable, deserializer)


async def _refuse_undecodable(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


def with_check(handler: Any, check: Any, request_deserializer: Any = None) -> Any:
    """`handler` with `await check(request, context)` run before its behaviour, in any of the four call shapes
    and in the behaviour's own kind (grpcio tells a generator from a context.write coroutine by the function);
    `request_deserializer` replaces the handler's. A stream request's `request` is its iterator."""
    if handler.request_streaming and handler.response_streaming:
        behavior, make = handler.stream_stream, grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        behavior, make = handler.stream_unary, grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        behavior, make = handler.unary_stream, grpc.unary_stream_rpc_method_handler
    else:
        behavior, make = handler.unary_unary, grpc.unary_unary_rpc_method_handler
    if handler.response_streaming and not inspect.iscoroutinefunction(behavior):

        async def generating(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await check(request, context)
            async for response in behavior(request, context):
                yield response

        wrapped: Any = generating
    else:  # a unary response, or a stream written with context.write

        async def calling(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await check(request, context)
            return await behavior(request, context)

        wrapped = calling
    return make(wrapped, request_deserializer or handler.request_deserializer, handler.response_serializer)


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
