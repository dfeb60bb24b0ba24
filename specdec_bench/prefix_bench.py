"""Prefix-caching benchmark: time to first token of the later turns of a conversation, with and without
the verifier's prefix cache, through the whole gRPC stack.

    python -m specdec_bench.prefix_bench [--runs N] [--out docs/BENCHMARKS.md]

Two stacks of real processes on loopback (proposer with the draft model, verifier with k = 4, gateway),
identical except that one runs with --no-enable-prefix-caching (verifier and proposer). A client holds
a 5-turn conversation with each: turn 1 is a ~900-token system prompt (the benchmark's prompt texts as a
document to discuss) plus a question; each later turn sends the WHOLE conversation as token ids (the
previous prompt, the 32 generated tokens, the next user message in the chat template) with a session_id,
as a client of an OpenAI-style API does. So the second turn carries ~1,250 tokens of history (the
issue asks for about 1,000). Each run is a new conversation (the system prompt starts with the run
number), so no run reuses another's cache. Greedy,
EOS ignored, 32 tokens per turn. TTFT is measured at the client: request sent -> first streamed message
with tokens. The stacks alternate conversation by conversation (the order rotates every run); the
ratio no-cache / cache is taken within a run and the median over runs is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

from shared.malloc_tuning import tune_malloc
from shared.proto_gen.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from shared.settings import default_draft_model, default_target_model
from specdec_bench.engine_bench import NUM_THREADS
from specdec_bench.gateway_bench import HOST, STARTUP_TIMEOUT_S, Proc, Stack, _command, free_port
from specdec_bench.prompts import GENERAL_PROMPTS, QUOTING_PROMPTS
from specdec_bench.report import load_average, run_meta, write_report

TURNS = 5
MAX_TOKENS = 32
MAX_MODEL_LEN = 2048
K = 4
MARK_START = "<!-- prefix-bench:start -->"
MARK_END = "<!-- prefix-bench:end -->"
TARGET_SPEEDUP = 5.0
QUESTIONS = (
    "Which of the functions in the document above raises an error, and when?",
    "Summarise the document above in two sentences.",
    "Now list three of the chat requests in it.",
    "Which request would you answer first, and why?",
    "Thank you. Anything else worth noting?",
)


def build_stack(name: str, log_dir: Path, target: str, draft: str, caching: bool) -> Stack:
    ports = {role: free_port() for role in ("proposer", "verifier", "gateway")}
    flag = [] if caching else ["--no-enable-prefix-caching"]
    proposer = ["--kind", "draft-model", "--model", draft, "--host", HOST, "--port", str(ports["proposer"])]
    proposer += ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "2", *flag]
    verifier = ["--model", target, "--host", HOST, "--port", str(ports["verifier"])]
    verifier += ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "2", *flag]
    verifier += ["--proposer", f"{HOST}:{ports['proposer']}", "--num-speculative-tokens", str(K)]
    gateway = ["--verifiers", f"{HOST}:{ports['verifier']}", "--tokenizer", target]
    gateway += ["--host", HOST, "--port", str(ports["gateway"]), "--health-check-timeout-s", "5", "--http-port", "0"]
    parts = (
        ("proposer", "specdec-proposer", "proposer_service.server", proposer),
        ("verifier", "specdec-verifier", "verifier_service.server", verifier),
        ("gateway", "specdec-gateway", "gateway.server", gateway),
    )
    procs = [
        Proc(f"{name}-{role}", _command(script, module) + args, ports[role], log_dir / f"{name}-{role}.log")
        for role, script, module, args in parts
    ]
    return Stack(name, procs)


def first_turn_ids(tokenizer, run: int) -> list[int]:
    """The system prompt starts with the run number, so no run finds an earlier run's conversation cached."""
    document = "\n\n".join((*QUOTING_PROMPTS, *GENERAL_PROMPTS))
    system = f"Conversation {run}. You are a careful assistant. The user shares this document:\n\n{document}"
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": QUESTIONS[0]},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def next_turn_ids(tokenizer, question: str) -> list[int]:
    """What follows the assistant's generated tokens: end of its message, the user's, the assistant's start."""
    text = f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


async def conversation(address: str, session: str, first: list[int], follow_ups: list[list[int]]) -> list[dict]:
    """Five turns; per turn: prompt tokens, cached prompt tokens, TTFT (s), output ids."""
    turns = []
    prompt = list(first)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for turn in range(TURNS):
            request = gateway_pb2.GenerateRequest(
                session_id=session, prompt_token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
            )
            sent = time.perf_counter()
            ttft, output, usage = None, [], None
            async for msg in stub.Generate(request, timeout=600):
                if msg.token_ids and ttft is None:
                    ttft = time.perf_counter() - sent
                output += msg.token_ids
                if msg.HasField("usage"):
                    usage = msg.usage
            assert usage is not None and ttft is not None
            turns.append({"prompt": len(prompt), "cached": usage.cached_prompt_tokens, "ttft": ttft, "output": output})
            if turn + 1 < TURNS:
                prompt = prompt + output + follow_ups[turn]
    return turns


