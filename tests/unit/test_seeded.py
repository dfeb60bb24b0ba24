"""Seeded sampling (shared/seeded.py, verifier_service/verify.py): the token at each output position is a
pure function of (seed, position, target distribution), so the text does not depend on drafter, k, batch,
prefix cache, preemption or failover; and the output law is still exactly the target's."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from scipy.stats import chisquare

from proposer_service.ngram import NgramDrafter
from shared.drafting import DraftRequest
from shared.model.build import CacheConfig
from shared.sampling import SamplingParams, logits_to_probs, params_to_tensors
from shared.seeded import gumbel_noise, position_seed, seeded_tokens
from specdec_local.builder import build_engine, make_draft_model_drafter
from tests.law import first_two_token_counts, law_pvalue, two_token_law
from tests.tiny import ours, tiny_hf_model
from tests.unit.test_engine import VOCAB, prompts
from verifier_service.engine import Engine, EngineConfig
from verifier_service.verify import seeded_verify

FULL_MATRIX = os.environ.get("SPECDEC_FULL_MATRIX") == "1"
MAX_TOKENS = 24
SEEDS = (7, 1234)


@pytest.fixture(scope="module")
def target_hf():
    return tiny_hf_model(seed=1, logit_scale=8.0)


@pytest.fixture(scope="module")
def target(target_hf):
    return ours(target_hf)


@pytest.fixture(scope="module")
def weak_draft_hf():
    return tiny_hf_model(seed=2, layers=1, logit_scale=8.0)


@pytest.fixture(scope="module")
def weak_draft(weak_draft_hf):
    return ours(weak_draft_hf)


def make_engine(target, drafter=None, k=3, adaptive_k=False, prefix_cache=True, num_blocks=None, max_num_seqs=8):
    config = EngineConfig(num_speculative_tokens=k, max_num_seqs=max_num_seqs, max_model_len=90, adaptive_k=adaptive_k)
    cache = CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=prefix_cache)
    if isinstance(drafter, tuple):
        drafter = make_draft_model_drafter(
            *drafter, config, CacheConfig(block_size=4, enable_prefix_caching=prefix_cache)
        )
    elif drafter == "ngram":
        drafter = NgramDrafter()
    return build_engine(target, drafter, config, cache)


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams, int]]) -> dict[str, list[int]]:
    """requests: id -> (prompt, params, output_offset); returns id -> output ids."""
    for request_id, (prompt, params, offset) in requests.items():
        engine.add_request(request_id, prompt, params, output_offset=offset)
    outs: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            return outs
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.output_ids
    raise AssertionError("the engine did not finish")


def seeded_params(seed: int, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(target) -> dict[tuple[int, int], list[int]]:
    """(prompt index, seed) -> the output of plain seeded decoding: no drafter, alone in the batch."""
    out = {}
    for (i, prompt), seed in itertools.product(enumerate(prompts(2)), SEEDS):
        out[i, seed] = run(make_engine(target, None, k=0), {"r": (prompt, seeded_params(seed), 0)})["r"]
    return out


# ---- the noise --------------------------------------------------------------------------------------------


def test_noise_is_a_function_of_seed_and_position_only():
    a = gumbel_noise(5, [0, 1, 2], 50)  # [3, 50]
    assert torch.equal(a, gumbel_noise(5, [0, 1, 2], 50))
    assert torch.equal(a[1:], gumbel_noise(5, [1, 2], 50))  # a position's noise does not depend on the others
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], gumbel_noise(6, [0], 50)[0])
    # Nearby seeds and positions get unrelated generator seeds.
    seeds = {position_seed(s, p) for s in range(32) for p in range(32)}
    assert len(seeds) == 32 * 32


def test_seeded_token_is_a_sample_and_never_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]]).repeat(200, 1)  # [200, 4]
    tokens = torch.stack([seeded_tokens(probs[:1], s, [0])[0] for s in range(200)])
    assert set(tokens.tolist()) == {1, 3}


def test_verification_emits_the_seeded_tokens_whatever_was_drafted():
    gen = torch.Generator().manual_seed(0)
    target_probs = torch.softmax(torch.randn(6, 20, generator=gen), -1)  # [k+1, vocab], k = 5
    want = seeded_tokens(target_probs, 9, list(range(10, 16))).tolist()
    assert seeded_verify(target_probs, want[:5], 9, 10) == want  # all accepted, plus the bonus token
    wrong = (want[2] + 1) % 20
    assert seeded_verify(target_probs, [*want[:2], wrong, *want[3:5]], 9, 10) == want[:3]  # stop at the mismatch
    assert seeded_verify(target_probs[:1], [], 9, 10) == want[:1]


# ---- the law ----------------------------------------------------------------------------------------------


def _joint_pvalue(first_probs, second_given_first, same_noise: bool, n: int = 3000) -> float:
    """Chi-square of (token 0, token 1) over n seeds against the exact joint law first[a] * second[a, b]."""
    vocab = first_probs.shape[0]
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for s in range(n):
        t0 = int(seeded_tokens(first_probs[None], s, [0])[0])
        t1 = int(seeded_tokens(second_given_first[t0][None], s, [0 if same_noise else 1])[0])
        counts[t0, t1] += 1
    joint = (first_probs[:, None] * second_given_first).double().flatten()  # [vocab * vocab]
    expected = joint / joint.sum() * n  # the fp32 law sums to 1 only within rounding
    return float(chisquare(counts.flatten().numpy(), expected.numpy()).pvalue)


def test_law_of_positions_one_and_two_is_the_targets_and_reused_noise_is_caught():
    gen = torch.Generator().manual_seed(3)
    first = torch.softmax(torch.randn(5, generator=gen), -1)  # [vocab]
    second_given_first = torch.softmax(torch.randn(5, 5, generator=gen) * 0.3, -1)  # [first token, vocab]
    assert _joint_pvalue(first, second_given_first, same_noise=False) > 1e-4
    # The negative control: the same noise at both positions couples them, and the test sees it.
    assert _joint_pvalue(first, second_given_first, same_noise=True) < 1e-10


def test_engine_output_law_matches_target_over_seeds(target_hf, target, weak_draft):
    """Through the engine with a sampled draft (coupled verification), one seed per request: the first two
    tokens' marginals against the exact law."""
    temperature = 1.5
    first, second = two_token_law(target_hf, lambda logits: torch.softmax(logits / temperature, -1), VOCAB)
    config = EngineConfig(
        num_speculative_tokens=3, max_num_seqs=64, max_waiting=5000, max_model_len=16, adaptive_k=False
    )
    engine = build_engine(target, make_draft_model_drafter(*weak_draft, config, CacheConfig(4)), config, CacheConfig(4))
    n = 2000
    params_for = lambda i: SamplingParams(temperature=temperature, seed=i, max_tokens=4, ignore_eos=True)  # noqa: E731
    counts = first_two_token_counts(engine, n, params_for, VOCAB)
    for observed, law in ((counts[0], first), (counts[1], second)):
        assert law_pvalue(observed, law, n) > 1e-4
    assert 0 < engine.stats.accepted_tokens < engine.stats.drafted_tokens  # drafts both accepted and rejected


