"""The verifier service: a thin gRPC layer over the EngineLoop.

Generate: VerifierGenerateRequest -> (prompt ids, SamplingParams) -> EngineLoop.generate -> one
VerifierGenerateResponse per engine step that committed tokens; the last one carries finish_reason and
usage. Domain errors become status codes through shared.errors.grpc_status_for only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc

from shared.config import load_config
from shared.errors import InvalidRequestError, SpecdecError, grpc_status_for
from shared.grpc_server import add_health_and_reflection, new_server, set_serving, setup_logging
from shared.logprobs import check_top_logprobs
from shared.logprobs import to_proto as logprobs_to_proto
from shared.malloc_tuning import tune_malloc
from shared.model.config import ModelArch
from shared.model.llama import LlamaModel
from shared.model.tp_group import TPModelRunner
from shared.omp_defaults import model_thread
from shared.proto_convert import sampling_params_from_proto
from shared.proto_gen.specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from shared.request_ids import check_request_id, checked_or_empty, new_internal_id
from shared.sampling import SamplingParams
from shared.service_runtime import ServiceRuntime
from shared.telemetry import Telemetry, setup_telemetry
from shared.tls import add_port, check_files_or_exit, server_interceptors
from verifier_service.config import VerifierConfig
from verifier_service.engine_loop import EngineLoop, StatsSnapshot, Update
from verifier_service.remote_proposer import RemoteProposer
from verifier_service.sequence import FinishReason
from verifier_service.telemetry import VerifierTelemetry

log = logging.getLogger("specdec.verifier")

RANK_FAILURE_DRAIN_S = 3.0  # time for the failing step to fail its requests (UNAVAILABLE) before exiting

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
FINISH_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}


# ---- proto <-> domain ---------------------------------------------------------------------------


def request_to_domain(
    request: verifier_pb2.VerifierGenerateRequest, *, max_model_len: int, default_max_tokens: int
) -> tuple[list[int], SamplingParams, int | None]:
    """(prompt ids, sampling params, max_draft_tokens). Raises InvalidRequestError with a readable message.
    The logprobs fields: see num_logprobs_of.

    Sampling values, token ids, the prompt's length and stop ids are checked by the engine
    (SamplingParams.validate), so the checks hold for every caller and are written once.
    """
    prompt = list(request.prompt_token_ids)
    if not prompt:
        raise InvalidRequestError("prompt_token_ids is empty: send at least one token")
    max_tokens = request.max_tokens if request.HasField("max_tokens") else default_max_tokens
    if request.HasField("max_tokens") and max_tokens > max_model_len:
        raise InvalidRequestError(f"max_tokens {max_tokens} is beyond the context length {max_model_len}")
    params = sampling_params_from_proto(
        request.sampling_params,
        max_tokens=max_tokens,
        stop_token_ids=tuple(request.stop_token_ids),
        ignore_eos=request.ignore_eos,
    )
    max_draft = request.max_draft_tokens if request.HasField("max_draft_tokens") else None
    return prompt, params, max_draft


def num_logprobs_of(request: verifier_pb2.VerifierGenerateRequest) -> int | None:
    """None without logprobs, else the number of top alternatives per token."""
    why = check_top_logprobs(request.logprobs, request.top_logprobs)
    if why is not None:
        raise InvalidRequestError(why)
    return request.top_logprobs if request.logprobs else None


def update_to_proto(update: Update, num_logprobs: int | None = None) -> verifier_pb2.VerifierGenerateResponse:
    msg = verifier_pb2.VerifierGenerateResponse(
        token_ids=update.token_ids,
        finish_reason=FINISH_TO_PROTO[update.finish_reason],
        drafted_tokens=update.usage.drafted_tokens,  # running counts: they outlive this verifier's death
        accepted_tokens=update.usage.accepted_tokens,
    )
    if num_logprobs is not None:
        logprobs_to_proto(update.logprobs or [], num_logprobs, msg.logprobs)
    if update.finished:
        msg.usage.CopyFrom(_by_name(common_pb2.Usage, update.usage))
        if update.stop_token_id is not None:
            msg.stop_token_id = update.stop_token_id
    return msg


def stats_to_proto(s: StatsSnapshot) -> common_pb2.EngineStats:
    return _by_name(common_pb2.EngineStats, s)


def _by_name(message_type, source):
    """A message whose every field is the source's field or property of the same name (the domain objects
    RequestUsage and StatsSnapshot hold the protos' fields, so one cannot fall behind the other silently)."""
    return message_type(**{f.name: getattr(source, f.name) for f in message_type.DESCRIPTOR.fields})


