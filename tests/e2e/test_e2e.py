"""End to end: client -> gateway -> verifier <-> proposer, each a separate process (see conftest.py).

Greedy outputs are compared with transformers' greedy `generate` of the target (tests/real_models.py). The
main stack drafts k = 4 tokens every step (--no-adaptive-k), so every greedy comparison also exercises
drafting, rejection and the KV rollback across the process boundary.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from gateway.health_probe import check_once
from shared.proto_gen.specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specdec_local.processes import GATEWAY_SERVICE, MAX_MODEL_LEN, K, Stack
from tests.real_models import MAX_NEW_TOKENS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RPC_TIMEOUT_S = 600.0  # the machine is shared: a request may wait a long time for the cores
UNSPECIFIED, STOP, LENGTH = (
    common_pb2.FINISH_REASON_UNSPECIFIED,
    common_pb2.FINISH_REASON_STOP,
    common_pb2.FINISH_REASON_LENGTH,
)
GREEDY_INDICES = [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]  # 5 chat-templated + 5 plain prompts


# ---- client helpers --------------------------------------------------------------------------------------


@dataclass
class Result:
    ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    messages: int = 0
    token_messages: int = 0
    final: gateway_pb2.GenerateResponse | None = None
    error: grpc.aio.AioRpcError | None = None
    cancelled: bool = False
    protocol_errors: list[str] = field(default_factory=list)
    request_id: str = ""

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def add(self, msg: gateway_pb2.GenerateResponse) -> None:
        if self.final is not None:
            self.protocol_errors.append("a message after the one with finish_reason")
        if not msg.request_id:
            self.protocol_errors.append("a message without request_id")
        elif self.messages and msg.request_id != self.request_id:
            self.protocol_errors.append(f"request_id changed from {self.request_id!r} to {msg.request_id!r}")
        self.request_id = msg.request_id
        self.messages += 1
        self.token_messages += bool(msg.token_ids)
        self.ids.extend(msg.token_ids)
        self.texts.append(msg.text)
        if msg.finish_reason != UNSPECIFIED:
            self.final = msg
        elif msg.HasField("usage"):
            self.protocol_errors.append("usage set on a message before the last one")

    def describe(self) -> str:
        if self.error is not None:
            return f"error {self.error.code().name}: {self.error.details()}"
        if self.final is None:
            return f"no final message ({len(self.ids)} tokens, cancelled={self.cancelled})"
        return (
            f"{common_pb2.FinishReason.Name(self.final.finish_reason)}, {len(self.ids)} tokens, "
            f"usage {{{str(self.final.usage).strip().replace(chr(10), ', ')}}}"
        )


class Stream:
    """One Generate call, read in a background task (so tests can act while it runs)."""

    def __init__(self, stub: gateway_pb2_grpc.GatewayStub, timeout: float = RPC_TIMEOUT_S, **fields: Any) -> None:
        self.request = gateway_pb2.GenerateRequest(**fields)
        self.result = Result()
        self.first_tokens = asyncio.Event()
        self.call = stub.Generate(self.request, timeout=timeout)
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> Result:
        try:
            async for msg in self.call:
                self.result.add(msg)
                if msg.token_ids:
                    self.first_tokens.set()
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED and self.call.cancelled():
                self.result.cancelled = True
            else:
                self.result.error = err
        except asyncio.CancelledError:
            if not self.call.cancelled():
                raise
            self.result.cancelled = True
        finally:
            self.first_tokens.set()
        return self.result

    async def started(self, timeout: float = RPC_TIMEOUT_S) -> Result:
        """Wait for the first tokens (or the end of the call)."""
        await asyncio.wait_for(self.first_tokens.wait(), timeout)
        return self.result


async def generate(stub: gateway_pb2_grpc.GatewayStub, **fields: Any) -> Result:
    return await Stream(stub, **fields).task


async def until(predicate: Callable[[], Any], timeout: float, interval: float = 0.1, what: str = "") -> float:
    """Poll a predicate (plain or async) until it is true; returns the seconds it took. TimeoutError otherwise."""
    start = time.monotonic()
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"not within {timeout:.0f} s: {what}")
        await asyncio.sleep(interval)


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def expected_greedy(ref: list[int], max_tokens: int, eos: int) -> list[int]:
    """The reference cut to max_tokens (the reference itself ends at EOS when it stopped early)."""
    if eos in ref[:max_tokens]:
        return ref[: ref.index(eos) + 1]
    return ref[:max_tokens]


def check_greedy(
    label: str, r: Result, ref: list[int], max_tokens: int, eos: int, tokenizer, drafting: bool = True
) -> list[str]:
    """Problems with one greedy result: ids, finish reason, text, usage (empty list: all correct)."""
    if r.error is not None or r.final is None:
        return [f"{label}: {r.describe()}"]
    problems = [f"{label}: {p}" for p in r.protocol_errors]
    want = expected_greedy(ref, max_tokens, eos)
    if r.ids != want:
        i = first_diff(r.ids, want)
        problems.append(
            f"{label}: {len(r.ids)} tokens, expected {len(want)}; first difference at token {i}: "
            f"got {r.ids[i : i + 5]}, expected {want[i : i + 5]}"
        )
        return problems
    if want and want[-1] == eos:
        if r.final.finish_reason != STOP or r.final.stop_token_id != eos:
            problems.append(f"{label}: ended at EOS but the final message says {r.describe()}")
    elif r.final.finish_reason != LENGTH:
        problems.append(f"{label}: expected LENGTH after {max_tokens} tokens, got {r.describe()}")
    want_text = tokenizer.decode(want, skip_special_tokens=True)
    if r.text != want_text:
        problems.append(f"{label}: streamed text {r.text!r} != decoded reference {want_text!r}")
    problems += [f"{label}: {p}" for p in usage_problems(r, drafting=drafting)]
    return problems


def usage_problems(r: Result, *, drafting: bool = True) -> list[str]:
    assert r.final is not None
    u = r.final.usage
    out = []
    if u.completion_tokens != len(r.ids):
        out.append(f"usage.completion_tokens {u.completion_tokens} != {len(r.ids)} tokens streamed")
    if u.accepted_tokens > u.drafted_tokens:
        out.append(f"usage.accepted_tokens {u.accepted_tokens} > drafted_tokens {u.drafted_tokens}")
    if not 1 <= u.num_steps <= max(u.completion_tokens, 1):
        out.append(f"usage.num_steps {u.num_steps} outside [1, completion_tokens {u.completion_tokens}]")
    if u.completion_tokens > u.accepted_tokens + u.num_steps:
        out.append(
            f"usage: {u.completion_tokens} tokens cannot come from {u.num_steps} steps with {u.accepted_tokens} "
            "accepted drafts (at most accepted + one per step)"
        )
    if r.token_messages != u.num_steps:
        out.append(f"{r.token_messages} messages carried tokens but usage.num_steps is {u.num_steps}")
    if drafting and u.completion_tokens > 1 and u.drafted_tokens == 0:
        out.append("nothing was drafted for this request (usage.drafted_tokens is 0)")
    return out


def gateway(address: str) -> tuple[grpc.aio.Channel, gateway_pb2_grpc.GatewayStub]:
    channel = grpc.aio.insecure_channel(address)
    return channel, gateway_pb2_grpc.GatewayStub(channel)


def verifier(address: str) -> tuple[grpc.aio.Channel, verifier_pb2_grpc.VerifierStub]:
    channel = grpc.aio.insecure_channel(address)
    return channel, verifier_pb2_grpc.VerifierStub(channel)


async def engine_stats(stub: verifier_pb2_grpc.VerifierStub) -> verifier_pb2.VerifierGetStatsResponse:
    return await stub.GetStats(verifier_pb2.VerifierGetStatsRequest(), timeout=30)


async def wait_engine_idle(stub: verifier_pb2_grpc.VerifierStub, timeout: float) -> tuple[float, Any]:
    """Seconds until the verifier has no request and every KV block is free again."""
    last: list[Any] = [None]

    async def idle() -> bool:
        s = (await engine_stats(stub)).stats
        last[0] = s
        return s.running_requests == 0 and s.waiting_requests == 0 and s.kv_blocks_free == s.kv_blocks_total

    try:
        return await until(idle, timeout, 0.1, "verifier idle with all KV blocks free"), last[0]
    except TimeoutError as err:
        raise AssertionError(f"{err}; last stats: {str(last[0]).strip()}") from None


# ---- 1. greedy through the whole stack ------------------------------------------------------------------


def test_greedy_streams_match_transformers(e2e_stack: Stack, prompts, greedy_references, tokenizer):
    """10 concurrent greedy streams (128 new tokens each) equal transformers' greedy output token for token;
    the streamed text equals the decoded reference; usage adds up."""
    eos = tokenizer.eos_token_id

    async def run() -> list[Result]:
        channel, stub = gateway(e2e_stack.gateway.address)
        async with channel:
            return await asyncio.gather(
                *(generate(stub, prompt_token_ids=prompts[i], max_tokens=MAX_NEW_TOKENS) for i in GREEDY_INDICES)
            )

    results = asyncio.run(run())
    problems = []
    for i, r in zip(GREEDY_INDICES, results, strict=True):
        problems += check_greedy(f"prompt {i}", r, greedy_references[i], MAX_NEW_TOKENS, eos, tokenizer)
        if r.final is not None and r.final.usage.prompt_tokens != len(prompts[i]):
            problems.append(f"prompt {i}: usage.prompt_tokens {r.final.usage.prompt_tokens} != {len(prompts[i])}")
    assert not problems, "\n".join(problems)
    drafted = sum(r.final.usage.drafted_tokens for r in results if r.final)
    accepted = sum(r.final.usage.accepted_tokens for r in results if r.final)
    assert drafted > 0 and accepted > 0, f"drafted {drafted}, accepted {accepted}: speculation did not happen"


def test_openai_client_over_http_matches_transformers(e2e_stack: Stack, greedy_references, tokenizer):
    """The gateway process's OpenAI-compatible HTTP API with the official client: a streamed greedy chat
    (the chat template applied by the gateway) is transformers' greedy output of the templated prompt."""
    import openai

    from tests.prompts import CHAT_PROMPTS

    async def run() -> tuple[str, Any, list[Any]]:
        base_url = f"http://127.0.0.1:{e2e_stack.http_port}/v1"
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=RPC_TIMEOUT_S)
        model = (await client.models.list()).data[0].id
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": CHAT_PROMPTS[0]}],
            max_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        return model, chunks[-1].usage, chunks

    _, usage, chunks = asyncio.run(run())
    ref = greedy_references[0][:32]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tokenizer.decode(ref, skip_special_tokens=True)
    assert usage.completion_tokens == len(ref) and (usage.model_extra or {})["drafted_tokens"] > 0


