"""Our paged-KV Llama forward against transformers' own models, fp32.

Tiny random-weight models are built in memory for each architecture variant we claim to support
(MHA/GQA, tied/untied head, q/k/v bias, RoPE scalings, head_dim != hidden / heads) and converted with
`build_model`. Every runner call mixes sequences in different states (prefill chunks, k + 1 scoring
queries, single-token decode), block tables are random permutations of the block pool, and the cache
starts filled with large finite garbage, so any slot the mask lets through by mistake shows up in
the logits. The reference is always transformers' forward over the whole sequence, without a cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from shared.kv.cache import KVCache
from shared.model.config import ModelArch
from shared.model.llama import LlamaModel
from shared.model.loader import build_model, load_hf_model, load_model
from shared.model.runner import ForwardItem, ModelRunner
from shared.settings import default_target_model

ATOL = 1e-4  # fp32, logits of the tiny models have a std of ~3
GARBAGE = 50.0  # scale of the junk the cache starts with


# ---------------------------------------------------------------------- tiny models


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request):
    """Ops on 64-wide models are far too small to gain from a second thread, and lose a lot when the
    shared cores are busy; the real model keeps the session's setting."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


BASE: dict[str, Any] = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)


@dataclass(frozen=True)
class Case:
    id: str
    config_cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)

    def config(self):
        return self.config_cls(**{**BASE, **self.kwargs}, attn_implementation="eager")


CASES = [
    Case("llama-mha-untied", LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=4)),
    Case(
        "llama-gqa-tied-headdim16-linear",
        LlamaConfig,
        dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,  # hidden / heads = 8
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        ),
    ),
    Case(
        "llama-llama3-rope-3layers",
        LlamaConfig,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=3,
            # head_dim 16, theta 1e4: wavelengths 6.3, 20, 63, 199, ... cover the high, medium and low bands
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    Case(
        "llama-yarn-bias",
        LlamaConfig,
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            attention_bias=True,  # q, k, v and o biases
            mlp_bias=True,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    Case(
        "qwen2-gqa-bias-tied",
        Qwen2Config,
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    Case(
        "mistral-gqa-headdim32",
        MistralConfig,
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_parameters={"rope_theta": 1e6}),
    ),
]
CASE_BY_ID = {c.id: c for c in CASES}


@dataclass
class Pair:
    hf: Any
    model: LlamaModel
    arch: ModelArch

    def reference(self, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.hf(torch.tensor([tokens])).logits[0].float()


def make_pair(case: Case, seed: int = 0) -> Pair:
    cfg = case.config()
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    assert hf.config._attn_implementation == "eager"
    # transformers' init (std 0.02, unit norms, zero biases) gives near-uniform attention and tiny logits,
    # which would hide masking and bias bugs: use larger weights and non-trivial norms and biases.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]) * (3.0 if "embed" in name else 1.5))
    arch = ModelArch.from_hf_config(cfg)
    return Pair(hf, build_model(arch, hf.state_dict()), arch)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.id)
def pair(request) -> Pair:
    return make_pair(request.param)


@pytest.fixture(scope="module")
def gqa_pair() -> Pair:
    return make_pair(CASE_BY_ID["llama-gqa-tied-headdim16-linear"])


# ---------------------------------------------------------------------- a paged cache with sequences


@dataclass
class Seq:
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V are in the cache
    table: list[int] = field(default_factory=list)


class Paged:
    """A cache whose blocks are handed out in a random order, like a block manager after some churn."""

    def __init__(self, pair: Pair, block_size: int, num_blocks: int = 64, seed: int = 0) -> None:
        self.pair = pair
        self.gen = torch.Generator().manual_seed(seed)
        self.cache = KVCache(pair.arch.num_layers, num_blocks, block_size, pair.arch.num_kv_heads, pair.arch.head_dim)
        for k_cache, v_cache in self.cache.layers:
            k_cache.copy_(torch.randn(k_cache.shape, generator=self.gen) * GARBAGE)
            v_cache.copy_(torch.randn(v_cache.shape, generator=self.gen) * GARBAGE)
        self.runner = ModelRunner(pair.model, self.cache, attention_backend="torch")
        self.free = torch.randperm(num_blocks, generator=self.gen).tolist()
        self.block_size = block_size

    def tokens(self, n: int) -> list[int]:
        return torch.randint(0, self.pair.arch.vocab_size, (n,), generator=self.gen).tolist()

    def step(self, work: list[tuple[Seq, list[int], int]], num_cached: list[int] | None = None) -> list[torch.Tensor]:
        """One runner call: per (seq, new tokens, num_logits). Grows tables to fit, then commits the tokens."""
        items = []
        for i, (seq, new, num_logits) in enumerate(work):
            cached = len(seq.tokens) if num_cached is None else num_cached[i]
            while len(seq.table) * self.block_size < cached + len(new):
                seq.table.append(self.free.pop())
            items.append(ForwardItem(list(seq.table), cached, list(new), num_logits))
        out = self.runner.forward(items)
        for (seq, new, _), item in zip(work, items, strict=True):
            seq.tokens = seq.tokens[: item.num_cached] + list(new)
        return out

    def check(
        self, work: list[tuple[Seq, list[int], int]], out: list[torch.Tensor], atol: float = ATOL
    ) -> list[torch.Tensor]:
        """Compares each item's logits with transformers' logits for its last num_logits tokens."""
        assert len(out) == len(work)
        references = []
        for i, ((seq, _, num_logits), logits) in enumerate(zip(work, out, strict=True)):
            assert logits.shape == (num_logits, self.pair.arch.vocab_size), f"item {i}"
            assert logits.dtype == torch.float32
            if num_logits:
                expected = self.pair.reference(seq.tokens)[-num_logits:]
                assert_close(logits, expected, atol, f"item {i} (length {len(seq.tokens)})")
                references.append(expected)
        return references


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str = "") -> None:
    diff = (actual - expected).abs().max().item()
    assert diff <= atol, f"{what}: max |diff| {diff:.3g} > {atol} (logit scale {expected.abs().max().item():.3g})"