# ---- drafter invariance -----------------------------------------------------------------------------------

# (drafter, k, adaptive k, batch of 8, prefix cache, small KV cache: preemption)
LEAN = [
    ("ngram", 3, False, False, True, False),
    ("weak", 1, False, False, True, False),
    ("weak", 3, True, True, False, False),
    ("same", 5, False, True, True, False),
    ("weak", 3, False, True, True, True),
]
FULL = [
    (d, k, a, b, c, False)
    for d, k, a, b, c in itertools.product(
        ["none", "ngram", "weak", "same"], [1, 3, 5], [False, True], [False, True], [True, False]
    )
] + [(d, 3, False, True, True, True) for d in ["none", "ngram", "weak", "same"]]


@pytest.mark.parametrize(
    ("drafter", "k", "adaptive", "batch", "prefix_cache", "preempt"), FULL if FULL_MATRIX else LEAN
)
def test_seeded_output_does_not_depend_on_how_it_was_drafted(
    target, weak_draft, reference, drafter, k, adaptive, batch, prefix_cache, preempt
):
    d = {"none": None, "ngram": "ngram", "weak": weak_draft, "same": target}[drafter]
    engine = make_engine(target, d, k, adaptive, prefix_cache, num_blocks=40 if preempt else None)
    requests = {f"p{i}-s{s}": (p, seeded_params(s), 0) for (i, p), s in itertools.product(enumerate(prompts(2)), SEEDS)}
    if batch:  # other rows: greedy, unseeded, other seeds
        others = prompts(4, seed=5)
        requests["greedy"] = (others[0], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), 0)
        requests["unseeded"] = (others[1], SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS), 0)
        requests["other-seed"] = (others[2], seeded_params(99), 0)
        requests["top-k"] = (others[3], SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=MAX_TOKENS), 0)
        outs = run(engine, requests)
    else:
        outs = {}
        for request_id, request in requests.items():
            outs |= run(engine, {request_id: request})
    for (i, s), want in reference.items():
        assert outs[f"p{i}-s{s}"] == want, (i, s)
    if preempt:
        assert engine.scheduler.num_preemptions > 0
    if drafter == "same":  # the target drafting with the target's noise: accepted but for fp near-ties
        assert engine.stats.acceptance_rate > 0.9


