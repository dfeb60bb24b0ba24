"""End-to-end fixtures: proposer, verifier(s) and gateway as separate OS processes on loopback.

The processes themselves (Service, Stack, build_stack) live in specdec_local/processes.py, which the soak
(specdec_bench/soak.py) uses too. Every stack the session will need is launched as soon as the first one is
asked for, and the target's greedy references are computed while the services load (both take minutes on a
busy machine). At the end of the session every process gets SIGTERM (gateways, then verifiers, then
proposers) and must exit with status 0; one that does not stop within STOP_TIMEOUT_S is killed and the
teardown fails with the tail of its log. A service a test SIGKILLed must have died of it, unless the test
restarted it (then it must stop cleanly like the others).

Stacks:
    main      proposer (draft model) + verifier (k = 4 fixed, max_model_len 1024) + gateway
    fault     the same with --max-num-seqs 3 --max-waiting 1 (queue-full test); its proposer is SIGKILLed
              by the proposer-failure test, so the shared main stack is never disturbed
    failover  proposer (drafting ahead) + TWO verifiers + gateway: verifiers and the proposer are SIGKILLed and
              restarted mid-stream (test_failover.py), then the 60-second soak runs on it (test_soak.py)
    orphan    a gateway whose only verifier address has nothing listening (UNAVAILABLE test)
    secure    main's services with TLS on every port, mutual TLS between them and an API key at the gateway
              (certificates and key made per run: pki.py)
    eagle     the EAGLE head, adaptive k, a tiny KV cache (preemption)
    eagle-fixed  the same with k = 4 fixed (every request drafts through preemption)

Environment: SPECDEC_E2E_STARTUP_TIMEOUT (seconds to wait for a stack to be healthy, default 300).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specdec_local.processes import Stack, StackError, build_stack
from tests.e2e.pki import PKI

# The repository's EAGLE head and a verifier KV cache far too small for 8 sequences at once: a 256-token context
# limit and 20 blocks of 16 (320 tokens, just above one full-length sequence), while the 8 prompts + 128 tokens
# need about 80 blocks (prefix caching shares the chat template's blocks and some answers end early, which is why
# 66 blocks at 1,024 never preempted). Greedy streams run through preemption by recompute.
_EAGLE_TINY_KV: dict[str, Any] = dict(
    proposer_kind="eagle", verifier_args=("--max-model-len", "256", "--num-kv-blocks", "20")
)

STACK_FIXTURES: dict[str, dict[str, Any]] = {
    "e2e_stack": dict(name="main"),
    "fault_stack": dict(name="fault", verifier_args=["--max-num-seqs", "3", "--max-waiting", "1"]),
    "orphan_gateway": dict(name="orphan", with_verifier=False),
    # The repository's EAGLE head, adaptive k (the default), and a KV cache far too small for 8 (`_EAGLE_TINY_KV`).
    "eagle_stack": dict(name="eagle", adaptive_k=True, **_EAGLE_TINY_KV),
    # The same with k fixed: at a batch of 8 the adaptive policy may rightly leave every request plain (on CI's
    # 2-core machine it did, 2026-12-07), and preempted sequences must be seen drafting through the processes.
    "eagle_fixed_stack": dict(name="eagle-fixed", **_EAGLE_TINY_KV),
    "secure_stack": dict(name="secure", secure=True),
    # Its proposer drafts ahead: a verifier killed mid-stream leaves cache entries for sequences that never ask
    # again, and the resumed requests (new sequences on the survivor) are drafted on demand.
    "failover_stack": dict(name="failover", num_verifiers=2, proposer_args=["--draft-ahead", "3"]),
}


class Launcher:
    def __init__(self, log_dir: Path, needed: set[str]) -> None:
        self.log_dir = log_dir
        self.needed = needed
        self.stacks: dict[str, Stack] = {}

    def launch(self, fixture: str) -> Stack:
        if fixture not in self.stacks:
            kwargs = dict(STACK_FIXTURES[fixture])
            if kwargs.pop("secure", False):
                kwargs["pki"] = PKI(self.log_dir / f"{kwargs['name']}-pki")
            stack = build_stack(log_dir=self.log_dir, **kwargs)
            stack.start()
            self.stacks[fixture] = stack
        return self.stacks[fixture]

    def launch_needed(self) -> None:
        for fixture in STACK_FIXTURES:
            if fixture in self.needed:
                self.launch(fixture)

    def stop_all(self) -> list[str]:
        """Gateways first, then verifiers, then proposers (each tier's processes stop in parallel)."""
        problems = []
        for tier in ("gateway", "verifier", "proposer"):
            services = [(st, s) for st in self.stacks.values() for s in st.services if s.role == tier]
            for _, s in services:
                s.terminate()
            for stack, s in services:
                if (p := s.stop()) is not None:
                    problems.append(f"{p}\n{stack.logs()}")
        return problems


@pytest.fixture(scope="session")
def _launcher(request, tmp_path_factory) -> Iterator[Launcher]:
    needed = {
        name for item in request.session.items for name in getattr(item, "fixturenames", ()) if name in STACK_FIXTURES
    }
    launcher = Launcher(tmp_path_factory.mktemp("e2e-logs"), needed)
    launcher.launch_needed()  # every stack this session uses starts loading now, in parallel
    yield launcher
    problems = launcher.stop_all()
    assert not problems, "services did not shut down cleanly:\n" + "\n".join(problems)


def _stack(request, launcher: Launcher, fixture: str) -> Stack:
    stack = launcher.launch(fixture)
    # The target's greedy references (tests/real_models.py) take minutes: compute them while the services load.
    request.getfixturevalue("greedy_references")
    try:
        stack.wait_ready()
    except StackError as err:
        pytest.fail(f"e2e {err}", pytrace=False)
    return stack


@pytest.fixture(scope="session")
def e2e_stack(request, _launcher) -> Stack:
    return _stack(request, _launcher, "e2e_stack")


@pytest.fixture(scope="session")
def fault_stack(request, _launcher) -> Stack:
    return _stack(request, _launcher, "fault_stack")


@pytest.fixture(scope="session")
def orphan_gateway(request, _launcher) -> Stack:
    return _stack(request, _launcher, "orphan_gateway")


@pytest.fixture(scope="session")
def eagle_stack(request, _launcher) -> Stack:
    return _stack(request, _launcher, "eagle_stack")


@pytest.fixture(scope="session")
def eagle_fixed_stack(request, _launcher) -> Stack:
    return _stack(request, _launcher, "eagle_fixed_stack")


@pytest.fixture(scope="session")
def secure_stack(request, _launcher) -> Stack:
    return _stack(request, _launcher, "secure_stack")


@pytest.fixture(scope="session")
def failover_stack(request, _launcher) -> Stack:
    return _stack(request, _launcher, "failover_stack")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing e2e test shows the tail of every service log of the stacks it used."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.when == "call":
        for value in getattr(item, "funcargs", {}).values():
            if isinstance(value, Stack):
                report.sections.append((f"service logs of stack {value.name!r}", value.logs()))