# ---------------------------------------------------------------------- tests on every architecture


def test_weights_give_nontrivial_logits(pair: Pair) -> None:
    """Guards the test setup itself: logits must be large enough for ATOL to mean something."""
    logits = pair.reference(list(range(20)))
    assert logits.std().item() > 1.0


def test_mixed_prefill_of_several_sequences(pair: Pair) -> None:
    paged = Paged(pair, block_size=4)
    seqs = [Seq() for _ in range(4)]
    work = [
        (seqs[0], paged.tokens(7), 7),
        (seqs[1], paged.tokens(1), 1),
        (seqs[2], paged.tokens(16), 1),
        (seqs[3], paged.tokens(11), 3),
    ]
    paged.check(work, paged.step(work))


def test_multi_query_scoring_mixed_with_prefill_chunks(pair: Pair) -> None:
    paged = Paged(pair, block_size=4)
    a, b, c, d, e = (Seq() for _ in range(5))
    first = [(a, paged.tokens(9), 1), (b, paged.tokens(5), 1), (c, paged.tokens(12), 1), (d, paged.tokens(6), 0)]
    paged.check(first, paged.step(first))

    # k = 3, 0 and 5 draft tokens scored (k + 1 queries), d's last prefill chunk (longest query, so the
    # others are left-padded), and e's first chunk, which returns no logits.
    second = [
        (a, paged.tokens(4), 4),
        (b, paged.tokens(1), 1),
        (c, paged.tokens(6), 6),
        (d, paged.tokens(10), 1),
        (e, paged.tokens(7), 0),
    ]
    paged.check(second, paged.step(second))

    third = [(e, paged.tokens(3), 3), (a, paged.tokens(2), 2), (d, paged.tokens(5), 5), (b, paged.tokens(1), 1)]
    paged.check(third, paged.step(third))


def test_chunked_prefill_equals_one_shot(pair: Pair) -> None:
    prompt = Paged(pair, block_size=4, seed=1).tokens(23)

    one_shot = Paged(pair, block_size=4, seed=2)
    whole = one_shot.step([(Seq(), prompt, len(prompt))])[0]
    assert_close(whole, pair.reference(prompt), ATOL, "one shot")

    # Same prompt in chunks of 5, 1, 8 and 9 tokens, with another sequence decoding in the same calls.
    chunked = Paged(pair, block_size=4, seed=3)
    seq, other = Seq(), Seq()
    chunked.step([(other, chunked.tokens(6), 0)])
    parts, start = [], 0
    for n in (5, 1, 8, 9):
        work = [(other, chunked.tokens(1), 1), (seq, prompt[start : start + n], n)]
        out = chunked.step(work)
        chunked.check(work, out)
        parts.append(out[1])
        start += n
    assert seq.tokens == prompt
    assert_close(torch.cat(parts), whole, 1e-5, "chunked vs one shot")