# ---- failover ---------------------------------------------------------------------------------------------


def test_a_resumed_seeded_request_continues_exactly(target, weak_draft, reference):
    prompt, seed = prompts(2)[0], SEEDS[0]
    whole = reference[0, seed]
    first = run(make_engine(target, weak_draft), {"r": (prompt, seeded_params(seed, 9), 0)})["r"]
    assert first == whole[:9]
    # The rest on another engine (another drafter) with prompt + emitted as the prompt, told the offset.
    resumed = run(make_engine(target, "ngram", k=5), {"r": (prompt + first, seeded_params(seed, MAX_TOKENS - 9), 9)})
    assert first + resumed["r"] == whole
    # Without the offset the positions restart at 0: other noise, other text (so the check above can fail).
    restarted = run(make_engine(target), {"r": (prompt + first, seeded_params(seed, MAX_TOKENS - 9), 0)})
    assert first + restarted["r"] != whole


def test_an_output_offset_beyond_the_prompt_is_refused(target):
    from shared.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="output_offset"):
        make_engine(target).add_request("r", [1, 2], seeded_params(1), output_offset=3)


# ---- drafters ---------------------------------------------------------------------------------------------


def test_draft_model_drafts_with_the_targets_noise(weak_draft_hf, weak_draft):
    config = EngineConfig(num_speculative_tokens=3, max_model_len=90)
    drafter = make_draft_model_drafter(*weak_draft, config, CacheConfig(4))
    params, tokens = seeded_params(11), [3, 14, 15, 2, 65]
    (draft,) = drafter.propose([DraftRequest("s", len(tokens), tokens, 3, params, draft_position=4)])
    assert draft.probs is None and len(draft.token_ids) == 3  # coupled verification reads no draft probabilities
    ctx = list(tokens)
    with torch.no_grad():
        for j, token in enumerate(draft.token_ids):
            logits = weak_draft_hf(torch.tensor([ctx])).logits[0, -1:].float()  # [1, vocab]
            probs = logits_to_probs(logits, **params_to_tensors([params]))
            assert token == int(seeded_tokens(probs, 11, [4 + j])[0])
            ctx.append(token)
    # The draft position moves the noise: the same request at other positions drafts from other noise.
    drafts = {
        tuple(drafter.propose([DraftRequest(f"s{p}", len(tokens), tokens, 3, params, draft_position=p)])[0].token_ids)
        for p in range(8)
    }
    assert len(drafts) > 1
