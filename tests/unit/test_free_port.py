"""Ports for services a process stack starts later (specdec_local.processes.free_port): below the kernel's
ephemeral range, where no outgoing connection of a service already running can take them in the meantime."""

from __future__ import annotations

import socket

from specdec_local import processes


def test_ports_are_free_distinct_and_below_the_ephemeral_range():
    low = processes._ephemeral_low()
    assert low > 1024 + 64  # Linux: 32768 by default; the rule below is not tested where the range is unknown
    ports = [processes.free_port() for _ in range(64)]
    assert len(set(ports)) == len(ports)
    assert all(low - processes.LISTEN_SPAN <= port < low for port in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((processes.HOST, ports[-1]))  # free: nothing was left bound to it


def test_a_port_taken_meanwhile_is_not_handed_out(monkeypatch):
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        taken.bind((processes.HOST, processes.free_port()))
        taken.listen()
        busy = taken.getsockname()[1]
        processes._handed_out.discard(busy)  # as if another program held it, unknown to this process
        real, calls = processes.random.randint, []

        def pick(low: int, high: int) -> int:  # the busy port first, then as before
            calls.append((low, high))
            return busy if len(calls) == 1 else real(low, high)

        monkeypatch.setattr(processes.random, "randint", pick)
        assert processes.free_port() != busy
        assert len(calls) >= 2
    finally:
        taken.close()
