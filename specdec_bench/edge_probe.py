"""Issue 26's cases, tried from outside against a real stack (proposer, verifier, gateway as OS processes with
the real models, two API keys): each case's HTTP/gRPC status and the resource figures (gateway memory, time
to answer or close, a running stream's inter-token gaps, cached tokens across keys).

Run it against any tree, e.g. main's code and this branch's, one after the other:

    PYTHONPATH=/path/to/tree .venv/bin/python specdec_bench/edge_probe.py --out results.json

Only the public ports are used (and the processes' /proc entries for memory), so the same file measures a
tree without the fixes. Loopback only; every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.proto_gen.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from specdec_local.processes import HOST, build_stack

KEY_A, KEY_B = "sk-edge-probe-a-3f9c2e7a1b5d", "sk-edge-probe-b-9a8b7c6d5e4f"
STREAM_CAP = 8  # the gateway's --max-concurrent-rpcs for the flood case


def vm_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak(pid: int) -> None:
    """Linux >= 4.0: writing 5 to clear_refs resets VmHWM to the current RSS."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


def raw_post(port: int, path: str, body: bytes, timeout: float = 120.0) -> tuple[int, float]:
    """(status, seconds until the answer); status 0 when the connection was closed or reset without one."""
    started = time.monotonic()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"Authorization: Bearer {KEY_A}\r\n"
    )
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        try:
            sock.sendall(head.encode() + b"Connection: close\r\n\r\n")
            view = memoryview(body)
            for start in range(0, len(body), 1 << 20):
                sock.sendall(view[start : start + (1 << 20)])
        except OSError:
            pass  # the server stopped reading: its answer may already be there
        try:
            reply = sock.recv(65536)
        except OSError:
            reply = b""
    status = int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0
    return status, time.monotonic() - started


def big_body_case(stack: Any) -> dict[str, Any]:
    pid = stack.gateway.proc.pid
    body = b'{"prompt": [' + b"0, " * (64 * 1024 * 1024 // 3 - 10) + b"0]}"
    reset_peak(pid)
    before = vm_kb(pid, "VmRSS")
    status, seconds = raw_post(stack.http_port, "/v1/completions", body)
    time.sleep(0.5)
    peak = vm_kb(pid, "VmHWM")
    return {
        "case": f"{len(body) / 2**20:.0f} MiB body to /v1/completions",
        "status": status,
        "seconds_to_answer": round(seconds, 2),
        "gateway_peak_rss_growth_mb": round((peak - before) / 1024),
    }


def idle_connections_case(stack: Any, count: int = 200, wait_s: float = 30.0) -> dict[str, Any]:
    socks = [socket.create_connection((HOST, stack.http_port), timeout=5) for _ in range(count)]
    started = time.monotonic()
    with httpx.Client(base_url=f"http://{HOST}:{stack.http_port}", timeout=60) as http:
        real = http.post(
            "/v1/completions",
            json={"prompt": "Hi", "max_tokens": 8},
            headers={"authorization": f"Bearer {KEY_A}"},
        ).status_code
    closed_at: list[float] = []
    for s in socks:
        s.setblocking(False)
    open_socks = list(socks)
    while open_socks and time.monotonic() - started < wait_s:
        still = []
        for s in open_socks:
            try:
                data = s.recv(1)
            except BlockingIOError:
                still.append(s)
                continue
            except OSError:
                data = b""
            if data == b"":
                closed_at.append(time.monotonic() - started)
            else:
                still.append(s)
        open_socks = still
        time.sleep(0.1)
    for s in socks:
        s.close()
    return {
        "case": f"{count} connections that never send a request, beside a real request",
        "real_request_status": real,
        "closed_by_server": len(closed_at),
        "still_open_after_s": round(wait_s, 1) if open_socks else None,
        "seconds_to_close_all": round(max(closed_at), 2) if closed_at and not open_socks else None,
    }


def large_schema(tag: str, properties: int = 3500) -> dict[str, Any]:
    names = [f"{tag}{i}" for i in range(properties)]
    pattern = {"type": "string", "pattern": "[a-z]{3,9}[0-9]{2}"}
    return {"type": "object", "properties": {n: pattern for n in names}, "required": names}


async def stream_gaps(stub: Any, prompt: str, max_tokens: int, during: Any = None) -> tuple[list[int], list[float]]:
    request = gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    call = stub.Generate(request, timeout=300, metadata=(("authorization", f"Bearer {KEY_A}"),))
    tokens, arrivals, task = [], [], None
    async for msg in call:
        arrivals.append(time.monotonic())
        tokens += msg.token_ids
        if during is not None and len(arrivals) == 3:
            task = asyncio.ensure_future(during())
    if task is not None:
        await task
    return tokens, [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]


def grammar_gap_case(stack: Any) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            prompt = "Write a long story about a lighthouse keeper."
            alone, alone_gaps = await stream_gaps(stub, prompt, 96)
            statuses: list[int] = []

            async def schemas() -> None:
                async with httpx.AsyncClient(base_url=f"http://{HOST}:{stack.http_port}", timeout=300) as http:
                    bodies = [
                        {"prompt": "Hi", "max_tokens": 2, "guided_json": large_schema(f"p{j}_")} for j in range(3)
                    ]
                    replies = await asyncio.gather(
                        *(
                            http.post("/v1/completions", json=b, headers={"authorization": f"Bearer {KEY_B}"})
                            for b in bodies
                        )
                    )
                    statuses.extend(r.status_code for r in replies)

            beside, gaps = await stream_gaps(stub, prompt, 96, schemas)
            return {
                "case": "3 requests with distinct 3,500-property JSON schemas (~250 kB) beside a greedy stream",
                "schema_bytes": len(json.dumps(large_schema("p0_"))),
                "schema_statuses": statuses,
                "stream_output_exact": beside == alone,
                "max_gap_s_alone": round(max(alone_gaps), 3),
                "median_gap_s_alone": round(statistics.median(alone_gaps), 3),
                "max_gap_s_beside_schemas": round(max(gaps), 3),
                "median_gap_s_beside_schemas": round(statistics.median(gaps), 3),
            }

    return asyncio.run(run())


def cross_key_case(stack: Any) -> dict[str, Any]:
    prompt = "You are a careful assistant for ACME Corp. " * 40  # a system prompt another tenant may guess
    out = {}
    with httpx.Client(base_url=f"http://{HOST}:{stack.http_port}", timeout=120) as http:
        for label, key in (("key_a_first", KEY_A), ("key_b_same_prompt", KEY_B), ("key_a_repeat", KEY_A)):
            reply = http.post(
                "/v1/completions",
                json={"prompt": prompt, "max_tokens": 2},
                headers={"authorization": f"Bearer {key}"},
            ).json()
            usage = reply.get("usage", {})
            out[label] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", usage.get("cached_tokens"))
    return {"case": "one prompt, sent by key A, then by key B, then by A again: cached_tokens reported", **out}


def bad_values_case(stack: Any) -> list[dict[str, Any]]:
    cases = [
        ("top_k 2**32", "/v1/completions", {"prompt": "Hi", "top_k": 2**32}),
        ("max_draft_tokens 2**32", "/v1/completions", {"prompt": "Hi", "max_draft_tokens": 2**32}),
        (
            "JSON-text schema nested 100,000 deep",
            "/v1/completions",
            {"prompt": "Hi", "guided_json": "[" * 100_000 + "]" * 100_000},
        ),
        (
            "4,000,000-character role",
            "/v1/chat/completions",
            {"messages": [{"role": "u" * 4_000_000, "content": "hi"}]},
        ),
        ("2,000 chat messages", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 2000}),
    ]
    out = []
    for name, path, body in cases:
        started = time.monotonic()
        try:  # a connection of its own each: main closed the connection after a 500
            reply = httpx.post(
                f"http://{HOST}:{stack.http_port}{path}",
                json=body,
                headers={"authorization": f"Bearer {KEY_A}"},
                timeout=300,
            )
            status = reply.status_code
            message = reply.json().get("error", {}).get("message", "") if status != 200 else ""
        except httpx.HTTPError as err:
            status, message = 0, f"connection error: {err!r}"
        out.append(
            {"case": name, "status": status, "seconds": round(time.monotonic() - started, 2), "message": message[:120]}
        )
    return out