def run(stacks: dict[str, Stack], firsts: list[list[int]], follow_ups: list[list[int]], log) -> dict:
    results: dict[str, list[list[dict]]] = {name: [] for name in stacks}
    runs = len(firsts)
    for r, first in enumerate(firsts):
        order = list(stacks) if r % 2 == 0 else list(reversed(stacks))
        for name in order:
            turns = asyncio.run(conversation(stacks[name].gateway.address, f"run{r}", first, follow_ups))
            results[name].append(turns)
            log(f"run {r + 1}/{runs} {name}: TTFT per turn " + " ".join(f"{t['ttft'] * 1000:.0f}ms" for t in turns))
    return results


def summarise(results: dict[str, list[list[dict]]]) -> dict:
    cache, plain = results["cache"], results["no-cache"]
    per_turn = []
    for turn in range(TURNS):
        ratios = [p[turn]["ttft"] / c[turn]["ttft"] for c, p in zip(cache, plain, strict=True)]
        per_turn.append(
            {
                "turn": turn + 1,
                "prompt": cache[0][turn]["prompt"],
                "cached": statistics.median(c[turn]["cached"] for c in cache),
                "ttft_cache": statistics.median(c[turn]["ttft"] for c in cache),
                "ttft_plain": statistics.median(p[turn]["ttft"] for p in plain),
                "ratio": statistics.median(ratios),
            }
        )
    same = all(c[t]["output"] == p[t]["output"] for c, p in zip(cache, plain, strict=True) for t in range(TURNS))
    return {"turns": per_turn, "same_output": same}


def render(summary: dict, meta: dict) -> str:
    second = summary["turns"][1]
    machine = meta["machine"]
    verdict = "met" if second["ratio"] >= TARGET_SPEEDUP else "NOT met"
    lines = [
        MARK_START,
        "## Prefix caching: time to first token of later turns",
        "",
        f"{meta['date']} · {machine['cpu']}, {machine['cores']} cores · {meta['runs']} runs (median) · "
        f"`{meta['command']}` · {meta['runtime_s'] / 60:.1f} min · load {meta['load_start']} → {meta['load_end']}",
        "",
        f"Target {meta['target']}, draft {meta['draft']} (k = {K}), through the gateway; a {TURNS}-turn "
        f"conversation, each turn sending the whole conversation as token ids with a session_id, {MAX_TOKENS} "
        "greedy tokens per turn. TTFT: request sent -> first streamed tokens, at the client.",
        "",
        "| turn | prompt tokens | served from cache | TTFT with cache | TTFT without | × faster |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for t in summary["turns"]:
        lines.append(
            f"| {t['turn']} | {t['prompt']} | {t['cached']:.0f} | {t['ttft_cache'] * 1000:.0f} ms | "
            f"{t['ttft_plain'] * 1000:.0f} ms | {t['ratio']:.1f} |"
        )
    lines += [
        "",
        f"**Second turn: {second['ratio']:.1f}× lower TTFT with the prefix cache** (target ≥ {TARGET_SPEEDUP:.0f}×: "
        f"{verdict}). Outputs with and without the cache identical: {'yes' if summary['same_output'] else 'NO'}.",
        "",
        "Every run is a new conversation (its system prompt starts with the run number), so turn 1 computes "
        "the whole prompt on both stacks. From turn 2 on, the cached stack "
        "computes only the tokens after the last full 16-token block of the previous turn's prompt + output "
        "(the new user message, the last generated token, up to 15 tokens of the last partial block), while the "
        "other recomputes the whole history. × faster is the within-run ratio, median over runs.",
        MARK_END,
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="conversations per stack (median reported)")
    parser.add_argument("--out", default="docs/BENCHMARKS.md", help="Markdown file to update ('' to skip)")
    parser.add_argument("--logs", default="", help="folder for the service logs (default: a temporary one)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    malloc_tuned = tune_malloc()  # as in the services it starts
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f}s] {message}", file=sys.stderr, flush=True)

    from shared.model.loader import load_tokenizer

    load_start = load_average()
    target, draft = default_target_model(), default_draft_model()
    log_dir = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="specdec-prefix-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    stacks = {name: build_stack(name, log_dir, target, draft, name == "cache") for name in ("cache", "no-cache")}
    procs = [p for s in stacks.values() for p in s.procs]
    try:
        for p in procs:
            p.start()
        tokenizer = load_tokenizer(target)
        firsts = [first_turn_ids(tokenizer, r) for r in range(args.runs)]
        follow_ups = [next_turn_ids(tokenizer, q) for q in QUESTIONS[1:]]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for s in stacks.values():
            s.wait_ready(deadline)
        log(f"services ready (logs in {log_dir}); first prompt {len(firsts[0])} tokens, {NUM_THREADS} threads")
        summary = run(stacks, firsts, follow_ups, log)
        summary = summarise(summary)
    finally:
        for p in reversed(procs):
            p.stop()
    meta = {
        **run_meta("prefix_bench", argv, time.perf_counter() - started, malloc_tuned, load_start),
        "target": target,
        "draft": draft,
        "runs": args.runs,
    }
    section = render(summary, meta)
    print(section)
    if args.out:
        write_report(Path(args.out), section, MARK_START, MARK_END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