def test_json_schema_over_http_matches_transformers_with_the_grammar(e2e_stack: Stack, hf_target, tokenizer):
    """Structured output through the three processes: the openai client's `response_format` json_schema, greedy,
    equals transformers' greedy generation of the templated prompt with the same grammar engine's logits
    processor, the text validates against the schema, and the draft model drafted for it (its proposer masks
    its drafts with the format)."""
    import json

    import jsonschema
    import openai
    import torch

    from shared.grammar import GrammarCompiler, GrammarLogitsProcessor, StructuredOutput
    from tests.integration.test_structured_exactness import PERSON
    from tests.prompts import _ids

    question = "Describe a famous scientist as JSON."
    max_tokens = 48

    async def run() -> Any:
        base_url = f"http://127.0.0.1:{e2e_stack.http_port}/v1"
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=RPC_TIMEOUT_S)
        return await client.chat.completions.create(
            model=(await client.models.list()).data[0].id,
            messages=[{"role": "user", "content": question}],
            max_tokens=max_tokens,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        )

    reply = asyncio.run(run())
    prompt = _ids(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
    )
    compiler = GrammarCompiler(tokenizer, hf_target.config.vocab_size, (tokenizer.eos_token_id,))
    processor = GrammarLogitsProcessor(compiler, [StructuredOutput("json_schema", json.dumps(PERSON))], len(prompt))
    with torch.no_grad():
        out = hf_target.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, logits_processor=[processor]
        )
    reference = tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True)
    text = reply.choices[0].message.content
    assert text == reference
    jsonschema.validate(json.loads(text), PERSON)
    assert reply.choices[0].finish_reason == "stop"
    assert (reply.usage.model_extra or {})["drafted_tokens"] > 0