def health_flood_case(stack: Any) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        metadata = (("authorization", f"Bearer {KEY_A}"),)
        async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            calls = [
                stub.Generate(
                    gateway_pb2.GenerateRequest(prompt="Count slowly.", max_tokens=400, ignore_eos=True),
                    metadata=metadata,
                )
                for _ in range(STREAM_CAP)
            ]
            held = 0
            for call in calls:
                try:
                    await asyncio.wait_for(call.read(), 60)
                    held += 1
                except (grpc.aio.AioRpcError, TimeoutError):
                    pass
            try:
                check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                health = health_pb2.HealthCheckResponse.ServingStatus.Name(check.status)
            except grpc.aio.AioRpcError as err:
                health = err.code().name
            try:
                async for _ in stub.Generate(
                    gateway_pb2.GenerateRequest(prompt="Hi", max_tokens=2), metadata=metadata, timeout=30
                ):
                    pass
                extra = "OK"
            except grpc.aio.AioRpcError as err:
                extra = err.code().name
            for call in calls:
                call.cancel()
            return {
                "case": f"{STREAM_CAP} Generate streams held (--max-concurrent-rpcs {STREAM_CAP}), then liveness",
                "streams_held": held,
                "liveness_check": health,
                "one_more_generate": extra,
            }

    return asyncio.run(run())


CASES = {
    "cross_key": cross_key_case,
    "bad_values": bad_values_case,
    "grammar": grammar_gap_case,
    "health_flood": health_flood_case,
    "big_body": big_body_case,
    "idle_connections": idle_connections_case,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {','.join(CASES)}")
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="edge-probe-"))
    keys = log_dir / "api-keys"
    keys.write_text(f"{KEY_A} tenant-a\n{KEY_B} tenant-b\n")
    stack = build_stack("edge", log_dir)
    stack.gateway.args += ["--api-keys-file", str(keys), "--max-concurrent-rpcs", str(STREAM_CAP)]
    stack.api_key = KEY_A
    results: dict[str, Any] = {"tree": os.environ.get("PYTHONPATH", ""), "load": os.getloadavg()}
    stack.start()
    try:
        stack.wait_healthy()
        for name in args.cases.split(","):
            results[name] = CASES[name](stack)
        results["gateway_alive"] = stack.gateway.alive()
    finally:
        stack.stop()
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    sys.exit(0)


if __name__ == "__main__":
    main()