# ---- the servicer -------------------------------------------------------------------------------


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(
        self,
        loop: EngineLoop,
        *,
        model_name: str,
        max_model_len: int,
        vocab_size: int,
        default_max_tokens: int,
        tensor_parallel_size: int = 1,
        telemetry: VerifierTelemetry | None = None,
        keepalive_interval_s: float = 10.0,
    ) -> None:
        self.loop = loop
        self.keepalive_interval_s = keepalive_interval_s
        self.telemetry = telemetry or VerifierTelemetry(Telemetry("specdec-verifier"), loop.engine, None, loop)
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.default_max_tokens = default_max_tokens
        self.tensor_parallel_size = tensor_parallel_size

    async def Generate(  # type: ignore[override]
        self, request: verifier_pb2.VerifierGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[verifier_pb2.VerifierGenerateResponse]:
        # The engine and the proposer key requests by our own id: two callers that send the same id must not
        # collide. The caller's id, once checked, is kept beside it in logs and the span.
        request_id = new_internal_id()
        caller_id = checked_or_empty(request.request_id)  # a bad one is refused below, with the reason
        started = time.monotonic()
        traced = self.telemetry.request_started(
            request_id, request.session_id, len(request.prompt_token_ids), caller_id
        )
        try:
            check_request_id(request.request_id)
            prompt, params, max_draft = request_to_domain(
                request, max_model_len=self.max_model_len, default_max_tokens=self.default_max_tokens
            )
            num_logprobs = num_logprobs_of(request)
            updates = self.loop.generate(
                request_id,
                prompt,
                params,
                max_draft,
                request.output_offset,
                num_logprobs,
                request.tenant,
                keepalive_s=self.keepalive_interval_s,
            )
            async with contextlib.aclosing(updates):
                async for update in updates:
                    if update is None:
                        yield verifier_pb2.VerifierGenerateResponse()  # still queued; the engine is alive
                        continue
                    self.telemetry.request_update(traced, len(update.token_ids))
                    yield update_to_proto(update, num_logprobs)
                    if update.finished:
                        u = update.usage
                        self.telemetry.request_finished(traced, u, update.finish_reason)
                        log.info(
                            "request finished request_id=%s caller_request_id=%s reason=%s prompt_tokens=%d "
                            "completion_tokens=%d drafted=%d accepted=%d steps=%d seconds=%.3f",
                            request_id,
                            caller_id,
                            update.finish_reason,
                            u.prompt_tokens,
                            u.completion_tokens,
                            u.drafted_tokens,
                            u.accepted_tokens,
                            u.num_steps,
                            time.monotonic() - started,
                        )
        except (SpecdecError, TimeoutError) as err:
            code, message = grpc_status_for(err)
            log.info(
                "request rejected request_id=%s caller_request_id=%s code=%s message=%s",
                request_id,
                caller_id,
                code.name,
                message,
            )
            self.telemetry.request_failed(traced, code, message)
            await context.abort(code, message)
        except Exception as err:  # an engine failure: INTERNAL, the other requests go on
            code, message = grpc_status_for(err)
            log.error("request failed request_id=%s message=%s", request_id, message, exc_info=err)
            self.telemetry.request_failed(traced, code, message)
            await context.abort(code, message)
        finally:  # cancelled by the client (or ended above): no-op when already ended
            self.telemetry.request_cancelled(traced)

    async def GetStats(
        self, request: verifier_pb2.VerifierGetStatsRequest, context: grpc.aio.ServicerContext
    ) -> verifier_pb2.VerifierGetStatsResponse:
        return verifier_pb2.VerifierGetStatsResponse(
            stats=stats_to_proto(self.loop.stats()),
            model=self.model_name,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            tensor_parallel_size=self.tensor_parallel_size,
            eos_token_ids=sorted(self.loop.engine.eos_token_ids),
        )


# ---- building and serving -----------------------------------------------------------------------


class VerifierServer(ServiceRuntime):
    """A running verifier: engine loop, optional remote proposer, gRPC server with health and reflection."""

    role = "verifier"
    log = log

    def __init__(
        self,
        config: VerifierConfig,
        server: grpc.aio.Server,
        servicer: VerifierServicer,
        health,
        port: int,
        loop: EngineLoop,
        proposer: RemoteProposer | None,
    ) -> None:
        super().__init__()
        self.config = config
        self.server = server
        self.servicer = servicer
        self.health = health
        self.port = port
        self.loop = loop
        self.proposer = proposer
        self.telemetry = Telemetry("specdec-verifier")

    @classmethod
    async def start(
        cls,
        config: VerifierConfig,
        target: tuple[LlamaModel, ModelArch] | None = None,
        model_name: str | None = None,
        tokenizer_fingerprint: str | None = None,
        telemetry: Telemetry | None = None,
    ) -> VerifierServer:
        """Load the target (unless given), connect the proposer(s), build the engine and serve.

        At --tensor-parallel-size N > 1 the target is loaded from `config.model` by N ranks (this process
        is rank 0; see shared/model/tp_group.py), so `target` must not be given. `telemetry`: default from
        the OTEL_* environment and --metrics-port (shared/telemetry.py)."""
        from shared.model.build import read_arch
        from shared.settings import default_target_model
        from verifier_service.builder import build_service_engine

        name = model_name or config.model or default_target_model()
        arch = target[1] if target is not None else await asyncio.to_thread(read_arch, name)
        proposer = remote_proposer(config, arch, name, tokenizer_fingerprint)
        if proposer is not None:
            await proposer.start()
        # The engine is built (target loaded, packed, warmed up) on the thread that will run its steps (EngineLoop).
        step_thread = model_thread("engine-step")
        try:
            engine = await asyncio.get_running_loop().run_in_executor(
                step_thread, build_service_engine, config, name, target, proposer
            )
        except BaseException:
            step_thread.shutdown(wait=False)
            if proposer is not None:
                await proposer.close()
            raise
        loop = EngineLoop(engine, proposer, step_thread=step_thread)
        if telemetry is None:
            telemetry = setup_telemetry("specdec-verifier", metrics_port=config.metrics_port, metrics_host=config.host)
        observer = VerifierTelemetry(telemetry, engine, proposer, loop)
        await loop.start()
        servicer = VerifierServicer(
            loop,
            model_name=name,
            max_model_len=engine.config.max_model_len,
            vocab_size=arch.vocab_size,
            default_max_tokens=config.default_max_tokens,
            tensor_parallel_size=config.tensor_parallel_size,
            telemetry=observer,
            keepalive_interval_s=config.keepalive_interval_s,
        )
        server = new_server([*telemetry.server_interceptors(), *server_interceptors(config)])
        verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
        health = add_health_and_reflection(server, [SERVICE_NAME])
        port = add_port(server, config.host, config.port, config, "verifier")
        if not port:
            if isinstance(engine.runner, TPModelRunner):
                await asyncio.to_thread(engine.runner.close)
            telemetry.shutdown()
            raise OSError(f"cannot listen on {config.host}:{config.port}")
        await server.start()
        await set_serving(health, [SERVICE_NAME], True)
        instance = cls(config, server, servicer, health, port, loop, proposer)
        instance._log_serving(name)
        instance.telemetry = telemetry
        instance.watch_rank_failures()
        loop.on_dead = instance._engine_loop_died
        return instance

    def _log_serving(self, model_name: str) -> None:
        config, engine = self.config, self.loop.engine
        log.info(
            "verifier serving host=%s port=%d model=%s k=%d proposers=%s kv_blocks=%d block_size=%d max_model_len=%d "
            "tensor_parallel_size=%d prefix_caching=%s",
            config.host,
            self.port,
            model_name,
            config.num_speculative_tokens if self.proposer is not None else 0,
            ",".join(config.proposer) or "none",
            engine.blocks.num_blocks,
            engine.blocks.block_size,
            engine.config.max_model_len,
            config.tensor_parallel_size,
            config.enable_prefix_caching,
        )

    def _engine_loop_died(self, err: BaseException) -> None:
        """NOT_SERVING, so that gateways and Kubernetes stop sending requests here (the process stays up for
        its logs and /metrics; the liveness probe, which checks the same health, restarts it)."""
        self._dying = asyncio.get_running_loop().create_task(set_serving(self.health, [SERVICE_NAME], False))

    @property
    def tp_runner(self) -> TPModelRunner | None:
        runner = self.loop.engine.runner
        return runner if isinstance(runner, TPModelRunner) else None

    async def _fail(self, reason: str) -> None:
        """A rank died: NOT_SERVING at once, refuse new requests, let the failing step fail the running ones
        (UNAVAILABLE: the gateway resumes them elsewhere), then `failed` (serve() exits non-zero)."""
        log.error("tensor-parallel rank failure, the verifier stops serving: %s", reason)
        await set_serving(self.health, [SERVICE_NAME], False)
        self.loop.stop_accepting()
        await self.loop.drain(RANK_FAILURE_DRAIN_S)
        await self.server.stop(0.5)  # the UNAVAILABLE statuses flush
        self.failed.set()

    async def shutdown(self, grace_s: float | None = None) -> None:
        """NOT_SERVING; refuse new requests; let running ones finish within grace_s; end the rest with
        UNAVAILABLE (the gateway resumes them on another verifier: a rolling restart cuts no answer short);
        stop the server and the engine loop."""
        grace = self.config.grace_period_s if grace_s is None else grace_s
        log.info("verifier shutting down grace_s=%.1f requests=%d", grace, self.loop.num_requests)
        await set_serving(self.health, [SERVICE_NAME], False)
        self.loop.stop_accepting()
        if not await self.loop.drain(grace):
            handed = await self.loop.hand_over_all("the verifier is shutting down; resume on another verifier")
            log.warning("grace period over: %d requests end with UNAVAILABLE, to resume elsewhere", handed)
        await self.server.stop(1.0)  # their statuses flush first
        await self.loop.stop()
        if self.proposer is not None:
            await self.proposer.close()
        if self.tp_runner is not None:
            await asyncio.to_thread(self.tp_runner.close)  # "stop" to the other ranks, then wait for them
        await asyncio.to_thread(self.telemetry.shutdown)  # flushes spans still batched for export
        log.info("verifier stopped")


def remote_proposer(
    config: VerifierConfig, target: ModelArch, target_name: str, tokenizer_fingerprint: str | None = None
) -> RemoteProposer | None:
    """The drafter the flags name: a stream to the first reachable --proposer (not started), or None (k = 0).
    `tokenizer_fingerprint`: the target's (None: read from its tokenizer.json)."""
    if not config.proposer or config.num_speculative_tokens <= 0:
        return None
    from shared.model.info import resolve_device
    from shared.model.info import tokenizer_fingerprint as fingerprint_of

    if tokenizer_fingerprint is None:
        tokenizer_fingerprint = fingerprint_of(target_name)
    return RemoteProposer(
        config.proposer,
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        feature_layers=config.capturable_layers(target.num_layers),
        tokenizer_fingerprint=tokenizer_fingerprint,
        timeout_s=config.proposer_timeout_ms / 1000,
        reconnect_max_s=config.proposer_reconnect_max_s,
        tls=config.client_tls(config.tls_server_name),
        max_draft_support=config.max_draft_support,
        max_tree_nodes=config.max_tree_nodes,
        target_on_cpu=resolve_device(config.device) == "cpu",
    )


async def serve(config: VerifierConfig, on_ready: Callable[[VerifierServer], None] | None = None) -> None:
    await VerifierServer.serve_until_stopped(lambda: VerifierServer.start(config), config.grace_period_s, on_ready)


def main(argv: list[str] | None = None) -> None:
    config = load_config(VerifierConfig, argv)
    setup_logging(config.log_level)
    check_files_or_exit(config, "verifier")
    tune_malloc()
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