# ---- 2. many concurrent clients, mixed parameters --------------------------------------------------------


def _stop_string_case(tokenizer, ref: list[int]) -> tuple[str, list[int], str]:
    """A stop string taken from the reference's text a few tokens in: (stop, expected ids, expected text)."""
    full = tokenizer.decode(ref, skip_special_tokens=True)
    for n in range(6, 40):
        start = len(tokenizer.decode(ref[:n], skip_special_tokens=True))
        stop = full[start : start + 4]
        if len(stop) == 4 and stop.strip() and stop.isascii():
            break
    else:
        raise AssertionError("no usable stop string in the reference")
    cut = full.index(stop)
    m = next(m for m in range(1, len(ref) + 1) if stop in tokenizer.decode(ref[:m], skip_special_tokens=True))
    return stop, ref[:m], full[:cut]


def test_sixteen_concurrent_clients_mixed(e2e_stack: Stack, prompts, greedy_references, tokenizer):
    """16 streams at once: greedy ones with various max_tokens (exact prefixes of the reference), one with a
    stop string, one with a stop token id, and sampled ones (temperature / top-p / top-k / min-p / seed)."""
    eos = tokenizer.eos_token_id
    vocab = e2e_stack.verifier_stats().vocab_size
    greedy = [(5, 8), (6, 12), (7, 16), (15, 24), (16, 32), (17, 40)]  # (prompt, max_tokens)
    stop_prompt, stop_token_prompt = 13, 18
    stop, stop_ids, stop_text = _stop_string_case(tokenizer, greedy_references[stop_prompt])
    ref_st = greedy_references[stop_token_prompt]
    stop_token = ref_st[5]
    stop_token_ids = ref_st[: ref_st.index(stop_token) + 1]
    sampled = [  # (prompt, max_tokens, sampling fields)
        (0, 24, dict(temperature=0.8, seed=1)),
        (1, 16, dict(temperature=1.0, top_p=0.9, seed=2)),
        (2, 32, dict(temperature=0.7, top_k=20, seed=3)),
        (3, 12, dict(temperature=1.2, top_p=0.8, top_k=50, seed=4)),
        (4, 20, dict(temperature=0.5, min_p=0.05, seed=5)),
        (11, 28, dict(temperature=0.9, top_k=5)),  # unseeded
        (12, 16, dict(temperature=1.0, top_p=0.95, seed=7)),
        (19, 24, dict(temperature=0.3, seed=8)),
    ]

    async def run():
        channel, stub = gateway(e2e_stack.gateway.address)
        async with channel:
            calls = [generate(stub, prompt_token_ids=prompts[i], max_tokens=n) for i, n in greedy]
            calls.append(generate(stub, prompt_token_ids=prompts[stop_prompt], max_tokens=64, stop=[stop]))
            calls.append(
                generate(stub, prompt_token_ids=prompts[stop_token_prompt], max_tokens=32, stop_token_ids=[stop_token])
            )
            calls += [generate(stub, prompt_token_ids=prompts[i], max_tokens=n, **kw) for i, n, kw in sampled]
            assert len(calls) == 16
            return await asyncio.gather(*calls)

    results = asyncio.run(run())
    problems = []
    for (i, n), r in zip(greedy, results[: len(greedy)], strict=True):
        problems += check_greedy(f"greedy prompt {i} max_tokens {n}", r, greedy_references[i], n, eos, tokenizer)

    r = results[len(greedy)]
    label = f"stop string {stop!r} on prompt {stop_prompt}"
    if r.final is None or r.error is not None:
        problems.append(f"{label}: {r.describe()}")
    else:
        if r.ids != stop_ids:
            problems.append(f"{label}: ids {r.ids} != {stop_ids} (reference up to the token completing the match)")
        if r.text != stop_text:
            problems.append(f"{label}: text {r.text!r} != {stop_text!r}")
        if r.final.finish_reason != STOP or r.final.stop_string != stop:
            problems.append(f"{label}: final message {r.describe()}, stop_string {r.final.stop_string!r}")

    r = results[len(greedy) + 1]
    label = f"stop token {stop_token} on prompt {stop_token_prompt}"
    if r.final is None or r.error is not None:
        problems.append(f"{label}: {r.describe()}")
    else:
        if r.ids != stop_token_ids:
            problems.append(f"{label}: ids {r.ids} != {stop_token_ids}")
        if r.final.finish_reason != STOP or r.final.stop_token_id != stop_token:
            problems.append(f"{label}: final message {r.describe()}, stop_token_id {r.final.stop_token_id}")
        if r.text != tokenizer.decode(stop_token_ids, skip_special_tokens=True):
            problems.append(f"{label}: text {r.text!r} is not the decoded ids")

    for (i, n, kw), r in zip(sampled, results[len(greedy) + 2 :], strict=True):
        label = f"sampled prompt {i} max_tokens {n} {kw}"
        if r.final is None or r.error is not None:
            problems.append(f"{label}: {r.describe()}")
            continue
        problems += [f"{label}: {p}" for p in r.protocol_errors + usage_problems(r)]
        if not all(0 <= t < vocab for t in r.ids):
            problems.append(f"{label}: token ids outside [0, {vocab}): {r.ids}")
        if r.final.finish_reason == LENGTH:
            if len(r.ids) != n:
                problems.append(f"{label}: LENGTH after {len(r.ids)} tokens")
        elif r.final.finish_reason == STOP:
            if not (r.ids and r.ids[-1] == eos == r.final.stop_token_id and len(r.ids) <= n):
                problems.append(f"{label}: STOP but {r.describe()}, last ids {r.ids[-3:]}")
        else:
            problems.append(f"{label}: unexpected {r.describe()}")
        if not r.text.strip():
            problems.append(f"{label}: empty text for ids {r.ids}")
        elif r.text != tokenizer.decode(r.ids, skip_special_tokens=True):
            problems.append(f"{label}: streamed text != decoded ids")
    assert not problems, "\n".join(problems)


