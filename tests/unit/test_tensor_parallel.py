"""Tensor parallelism: sharded forwards equal the unsharded model; the rank group over real processes.

Two levels:
- The sharding math, in one process: N ranks run as N threads whose all-reduce is a barrier plus a sum,
  on every architecture variant of test_runner.py (MHA, GQA, biases, tied head, RoPE scalings), at N = 2
  and 4, including KV-head replication (fewer KV heads than ranks). Cheap, so it covers many shapes.
- The real thing: `launch_tp_runner` starts rank 1 as a process (gloo on 127.0.0.1) and loads a tiny
  checkpoint saved to disk. One group serves several tests: a mixed batch (prefill chunks + multi-query
  scoring over a paged cache, a copy-on-write block copy) equals TP 1 within fp32 tolerance; the engine's
  greedy output at TP 2 with a draft model at TP 1 equals TP 1 / TP 1 and transformers; then the worker is
  killed and the group fails cleanly (UnavailableError at once, callback, no hang).
Refusals (heads or KV heads not divisible) are checked without starting anything, on the real target too.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from shared.errors import UnavailableError
from shared.kv.block_manager import BlockManager
from shared.kv.cache import KVCache
from shared.model.build import CacheConfig, read_arch
from shared.model.config import ModelArch
from shared.model.loader import build_model
from shared.model.parallel import ColumnParallelLinear, TensorParallel
from shared.model.runner import ForwardItem, ModelRunner
from shared.model.tp_group import RankSpec, TPModelRunner, check_tensor_parallel, launch_tp_runner
from shared.sampling import SamplingParams
from shared.settings import default_target_model
from specdec_local.builder import build_engine, make_draft_model_drafter
from tests.tiny import hf_greedy, ours, tiny_hf_model
from tests.unit.test_runner import CASES, Case, make_pair
from verifier_service.engine import Engine, EngineConfig

ATOL = 1e-4  # fp32; the test_runner models have logits with a std of ~3


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------- sharding math, ranks as threads


class ThreadGroup:
    """An all-reduce among N threads (the ProcessGroup surface TensorParallel uses): every rank sums the
    same tensors in the same order, so all ranks get bit-identical results, as with a real all-reduce."""

    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * world_size

    def member(self, rank: int) -> _Member:
        return _Member(self, rank)


@dataclass
class _Member:
    group: ThreadGroup
    rank: int

    def allreduce(self, tensors: list[torch.Tensor]) -> _Done:
        (x,) = tensors
        self.group.slots[self.rank] = x.clone()
        self.group.barrier.wait()
        total = torch.stack([s for s in self.group.slots if s is not None]).sum(0)
        self.group.barrier.wait()  # nobody overwrites a slot before everyone has read them all
        x.copy_(total)
        return _Done()


class _Done:
    def wait(self) -> None:
        pass


def run_ranks(runners: list[ModelRunner], items: list[ForwardItem]) -> list[list[torch.Tensor]]:
    """One forward on every rank at once; returns each rank's logits."""
    results: list[list[torch.Tensor] | BaseException | None] = [None] * len(runners)

    def work(rank: int) -> None:
        try:
            results[rank] = runners[rank].forward(items)
        except BaseException as err:  # reported below
            results[rank] = err

    threads = [threading.Thread(target=work, args=(r,)) for r in range(len(runners))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]


def sharded_runners(arch: ModelArch, state: dict[str, torch.Tensor], world_size: int, num_blocks: int, block_size: int):
    group = ThreadGroup(world_size)
    runners = []
    for rank in range(world_size):
        tp = TensorParallel(rank, world_size, group.member(rank))
        model = build_model(arch, state, tp=tp)
        kv = KVCache(arch.num_layers, num_blocks, block_size, tp.local_kv_heads(arch.num_kv_heads), arch.head_dim)
        runners.append(ModelRunner(model, kv, "torch"))
    return runners