def test_rollback_rescoring_ignores_rejected_slots(pair: Pair) -> None:
    paged = Paged(pair, block_size=4)
    seq, other = Seq(), Seq()
    paged.step([(seq, paged.tokens(10), 0), (other, paged.tokens(3), 0)])

    # Score 5 drafted tokens at positions 10..14 (K/V written there); only the first 2 are accepted.
    drafts = paged.tokens(5)
    paged.step([(seq, drafts, 5), (other, paged.tokens(2), 2)])
    accepted = len(seq.tokens) - 3

    # Make the rejected slots (and every slot beyond, in this sequence's blocks) hold fresh garbage as well.
    bs = paged.block_size
    rejected_slots = [seq.table[p // bs] * bs + p % bs for p in range(accepted, len(seq.table) * bs)]
    for k_cache, v_cache in paged.cache.layers:
        for cache in (k_cache, v_cache):
            flat = cache.view(-1, *cache.shape[2:])
            flat[rejected_slots] = torch.randn(len(rejected_slots), *cache.shape[2:], generator=paged.gen) * GARBAGE

    # Re-score from the accepted length: the next step writes over position 12 onwards.
    work = [(seq, paged.tokens(4), 4), (other, paged.tokens(1), 1)]
    out = paged.step(work, num_cached=[accepted, len(other.tokens)])
    assert len(seq.tokens) == 16
    paged.check(work, out)

    # Roll back further, into an earlier block (position 12 -> 7), and score a single token.
    work = [(seq, paged.tokens(1), 1)]
    out = paged.step(work, num_cached=[7])
    assert len(seq.tokens) == 8
    paged.check(work, out)


def test_items_without_logits(pair: Pair) -> None:
    paged = Paged(pair, block_size=4)
    out = paged.step([(Seq(), paged.tokens(5), 0), (Seq(), paged.tokens(2), 0)])
    assert [o.shape for o in out] == [(0, pair.arch.vocab_size)] * 2


# ---------------------------------------------------------------------- block sizes and table layouts


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
def test_block_sizes_with_scattered_tables(gqa_pair: Pair, block_size: int) -> None:
    paged = Paged(gqa_pair, block_size=block_size, num_blocks=max(8, 160 // block_size), seed=block_size)
    a, b, c = Seq(), Seq(), Seq()
    first = [(a, paged.tokens(37), 2), (b, paged.tokens(3), 3), (c, paged.tokens(18), 0)]
    paged.check(first, paged.step(first))
    if block_size < 32:  # several blocks per sequence, not in increasing order
        assert any(x > y for x, y in zip(a.table, a.table[1:], strict=False))
    second = [(a, paged.tokens(5), 5), (b, paged.tokens(1), 1), (c, paged.tokens(14), 4)]
    paged.check(second, paged.step(second))
    # rollback of a by 3 tokens, then rescoring
    third = [(a, paged.tokens(3), 3), (c, paged.tokens(2), 2)]
    paged.check(third, paged.step(third, num_cached=[len(a.tokens) - 3, len(c.tokens)]))


# ---------------------------------------------------------------------- the real default target


@pytest.fixture(scope="module")
def real_target() -> Pair:
    name = default_target_model()
    model, arch = load_model(name)
    return Pair(load_hf_model(name), model, arch)


@pytest.mark.slow
def test_real_target_matches_transformers(real_target: Pair) -> None:
    assert real_target.arch.num_layers == 30 and real_target.arch.vocab_size == 49152
    paged = Paged(real_target, block_size=16, num_blocks=16, seed=7)
    a, b, c = Seq(), Seq(), Seq()
    atol = 1e-3  # logits reach ~20 here
    first = [(a, paged.tokens(21), 1), (b, paged.tokens(12), 0)]
    paged.check(first, paged.step(first), atol)
    second = [(a, paged.tokens(5), 5), (b, paged.tokens(9), 9), (c, paged.tokens(1), 1)]
    out = paged.step(second)
    references = paged.check(second, out, atol)
    assert torch.equal(torch.cat(out).argmax(-1), torch.cat(references).argmax(-1))


def test_captured_layers_equal_transformers_hidden_states() -> None:
    """forward_with_hidden(items, layers): decoder layers' outputs and the final normed state, side by side in
    the order asked, from a mixed call (a prefill chunk after cached tokens, k + 1 scoring rows, a prefill),
    equal transformers' hidden states at the same positions (hidden_states[i + 1] is layer i's output; the
    last one is the final normed state)."""
    pair = make_pair(CASE_BY_ID["llama-llama3-rope-3layers"])
    paged = Paged(pair, block_size=4)
    a, b, c = Seq(), Seq(), Seq()
    first = [(a, paged.tokens(9), 1), (b, paged.tokens(6), 1)]
    paged.step(first)
    layers = (1, -1, 0)  # not sorted: the caller's order is the layout
    work = [(a, paged.tokens(5), 5), (b, paged.tokens(3), 1), (c, paged.tokens(10), 1)]
    items = []
    for seq, new, num_logits in work:
        while len(seq.table) * paged.block_size < len(seq.tokens) + len(new):
            seq.table.append(paged.free.pop())
        items.append(ForwardItem(list(seq.table), len(seq.tokens), list(new), num_logits))
    logits, features = paged.runner.forward_with_hidden(items, layers)
    _, final_only = paged.runner.forward_with_hidden(items)  # the default: the final normed state alone
    h = pair.arch.hidden_size
    for (seq, new, _), item, feats, final in zip(work, items, features, final_only, strict=True):
        tokens = seq.tokens[: item.num_cached] + new
        with torch.no_grad():
            hidden = pair.hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        rows = slice(item.num_cached, len(tokens))
        assert feats.shape == (len(new), len(layers) * h)
        for i, layer in enumerate(layers):
            expected = hidden[-1 if layer == -1 else layer + 1][0, rows]
            assert_close(feats[:, i * h : (i + 1) * h], expected, ATOL, f"layer {layer}")
        assert_close(final, hidden[-1][0, rows], ATOL, "final")
    assert [lg.shape[0] for lg in logits] == [5, 1, 1]