# ---- 3. cancellation frees the KV blocks -----------------------------------------------------------------


def test_cancel_mid_stream_frees_kv_blocks(e2e_stack: Stack, prompts):
    async def run():
        gch, stub = gateway(e2e_stack.gateway.address)
        vch, vstub = verifier(e2e_stack.verifier.address)
        async with gch, vch:
            idle_s, before = await wait_engine_idle(vstub, 60)  # nothing left over from earlier tests
            stream = Stream(stub, prompt_token_ids=prompts[10], max_tokens=600, ignore_eos=True)
            await until(lambda: stream.result.token_messages >= 3 or stream.task.done(), RPC_TIMEOUT_S)
            assert stream.result.error is None and not stream.task.done(), stream.result.describe()
            busy = (await engine_stats(vstub)).stats
            assert busy.running_requests == 1 and busy.kv_blocks_free < busy.kv_blocks_total, str(busy)
            got = len(stream.result.ids)
            stream.call.cancel()
            result = await stream.task
            freed_s, after = await wait_engine_idle(vstub, 20)
            gstats = await stub.GetStats(gateway_pb2.GetStatsRequest(), timeout=30)
            return before, busy, got, result, freed_s, after, gstats

    before, busy, got, result, freed_s, after, gstats = asyncio.run(run())
    assert result.cancelled and result.final is None, result.describe()
    assert got < 600
    assert after.aborted_requests == before.aborted_requests + 1, (before, after)
    assert gstats.active_requests == 0, str(gstats)
    print(f"KV blocks free again {freed_s:.2f} s after the cancel ({busy.kv_blocks_used} were used)")


