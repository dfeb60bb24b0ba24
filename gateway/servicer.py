"""specdec.v1.Gateway: the gRPC front end of the gateway core (core.py), as thin as the protos allow.

It reads the request's fields, admits the caller (API key and limits from the call's metadata), runs the
core's one generation path and writes its chunks as GenerateResponse messages (or one CompleteResponse).
Errors become the core's status (a verifier's own passed through unchanged) with retry-after trailers.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from typing import Any

import grpc

from gateway.auth import ApiKeyAuth, Grant
from gateway.backends import BackendPool
from gateway.core import Final, GatewayCore
from gateway.output import Chunk
from gateway.prepare import RequestFields, RequestPreparer
from gateway.verifier_client import VerifierError, status_of
from shared.errors import SpecdecError, grpc_trailing_metadata_for
from shared.logprobs import to_proto as logprobs_to_proto
from shared.proto_gen.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from shared.telemetry import Telemetry


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self,
        preparer: RequestPreparer,
        pool: BackendPool,
        telemetry: Telemetry | None = None,
        auth: ApiKeyAuth | None = None,
    ) -> None:
        self.core = GatewayCore(preparer, pool, telemetry, auth)
        # the core's parts, under the names tests and server.py reach them by
        self.preparer = preparer
        self.pool = pool
        self.router = self.core.router
        self.counters = self.core.counters
        self.config = self.core.config

    async def Generate(  # type: ignore[override]
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        # An async generator (not context.write): the tracing interceptor wraps streaming handlers as such.
        fields = RequestFields.from_proto(request)
        try:
            async with (
                self._admit(context) as grant,
                contextlib.aclosing(self.core.generate(fields, context, grant)) as parts,
            ):
                async for request_id, chunk, final in parts:
                    response = gateway_pb2.GenerateResponse(
                        request_id=request_id, token_ids=chunk.token_ids, text=chunk.text
                    )
                    _set_logprobs(response, chunk, fields)
                    if final is not None:
                        _set_final(response, final)
                    yield response
        except (SpecdecError, VerifierError) as err:
            await _abort(context, err)

    async def Complete(  # type: ignore[override]
        self, request: gateway_pb2.CompleteRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.CompleteResponse:
        fields = RequestFields.from_proto(request)
        response = gateway_pb2.CompleteResponse()
        text: list[str] = []
        try:
            async with (
                self._admit(context) as grant,
                contextlib.aclosing(self.core.generate(fields, context, grant)) as parts,
            ):
                async for request_id, chunk, final in parts:
                    response.request_id = request_id
                    response.token_ids.extend(chunk.token_ids)
                    _set_logprobs(response, chunk, fields)
                    text.append(chunk.text)
                    if final is not None:
                        _set_final(response, final)
        except (SpecdecError, VerifierError) as err:
            await _abort(context, err)
        response.text = "".join(text)
        return response

    async def GetStats(  # type: ignore[override]
        self, request: gateway_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetStatsResponse:
        try:
            self._admit(context, limits=False)
        except SpecdecError as err:
            await _abort(context, err)
        response = gateway_pb2.GetStatsResponse(
            active_requests=self.counters.active_requests,
            total_requests=self.counters.total_requests,
            resumed_requests=self.counters.resumed_requests,
        )
        if not self.config.expose_backends:  # internal addresses are not the public's business
            return response
        for backend in self.pool.backends.values():
            entry = response.backends.add(
                address=backend.address, healthy=backend.load.healthy, active_requests=backend.load.active_requests
            )
            if backend.engine is not None:
                entry.engine.CopyFrom(backend.engine)
        return response

    def _admit(self, context: grpc.aio.ServicerContext, limits: bool = True) -> Grant:
        values = [str(v) for k, v in context.invocation_metadata() or () if k == "authorization"]
        return self.core.admit(values, context.peer(), limits)


def _set_logprobs(response: Any, chunk: Chunk, fields: RequestFields) -> None:
    if fields.logprobs:  # the message is present (maybe empty) whenever logprobs were asked for
        response.logprobs.num_top = fields.top_logprobs
        logprobs_to_proto(chunk.logprobs or [], fields.top_logprobs, response.logprobs)


def _set_final(response: Any, final: Final) -> None:
    response.finish_reason = final.finish_reason
    response.usage.CopyFrom(final.usage)
    if final.stop_string is not None:
        response.stop_string = final.stop_string
    elif final.stop_token_id is not None:
        response.stop_token_id = final.stop_token_id


async def _abort(context: grpc.aio.ServicerContext, err: Exception) -> None:
    await context.abort(*status_of(err), trailing_metadata=grpc_trailing_metadata_for(err))
