"""`specdec`: command-line client of the gateway. Prompt in, streamed text out.

    specdec "Once upon a time"                       # text streamed to stdout as it is generated
    specdec --chat "Write a haiku about the sea"     # chat template applied (see below)
    echo "prompt" | specdec -                        # prompt from stdin
    specdec --json --max-tokens 32 "Hello"           # one JSON object per line per chunk, then a final one

At the end it prints the finish reason, token counts and the acceptance statistics (drafted,
accepted, acceptance rate, mean tokens per step) on stderr (--quiet: not).

--chat: sends `messages` (a user message, plus --system if given); the gateway applies the model's chat
template with the generation prompt. With --tokenizer the client applies the template itself instead
(for gateways that predate `messages`) and sends the ids as prompt_token_ids; that tokenizer must be the
one the gateway serves.

--json output, one object per line on stdout:
    {"type": "chunk", "request_id": ..., "token_ids": [...], "text": "..."}            per message
    {"type": "final", "request_id": ..., "finish_reason": "STOP"|"LENGTH"|"ABORT", "usage": {...},
     "stop_string" | "stop_token_id": ..., "text": full text, "token_ids": all ids,
     "acceptance_rate": ..., "elapsed_s": ..., "time_to_first_token_s": ...}
    {"type": "error", "code": "INVALID_ARGUMENT", "message": "..."}                     on failure
API key (a gateway with --api-keys-file): SPECDEC_API_KEY, or --api-key (seen by `ps` and shell history).
Exit status: 0 done, 1 the RPC failed, 2 bad command line, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from shared.proto_gen.specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from shared.tls import add_client_arguments, client_from_arguments, sync_channel

DEFAULT_ADDRESS = os.environ.get("SPECDEC_GATEWAY_ADDRESS", "127.0.0.1:50051")
USAGE_FIELDS = (
    "prompt_tokens",
    "completion_tokens",
    "cached_prompt_tokens",
    "drafted_tokens",
    "accepted_tokens",
    "num_steps",
    "tokens_per_step",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specdec",
        description="Send a prompt to the specdec gateway and stream the answer.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    p.add_argument("prompt", nargs="?", default="-", help="the prompt ('-' or absent: read stdin)")
    p.add_argument("--address", default=DEFAULT_ADDRESS, help="gateway HOST:PORT (env SPECDEC_GATEWAY_ADDRESS)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("SPECDEC_API_KEY", ""),
        help="sent as 'authorization: Bearer <key>' (env SPECDEC_API_KEY, which other users cannot see in ps)",
    )
    p.add_argument("--max-tokens", type=int, help="most tokens to generate (default: the gateway's)")
    p.add_argument("--temperature", type=float, help="0 = greedy (the default)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", type=int, action="append", default=[], help="stop token id (repeatable)")
    p.add_argument("--session-id", default="", help="session id: its requests stay on one verifier")
    p.add_argument("--request-id", default="")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--max-draft-tokens", type=int, help="cap on draft tokens per step (0: no speculation)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a chat (user message)")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument(
        "--tokenizer", default=None, help="with --chat: apply this tokenizer's chat template client side (old gateways)"
    )
    p.add_argument("--prompt-token-ids", default=None, help="comma-separated prompt token ids instead of text")
    p.add_argument("--unary", action="store_true", help="use Complete (one response) instead of Generate")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--json", action="store_true", help="machine-readable output: one JSON object per line")
    p.add_argument("--quiet", action="store_true", help="no statistics on stderr")
    add_client_arguments(p)
    return p


def chat_prompt_ids(user: str, system: str | None, tokenizer_name: str | None) -> list[int]:
    from shared.model.loader import load_tokenizer
    from shared.settings import default_target_model

    tokenizer = load_tokenizer(tokenizer_name or default_target_model())
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    ids: Any = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def build_request(args: argparse.Namespace) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(
        request_id=args.request_id,
        session_id=args.session_id,
        stop=args.stop,
        stop_token_ids=args.stop_token_id,
        ignore_eos=args.ignore_eos,
    )
    if args.prompt_token_ids is not None:
        req.prompt_token_ids.extend(int(t) for t in args.prompt_token_ids.split(",") if t.strip())
    else:
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        if args.chat and args.tokenizer:
            req.prompt_token_ids.extend(chat_prompt_ids(prompt, args.system, args.tokenizer))
        elif args.chat:
            if args.system:
                req.messages.add(role="system", content=args.system)
            req.messages.add(role="user", content=prompt)
        else:
            req.prompt = prompt
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "max_draft_tokens"):
        value = getattr(args, name)
        if value is not None:
            if name in ("max_tokens", "seed", "max_draft_tokens") and value < 0:
                raise SystemExit(f"specdec: --{name.replace('_', '-')} must be >= 0")
            setattr(req, name, value)
    return req


def usage_dict(usage: common_pb2.Usage) -> dict[str, Any]:
    return {name: getattr(usage, name) for name in USAGE_FIELDS}


def acceptance_rate(usage: common_pb2.Usage) -> float | None:
    return usage.accepted_tokens / usage.drafted_tokens if usage.drafted_tokens else None


def stats_line(final: Any, elapsed: float, ttft: float | None) -> str:
    u = final.usage
    rate = acceptance_rate(u)
    reason = common_pb2.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_")
    parts = [
        f"finish_reason={reason}",
        f"prompt_tokens={u.prompt_tokens}",
        f"completion_tokens={u.completion_tokens}",
        f"drafted={u.drafted_tokens}",
        f"accepted={u.accepted_tokens}",
        f"acceptance_rate={rate:.1%}" if rate is not None else "acceptance_rate=n/a",
        f"tokens_per_step={u.tokens_per_step:.2f}",
        f"tokens_per_s={u.completion_tokens / elapsed:.1f}" if elapsed > 0 else "",
        f"ttft_s={ttft:.3f}" if ttft is not None else "",
    ]
    return "[specdec] " + " ".join(p for p in parts if p)


def _responses(
    stub: gateway_pb2_grpc.GatewayStub, req: gateway_pb2.GenerateRequest, args: argparse.Namespace
) -> Iterator[Any]:
    metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else None
    if args.unary:
        complete = gateway_pb2.CompleteRequest.FromString(req.SerializeToString())  # same fields and numbers
        yield stub.Complete(complete, timeout=args.timeout, metadata=metadata)
        return
    call = stub.Generate(req, timeout=args.timeout, metadata=metadata)
    try:
        yield from call
    finally:
        call.cancel()  # no-op when finished; on Ctrl-C it tells the gateway (and the verifier) to stop


def run(args: argparse.Namespace) -> int:
    req = build_request(args)
    out = sys.stdout
    text: list[str] = []
    token_ids: list[int] = []
    final: Any = None
    started = time.monotonic()
    ttft: float | None = None
    with sync_channel(args.address, client_from_arguments(args)) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        try:
            for resp in _responses(stub, req, args):
                if ttft is None and resp.token_ids:
                    ttft = time.monotonic() - started
                text.append(resp.text)
                token_ids.extend(resp.token_ids)
                if args.json:
                    chunk = {"type": "chunk", "request_id": resp.request_id, "token_ids": list(resp.token_ids)}
                    chunk["text"] = resp.text
                    print(json.dumps(chunk, ensure_ascii=False), file=out, flush=True)
                else:
                    out.write(resp.text)
                    out.flush()
                if resp.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    final = resp
        except grpc.RpcError as err:
            code, details = err.code(), err.details()  # type: ignore[attr-defined]
            if not args.json and text:
                out.write("\n")
            if args.json:
                print(json.dumps({"type": "error", "code": code.name, "message": details}), file=out, flush=True)
            print(f"specdec: error: {code.name}: {details}", file=sys.stderr)
            return 1
    elapsed = time.monotonic() - started
    if final is None:
        print("specdec: error: the stream ended without a finish reason", file=sys.stderr)
        return 1
    if args.json:
        summary: dict[str, Any] = {
            "type": "final",
            "request_id": final.request_id,
            "finish_reason": common_pb2.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_"),
            "usage": usage_dict(final.usage),
            "acceptance_rate": acceptance_rate(final.usage),
            "text": "".join(text),
            "token_ids": token_ids,
            "elapsed_s": round(elapsed, 4),
            "time_to_first_token_s": round(ttft, 4) if ttft is not None else None,
        }
        which = final.WhichOneof("stop_reason")
        if which:
            summary[which] = getattr(final, which)
        print(json.dumps(summary, ensure_ascii=False), file=out, flush=True)
    else:
        out.write("\n")
        out.flush()
    if not args.quiet:
        print(stats_line(final, elapsed, ttft), file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = run(args)
    except KeyboardInterrupt:
        print("\nspecdec: interrupted", file=sys.stderr)
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