# ---- 4. bad input: INVALID_ARGUMENT through the gateway, while a good stream goes on ----------------------


def test_bad_inputs_invalid_argument(e2e_stack: Stack, prompts, greedy_references, tokenizer):
    stats = e2e_stack.verifier_stats()
    vocab, context = stats.vocab_size, stats.max_model_len
    assert context == MAX_MODEL_LEN
    p = prompts[11]
    long_prompt = (p * (context // len(p) + 2))[: context + 5]
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("empty prompt", dict(prompt_token_ids=[]), "prompt"),
        ("prompt and prompt_token_ids both set", dict(prompt="hi", prompt_token_ids=p), "prompt"),
        ("prompt longer than the context", dict(prompt_token_ids=long_prompt), "context"),
        ("prompt exactly the context", dict(prompt_token_ids=long_prompt[:context]), "context"),
        ("max_tokens 0", dict(prompt_token_ids=p, max_tokens=0), "max_tokens"),
        ("max_tokens beyond the context", dict(prompt_token_ids=p, max_tokens=context + 1), "max_tokens"),
        ("max_tokens beyond the limit", dict(prompt_token_ids=p, max_tokens=1_000_000), "max_tokens"),
        ("temperature < 0", dict(prompt_token_ids=p, temperature=-0.5), "temperature"),
        ("temperature NaN", dict(prompt_token_ids=p, temperature=float("nan")), "temperature"),
        ("top_p 0", dict(prompt_token_ids=p, top_p=0.0), "top_p"),
        ("top_p 1.5", dict(prompt_token_ids=p, top_p=1.5), "top_p"),
        ("top_k < 0", dict(prompt_token_ids=p, top_k=-1), "top_k"),
        ("min_p > 1", dict(prompt_token_ids=p, min_p=1.5), "min_p"),
        ("token id = vocabulary size", dict(prompt_token_ids=[*p, vocab]), "vocabulary"),
        ("negative token id", dict(prompt_token_ids=[-1, *p]), "vocabulary"),
        ("stop token id outside the vocabulary", dict(prompt_token_ids=p, stop_token_ids=[vocab + 7]), "vocabulary"),
        ("empty stop string", dict(prompt_token_ids=p, stop=["\n\n", ""]), "stop"),
    ]
    background_prompt, background_tokens = 12, 40

    async def run():
        channel, stub = gateway(e2e_stack.gateway.address)
        async with channel:
            background = Stream(stub, prompt_token_ids=prompts[background_prompt], max_tokens=background_tokens)
            await background.started()
            running_during = []
            outcomes = []
            for label, fields, word in cases:
                streamed = await generate(stub, timeout=60, **fields)
                try:
                    await stub.Complete(gateway_pb2.CompleteRequest(**fields), timeout=60)
                    unary: Any = None
                except grpc.aio.AioRpcError as err:
                    unary = err
                outcomes.append((label, word, streamed, unary))
                running_during.append(not background.task.done())
            return outcomes, await background.task, running_during

    outcomes, background, running_during = asyncio.run(run())
    problems = []
    for label, word, streamed, unary in outcomes:
        for how, err in (("Generate", streamed.error), ("Complete", unary)):
            if err is None:
                problems.append(f"{label} ({how}): accepted ({streamed.describe() if how == 'Generate' else 'OK'})")
            elif err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                problems.append(f"{label} ({how}): {err.code().name} {err.details()!r}, expected INVALID_ARGUMENT")
            elif word.lower() not in (err.details() or "").lower() or len(err.details()) < 15:
                problems.append(f"{label} ({how}): message {err.details()!r} does not explain it (no {word!r})")
    problems += check_greedy(
        f"background stream (prompt {background_prompt})",
        background,
        greedy_references[background_prompt],
        background_tokens,
        tokenizer.eos_token_id,
        tokenizer,
    )
    assert not problems, "\n".join(problems)
    assert running_during[0], "the background stream had finished before the first bad request: nothing was shown"


# ---- 5. queue full: RESOURCE_EXHAUSTED -----------------------------------------------------------------


def test_queue_full_resource_exhausted(fault_stack: Stack, prompts):
    """The fault verifier runs 3 sequences and queues 1 (--max-num-seqs 3 --max-waiting 1): a 5th
    concurrent request is refused with RESOURCE_EXHAUSTED; the others are unaffected; cancelling them
    (the waiting one included) frees every block."""

    async def run():
        gch, stub = gateway(fault_stack.gateway.address)
        vch, vstub = verifier(fault_stack.verifier.address)
        async with gch, vch:
            await wait_engine_idle(vstub, 60)
            streams = []
            for i in range(3):  # one at a time: a burst would find the waiting slot taken
                s = Stream(stub, prompt_token_ids=prompts[10 + i], max_tokens=500, ignore_eos=True)
                streams.append(s)
                await s.started()
                assert s.result.error is None, s.result.describe()
            streams.append(Stream(stub, prompt_token_ids=prompts[13], max_tokens=500, ignore_eos=True))

            async def one_waiting() -> bool:
                s = (await engine_stats(vstub)).stats
                return s.running_requests == 3 and s.waiting_requests == 1

            await until(one_waiting, 60, what="3 running and 1 waiting request on the fault verifier")
            refused = await generate(stub, prompt_token_ids=prompts[14], max_tokens=8)
            try:
                await stub.Complete(gateway_pb2.CompleteRequest(prompt_token_ids=prompts[14], max_tokens=8), timeout=60)
                unary: Any = None
            except grpc.aio.AioRpcError as err:
                unary = err
            alive = [not s.task.done() for s in streams]
            for s in streams:
                s.call.cancel()
            results = await asyncio.gather(*(s.task for s in streams))
            freed_s, _ = await wait_engine_idle(vstub, 30)
            return refused, unary, alive, results, freed_s

    refused, unary, alive, results, freed_s = asyncio.run(run())
    for how, err in (("Generate", refused.error), ("Complete", unary)):
        assert err is not None, f"{how}: the 5th request was accepted: {refused.describe()}"
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{how}: {err.code().name}: {err.details()}"
        assert "wait" in err.details().lower(), f"{how}: unhelpful message {err.details()!r}"
    assert all(alive), f"a running or waiting request ended when the 5th was refused: {alive}"
    assert all(r.error is None for r in results), [r.describe() for r in results]


# ---- 6. the proposer dies mid-generation -----------------------------------------------------------------


def test_proposer_killed_mid_generation(fault_stack: Stack, prompts, greedy_references, tokenizer):
    """SIGKILL the proposer while three greedy requests run: they finish with exactly the reference tokens,
    decoding plainly (k = 0) from then on; the verifier reports the proposer disconnected."""
    eos = tokenizer.eos_token_id
    max_tokens = 48
    # prompts whose reference does not stop before max_tokens, so each request has tokens left at the kill
    indices = [i for i in (15, 16, 17, 18, 19, 10, 11, 12) if eos not in greedy_references[i][:max_tokens]][:3]
    assert len(indices) == 3

    async def run():
        gch, stub = gateway(fault_stack.gateway.address)
        vch, vstub = verifier(fault_stack.verifier.address)
        async with gch, vch:
            await wait_engine_idle(vstub, 60)
            before = (await engine_stats(vstub)).stats
            assert before.proposer_connected, "the fault verifier is not connected to its proposer"
            streams = []
            for i in indices:  # one at a time: this verifier queues at most one request (see the queue test)
                s = Stream(stub, prompt_token_ids=prompts[i], max_tokens=max_tokens)
                streams.append(s)
                await s.started()
            drafted_before_kill = (await engine_stats(vstub)).stats.drafted_tokens
            progress = [len(s.result.ids) for s in streams]
            fault_stack.proposer.kill()
            disconnected: list[Any] = []

            async def noticed() -> bool:
                s = (await engine_stats(vstub)).stats
                disconnected[:] = [s]
                return not s.proposer_connected

            await until(noticed, 60, what="the verifier to notice the dead proposer")
            results = await asyncio.gather(*(s.task for s in streams))
            after = (await engine_stats(vstub)).stats
            return before, drafted_before_kill, progress, disconnected[0], results, after

    before, drafted_before_kill, progress, at_notice, results, after = asyncio.run(run())
    problems = []
    for i, r in zip(indices, results, strict=True):
        # drafting=False: the last request may not have reached a drafting step before the kill
        problems += check_greedy(f"prompt {i}", r, greedy_references[i], max_tokens, eos, tokenizer, drafting=False)
    assert not problems, "\n".join(problems)
    assert all(n < max_tokens for n in progress), f"a request had finished before the kill: {progress}"
    assert drafted_before_kill > before.drafted_tokens, "nothing was drafted before the kill"
    assert not after.proposer_connected
    assert after.drafted_tokens == at_notice.drafted_tokens, "drafted tokens grew although the proposer is dead"
    assert after.emitted_tokens > at_notice.emitted_tokens, "no tokens were produced after the proposer died"
    drafted = sum(r.final.usage.drafted_tokens for r in results)
    full_k = sum(K * (r.final.usage.num_steps - 1) for r in results)
    assert drafted < full_k, f"usage shows {drafted} drafted tokens: no fallback to k = 0 ({full_k} at full k)"


# ---- 7. no healthy verifier: UNAVAILABLE -----------------------------------------------------------------


def test_no_healthy_verifier_unavailable(orphan_gateway: Stack, prompts):
    address = orphan_gateway.gateway.address
    ready, state = check_once(address, GATEWAY_SERVICE)
    assert not ready and state == health_pb2.HealthCheckResponse.ServingStatus.Name(
        health_pb2.HealthCheckResponse.NOT_SERVING
    ), f"readiness of a gateway without verifiers: {state}"

    async def run():
        channel, stub = gateway(address)
        async with channel:
            streamed = await generate(stub, prompt_token_ids=prompts[0], max_tokens=4, timeout=60)
            try:
                await stub.Complete(gateway_pb2.CompleteRequest(prompt="Hello", max_tokens=4), timeout=60)
                unary: Any = None
            except grpc.aio.AioRpcError as err:
                unary = err
            stats = await stub.GetStats(gateway_pb2.GetStatsRequest(), timeout=30)
            return streamed, unary, stats

    streamed, unary, stats = asyncio.run(run())
    for how, err in (("Generate", streamed.error), ("Complete", unary)):
        assert err is not None, f"{how} succeeded without a verifier"
        assert err.code() == grpc.StatusCode.UNAVAILABLE, f"{how}: {err.code().name}: {err.details()}"
        assert len(err.details() or "") > 10, f"{how}: unhelpful message {err.details()!r}"
    assert [b.healthy for b in stats.backends] == [False], str(stats)
