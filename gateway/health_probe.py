"""Tiny grpc.health.v1 probe for scripts and e2e tests.

    python -m gateway.health_probe HOST:PORT [--service NAME] [--wait SECONDS] [--interval SECONDS] [--tls-*]

Exits 0 as soon as the server answers SERVING, 1 if it does not within --wait seconds (0: one try),
printing the last state on stderr. Imports grpc only (fast enough to poll from a shell loop).
TLS (shared/tls.py) when --tls or a --tls-* file is given; the files default to SPECDEC_TLS_*, so inside a
service's container the probe presents that service's certificate (Kubernetes' own gRPC probes speak no TLS).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.tls import ClientTLS, add_client_arguments, client_from_arguments, sync_channel


def check_once(address: str, service: str = "", timeout: float = 2.0, tls: ClientTLS | None = None) -> tuple[bool, str]:
    with sync_channel(address, tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as err:
            return False, f"{err.code().name}: {err.details()}"  # type: ignore[attr-defined]
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def wait_serving(
    address: str, service: str = "", wait: float = 0.0, interval: float = 0.5, tls: ClientTLS | None = None
) -> tuple[bool, str]:
    deadline = time.monotonic() + wait
    while True:
        ok, state = check_once(address, service, timeout=min(2.0, max(interval, 0.5)), tls=tls)
        if ok or time.monotonic() >= deadline:
            return ok, state
        time.sleep(interval)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Exit 0 when a gRPC server reports SERVING (grpc.health.v1).")
    parser.add_argument("address", help="HOST:PORT")
    parser.add_argument("--service", default="", help="service name to ask about ('' = the whole server)")
    parser.add_argument("--wait", type=float, default=0.0, help="keep trying for this many seconds")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between tries")
    add_client_arguments(parser)
    args = parser.parse_args(argv)
    ok, state = wait_serving(args.address, args.service, args.wait, args.interval, client_from_arguments(args))
    if not ok:
        print(f"{args.address}: not serving ({state})", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
