"""The gateway's side of Verifier.Generate: the request it sends, the stream it reads, what a failure means.

A failure is classified once, here, for the core (which imports no grpc):
- VerifierFailed: the verifier died, dropped the call (UNAVAILABLE, or CANCELLED while the client is still
  there), ended the stream without a finish reason, sent malformed logprobs, or stayed silent past the idle
  limit: the request resumes on another verifier;
- VerifierFull: RESOURCE_EXHAUSTED before this call emitted a token: try another verifier, or shed the load;
- VerifierError: any other status (INVALID_ARGUMENT, ...), passed to the client unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from gateway.prepare import PreparedRequest
from shared.errors import grpc_status_for
from shared.proto_convert import sampling_params_to_proto
from shared.proto_gen.specdec.v1 import common_pb2, verifier_pb2


class VerifierError(Exception):
    """A verifier's error status, passed through to the client unchanged (code and message)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class VerifierFailed(Exception):
    """The verifier died or dropped the call: resume the request elsewhere."""


class VerifierFull(Exception):
    """The verifier's queue is full (RESOURCE_EXHAUSTED before any token): try another, or shed the load."""


def status_of(err: Exception) -> tuple[grpc.StatusCode, str]:
    """The gRPC status of an error the core raised: a verifier's own status unchanged, else the domain mapping."""
    if isinstance(err, VerifierError):
        return err.code, err.details
    return grpc_status_for(err)


def verifier_request(prepared: PreparedRequest, emitted: list[int]) -> verifier_pb2.VerifierGenerateRequest:
    """The request for one verifier segment: after a resume the prompt carries the tokens emitted so far."""
    return verifier_pb2.VerifierGenerateRequest(
        request_id=prepared.request_id,
        session_id=prepared.session_id,
        prompt_token_ids=[*prepared.prompt_ids, *emitted],
        sampling_params=sampling_params_to_proto(prepared.sampling),
        max_tokens=prepared.max_tokens - len(emitted),
        stop_token_ids=prepared.stop_token_ids,
        ignore_eos=prepared.ignore_eos,
        max_draft_tokens=prepared.max_draft_tokens,
        output_offset=len(emitted),  # a resume: seeded sampling goes on from the same output position
        logprobs=prepared.num_logprobs is not None,
        top_logprobs=prepared.num_logprobs or 0,
        tenant=prepared.tenant,
    )


class VerifierCall:
    """One Verifier.Generate call. `messages` yields the verifier's messages but keep-alives and raises the
    classified failures above; `cancel` frees the request's KV blocks on the verifier."""

    def __init__(
        self, stub: Any, request: verifier_pb2.VerifierGenerateRequest, timeout: float, idle_s: float, address: str
    ) -> None:
        self._call = stub.Generate(request, timeout=timeout)
        self.idle_s = idle_s
        self.address = address

    def cancel(self) -> None:
        self._call.cancel()

    def done(self) -> bool:
        return self._call.done()

    async def messages(self, client_gone: Callable[[], bool]) -> AsyncIterator[verifier_pb2.VerifierGenerateResponse]:
        """`client_gone`: whether the gateway's own client has left (then a CANCELLED status is ours, not the
        verifier's). Ends at the end of the stream; the caller decides whether it ended complete."""
        got_tokens = False
        try:
            while (msg := await self._next()) is not grpc.aio.EOF:
                if is_keepalive(msg):
                    continue  # the request waits its turn on a busy verifier (it resets the idle limit)
                got_tokens = got_tokens or bool(msg.token_ids)
                yield msg
        except grpc.aio.AioRpcError as err:
            code = err.code()
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not got_tokens:
                raise VerifierFull(err.details()) from None
            if code == grpc.StatusCode.UNAVAILABLE or (code == grpc.StatusCode.CANCELLED and not client_gone()):
                raise VerifierFailed(f"verifier {self.address}: {code.name}: {err.details()}") from None
            raise VerifierError(code, err.details() or code.name) from None

    async def _next(self) -> Any:
        """The next message, or VerifierFailed when the verifier stays silent past the idle limit (a hung verifier
        that still passes health checks)."""
        try:
            return await asyncio.wait_for(self._call.read(), self.idle_s)
        except TimeoutError:
            self._call.cancel()
            raise VerifierFailed(f"verifier {self.address} sent nothing for {self.idle_s:g} s") from None


def is_keepalive(msg: verifier_pb2.VerifierGenerateResponse) -> bool:
    return not msg.token_ids and msg.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED and not msg.HasField("usage")