def mixed_batches(vocab: int, block_size: int, seed: int = 0) -> list[list[ForwardItem]]:
    """Two steps over a paged cache whose blocks come in a shuffled order: first prefills (one a non-final
    chunk without logits), then multi-query scoring (k + 1 queries), a single-token decode and the rest
    of the chunked prefill, all in one batch."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(40, generator=gen).tolist()

    def toks(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    def table(n: int) -> list[int]:
        return [blocks.pop() for _ in range(-(-n // block_size))]

    ta, tb, tc = table(16), table(12), table(30)
    first = [ForwardItem(ta, 0, toks(9), 9), ForwardItem(tb, 0, toks(5), 1), ForwardItem(tc, 0, toks(12), 0)]
    second = [ForwardItem(ta, 9, toks(5), 5), ForwardItem(tb, 5, toks(1), 1), ForwardItem(tc, 12, toks(14), 2)]
    return [first, second]


def _tp_cases() -> list[tuple[Case, int]]:
    out = []
    for case in CASES:
        heads = case.kwargs["num_attention_heads"]
        for n in (2, 4):
            if heads % n == 0:
                out.append((case, n))
    return out


@pytest.mark.parametrize(("case", "world_size"), _tp_cases(), ids=lambda v: v.id if isinstance(v, Case) else f"tp{v}")
def test_sharded_logits_equal_unsharded(case: Case, world_size: int) -> None:
    pair = make_pair(case)
    arch, state, block_size = pair.arch, pair.hf.state_dict(), 4
    reference = ModelRunner(
        pair.model, KVCache(arch.num_layers, 40, block_size, arch.num_kv_heads, arch.head_dim), "torch"
    )
    runners = sharded_runners(arch, state, world_size, 40, block_size)
    if arch.num_kv_heads < world_size:  # replicated KV heads: one per rank
        assert runners[0].cache.layers[0][0].shape[2] == 1
    for items in mixed_batches(arch.vocab_size, block_size):
        expected = reference.forward(items)
        per_rank = run_ranks(runners, items)
        for rank, logits in enumerate(per_rank):
            for e, a in zip(expected, logits, strict=True):
                assert a.shape == e.shape
                if e.numel():
                    diff = (a - e).abs().max().item()
                    assert diff <= ATOL, f"rank {rank}: max |diff| {diff:.3g}"
        for other in per_rank[1:]:  # the LM head is replicated: every rank has the same full logits
            assert all(torch.equal(x, y) for x, y in zip(per_rank[0], other, strict=True))


def test_kv_head_replication_layout() -> None:
    """8 query heads, 2 KV heads, 4 ranks: ranks 0-1 hold KV head 0, ranks 2-3 KV head 1, and each rank's
    two query heads are among those that use its KV head."""
    arch = ModelArch(64, 64, 1, 8, 2, 8, 32, 1e-5, 64, False, rope_parameters={"rope_type": "default"})
    k = torch.arange(arch.kv_size).float().unsqueeze(1).expand(-1, arch.hidden_size)  # row i holds i
    for rank in range(4):
        tp = TensorParallel(rank, 4)
        assert tp.kv_head_replicas(2) == 2 and tp.local_kv_heads(2) == 1
        layer = ColumnParallelLinear(arch.hidden_size, [arch.q_size, arch.kv_size, arch.kv_size], False, tp, [1, 2, 2])
        q = torch.arange(arch.q_size).float().unsqueeze(1).expand(-1, arch.hidden_size)
        layer.load_full_weight([q, k, k + 1000])
        q_rows, k_part, v_part = layer.weight[:, 0].split([16, 8, 8])
        kv_head = rank // 2
        assert k_part.tolist() == list(range(kv_head * 8, kv_head * 8 + 8))
        assert (v_part - 1000).tolist() == k_part.tolist()
        q_heads = sorted({int(r) // 8 for r in q_rows.tolist()})
        assert q_heads == [2 * rank, 2 * rank + 1]
        assert {h // (arch.num_heads // arch.num_kv_heads) for h in q_heads} == {kv_head}


# ---------------------------------------------------------------------- refusals


def _arch(heads: int, kv_heads: int, inter: int = 64) -> ModelArch:
    return ModelArch(64, 48 if heads % 3 == 0 else 64, 1, heads, kv_heads, 8, inter, 1e-5, 64, False)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "world_size", "words"),
    [
        (4, 2, 3, ["attention heads = 4", "not divisible by 3", "1, 2, 4"]),
        (6, 2, 3, ["2 key/value heads", "3 must be a multiple of 2"]),
        (8, 4, 8, []),  # 4 KV heads replicated twice: fine
        (6, 6, 4, ["attention heads = 6", "not divisible by 4"]),
    ],
)
def test_models_that_cannot_be_split_are_refused(heads, kv_heads, world_size, words) -> None:
    arch = _arch(heads, kv_heads)
    if not words:
        check_tensor_parallel(arch, world_size)
        return
    with pytest.raises(ValueError) as info:
        check_tensor_parallel(arch, world_size)
    for word in words:
        assert word in str(info.value)
    assert f"across {world_size} tensor-parallel ranks" in str(info.value)


def test_mlp_not_divisible_is_refused() -> None:
    with pytest.raises(ValueError, match="MLP intermediate size = 30 is not divisible by 4"):
        check_tensor_parallel(_arch(4, 4, inter=30), 4)


def test_real_target_at_tp2_is_refused_before_anything_starts() -> None:
    """The default target (SmolLM2-135M: 9 heads, 3 KV heads) splits 3 or 9 ways, not 2: the builder says so
    from the config alone, before a process starts or a weight is read."""
    name = default_target_model()
    arch = read_arch(name)
    assert (arch.num_heads, arch.num_kv_heads) == (9, 3)
    check_tensor_parallel(arch, 3)
    started = time.monotonic()
    with pytest.raises(ValueError) as info:
        build_engine(name, None, EngineConfig(max_model_len=64), CacheConfig(block_size=16), tensor_parallel_size=2)
    message = str(info.value)
    assert "attention heads = 9 is not divisible by 2" in message and "1, 3, 9" in message
    assert time.monotonic() - started < 10


def test_services_refuse_the_real_models_at_tp2_with_exit_code_2(caplog) -> None:
    """`specdec-verifier/proposer --tensor-parallel-size 2` on the default models (9 heads): a clear error and
    exit code 2, before any rank starts."""
    from proposer_service import server as proposer_server
    from proposer_service.config import ProposerConfig
    from verifier_service import server as verifier_server
    from verifier_service.config import VerifierConfig

    for run_service in (
        lambda: verifier_server.serve(VerifierConfig(tensor_parallel_size=2, device="cpu", port=0)),
        lambda: proposer_server.serve(ProposerConfig(tensor_parallel_size=2, device="cpu", port=0)),
    ):
        caplog.clear()
        with pytest.raises(SystemExit) as info:
            asyncio.run(run_service())
        assert info.value.code == 2
        assert "attention heads = 9 is not divisible by 2" in caplog.text


def test_tp_needs_a_checkpoint_not_a_loaded_model() -> None:
    target = ours(tiny_hf_model(seed=1))
    with pytest.raises(ValueError, match="name or path"):
        build_engine(target, None, EngineConfig(max_model_len=64), tensor_parallel_size=2)


# ---------------------------------------------------------------------- the real group: rank 1 is a process

BLOCK = 4
NUM_BLOCKS = 96
VOCAB = 96


@pytest.fixture(scope="module")
def target_hf():
    return tiny_hf_model(seed=1, logit_scale=8.0)


@pytest.fixture(scope="module")
def target_dir(target_hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-target")
    target_hf.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tp2(target_dir):
    """Rank 0 here, rank 1 a process; shared by the tests below (the last one kills it)."""
    threads = torch.get_num_threads()
    runner = launch_tp_runner(RankSpec(target_dir, NUM_BLOCKS, BLOCK, num_threads=1), 2)
    torch.set_num_threads(threads)
    yield runner
    runner.close()
    assert all(p.poll() is not None for p in runner.group.procs)


def test_tp2_processes_mixed_batch_and_block_copy_equal_tp1(tp2: TPModelRunner, target_hf) -> None:
    model, arch = ours(target_hf)
    reference = ModelRunner(model, KVCache(arch.num_layers, NUM_BLOCKS, BLOCK, arch.num_kv_heads, arch.head_dim))
    assert tp2.cache.layers[0][0].shape[2] == arch.num_kv_heads // 2  # rank 0's slice of the KV heads
    batches = mixed_batches(VOCAB, BLOCK, seed=3)
    # Copy-on-write: sequence 0's first 2 blocks copied to fresh blocks on every rank, then a sequence on the
    # copies continues from there (the K/V it attends to exist only through the copy).
    src = batches[0][0].block_table[:2]
    dst = [90, 91]
    fork = [ForwardItem(dst + [92], 8, [5, 6, 7], 3)]
    for items in [*batches, "copy", fork]:
        if items == "copy":
            pairs = list(zip(src, dst, strict=True))
            reference.cache.copy_blocks(pairs)
            tp2.cache.copy_blocks(pairs)
            continue
        assert isinstance(items, list)
        for e, a in zip(reference.forward(items), tp2.forward(items), strict=True):
            assert a.shape == e.shape
            if e.numel():
                assert (a - e).abs().max().item() <= ATOL


def test_tp2_verifier_with_tp1_draft_equals_tp1_and_transformers(tp2: TPModelRunner, target_hf) -> None:
    prompts = [[3, 17, 42, 8, 1], [60, 2, 2, 9, 33, 71, 5, 12, 90, 14, 27], [7]]
    max_tokens = 20
    config = EngineConfig(num_speculative_tokens=3, max_num_seqs=4, max_model_len=128, adaptive_k=False)
    cache = CacheConfig(block_size=BLOCK)
    # The draft: the target with noisy weights, so that some drafts are accepted and some rejected.
    model, arch = ours(target_hf)
    gen = torch.Generator().manual_seed(0)
    noisy = {k: v + 0.2 * v.std() * torch.randn(v.shape, generator=gen) for k, v in target_hf.state_dict().items()}
    draft = (build_model(arch, noisy), arch)

    def run(engine: Engine) -> tuple[dict[str, list[int]], int]:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        outs: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.output_ids
        return outs, engine.stats.accepted_tokens

    tp2_engine = Engine(
        config,
        tp2,
        BlockManager(NUM_BLOCKS, BLOCK),
        make_draft_model_drafter(*draft, config, cache),
        arch.eos_token_ids,
    )
    tp1_engine = build_engine((model, arch), make_draft_model_drafter(*draft, config, cache), config, cache)
    tp2_out, tp2_accepted = run(tp2_engine)
    tp1_out, tp1_accepted = run(tp1_engine)
    assert tp2_out == tp1_out
    # The same drafts were accepted and rejected on both.
    assert tp2_accepted == tp1_accepted and 0 < tp2_accepted < tp2_engine.stats.drafted_tokens
    for i, p in enumerate(prompts):
        assert tp2_out[f"r{i}"] == hf_greedy(target_hf, p, max_tokens, eos=False)


def test_tp2_worker_death_fails_the_group_cleanly(tp2: TPModelRunner) -> None:
    """Runs last on the shared group: SIGKILL rank 1; the watchdog reports it, and steps fail at once."""
    reasons: list[str] = []
    reported = threading.Event()
    tp2.on_failure(lambda reason: (reasons.append(reason), reported.set()))
    worker = tp2.group.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    assert reported.wait(10), "the watchdog did not notice the dead rank"
    assert "rank 1" in reasons[0] and str(-signal.SIGKILL) in reasons[0]
    started = time.monotonic()
    with pytest.raises(UnavailableError, match="tensor-parallel group has failed"):
        tp2.forward([ForwardItem([0], 0, [1, 2], 1)])
    assert time.monotonic() - started < 1
    assert len(reasons) == 1  # once


# ---------------------------------------------------------------------- the real target at TP 3


@pytest.mark.slow
def test_real_target_tp3_logits_and_greedy_equal_tp1(target) -> None:
    """SmolLM2-135M (9 heads, 3 KV heads) split 3 ways: 3 ranks on 2 cores, so slow, but the real shapes.
    The `target` fixture (TP 1) is loaded first, which also fills the de-quantised GGUF cache the ranks read."""
    model, arch = target
    block, num_blocks = 16, 24
    threads = torch.get_num_threads()
    runner = launch_tp_runner(RankSpec(default_target_model(), num_blocks, block, num_threads=1), 3)
    torch.set_num_threads(threads)
    try:
        assert runner.cache.layers[0][0].shape[2] == 1  # one KV head per rank
        reference = ModelRunner(model, KVCache(arch.num_layers, num_blocks, block, arch.num_kv_heads, arch.head_dim))
        for items in mixed_batches(arch.vocab_size, block, seed=5)[:1]:
            for e, a in zip(reference.forward(items), runner.forward(items), strict=True):
                if e.numel():
                    scale = e.abs().max().item()
                    assert (a - e).abs().max().item() <= 1e-4 * max(1.0, scale)

        config = EngineConfig(num_speculative_tokens=0, max_num_seqs=2, max_model_len=96)
        prompt = [1, 504, 3458, 282, 4760, 314, 2]  # any ids; greedy from the target alone
        tree_config = EngineConfig(num_speculative_tokens=3, max_num_seqs=2, max_model_len=96, max_tree_nodes=6)
        outs = []
        for engine in (
            Engine(config, runner, BlockManager(num_blocks, block), None, arch.eos_token_ids),
            build_engine(target, None, config, CacheConfig(block_size=block, num_blocks=num_blocks)),
            # Token trees at TP 3: tree attention on every rank, the accepted path moved on every rank.
            Engine(tree_config, runner, BlockManager(num_blocks, block), _OracleTrees(prompt), arch.eos_token_ids),
        ):
            engine.add_request("r", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        outs.append(out.output_ids)
            if len(outs) == 2:
                _OracleTrees.reference = outs[1]
        assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 12
        assert engine.stats.accepted_tokens > 0
    finally:
        runner.close()


class _OracleTrees:
    """Trees whose second root child and its descendants follow `reference` (the greedy output): the accepted
    path sits at slots that must be moved; the first child and one sibling per depth are decoys."""

    reference: list[int] = []

    def __init__(self, prompt: list[int]) -> None:
        self.prompt = prompt

    def propose(self, requests):
        from shared.drafting import Draft

        drafts = []
        for r in requests:
            done = r.committed_len - len(self.prompt)
            ahead = self.reference[done : done + 2]
            if not r.max_tree_nodes or len(ahead) < 2:
                drafts.append(Draft(r.seq_id, r.committed_len, []))
                continue
            tokens = [ahead[0] + 1, ahead[0], ahead[1] + 1, ahead[1]]  # decoy, right; under right: decoy, right
            drafts.append(Draft(r.seq_id, r.committed_len, tokens, parents=[-1, -1, 1, 1]))
        return drafts

    def release(self, seq_ids):
        pass
