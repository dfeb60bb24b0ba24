"""Tests of the lossless rejection sampler: exact hand-made cases, the randomness protocol, and
seeded chi-square tests of the output law against closed forms (vLLM spec-decode style)."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from shared.drafting import SparseProbs
from shared.sampling import logits_to_probs
from tests.draft_forms import dense_as_sparse, one_hot_draft_probs, sparse_to_dense_draft_probs
from verifier_service import rejection_sampler
from verifier_service.rejection_sampler import MIN_RESIDUAL_MASS, RejectionResult

torch.set_num_threads(2)

# Significance of every chi-square test. Seeds are fixed, so the tests are deterministic; the level
# is strict enough that a correct sampler passes with a wide margin on these seeds and a wrong law
# at these sample sizes lands many orders of magnitude below it (see the negative controls).
ALPHA = 1e-4
NUM_SAMPLES = 40_000


def make_generators(num_rows: int, seed: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(num_rows)]


def random_probs(shape: tuple[int, ...], gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.softmax(torch.randn(shape, generator=gen) * scale, dim=-1)


def one_hot(token: int, vocab: int) -> torch.Tensor:
    row = torch.zeros(vocab)
    row[token] = 1.0
    return row


def rejection_sample(target_probs, draft_token_ids, draft_probs, num_draft_tokens, generators) -> RejectionResult:
    """The sampler, with dense draft distributions [batch, k_max, vocab] passed as whole-vocabulary supports."""
    if isinstance(draft_probs, torch.Tensor):
        draft_probs = dense_as_sparse(draft_probs)
    assert draft_probs is None or isinstance(draft_probs, SparseProbs)
    return rejection_sampler.rejection_sample(target_probs, draft_token_ids, draft_probs, num_draft_tokens, generators)


def run(target_probs, draft_token_ids, draft_probs, num_draft_tokens, seed=0) -> RejectionResult:
    num_draft_tokens = torch.as_tensor(num_draft_tokens, dtype=torch.int64)
    gens = make_generators(len(num_draft_tokens), seed)
    return rejection_sample(target_probs, draft_token_ids, draft_probs, num_draft_tokens, gens)


# ---------------------------------------------------------------------------------------------
# Reference: one row at a time, literally following the module's randomness protocol.
# ---------------------------------------------------------------------------------------------


def reference_inverse_cdf(probs: torch.Tensor, u: float) -> int:
    threshold = u * float(probs.double().sum())
    cumulative = 0.0
    for token, mass in enumerate(probs.double().tolist()):
        cumulative += mass
        if cumulative > threshold:
            return token
    raise AssertionError("inverse CDF ran off the end")


def reference_row(target_probs, draft_token_ids, draft_probs, k: int, gen) -> tuple[list[int], int]:
    u = torch.rand(k + 1, generator=gen, dtype=torch.float64).tolist()
    emitted: list[int] = []
    for j in range(k):
        d = int(draft_token_ids[j])
        target_at_d, draft_at_d = float(target_probs[j, d]), float(draft_probs[j, d])
        if draft_at_d > 0 and u[j] * draft_at_d < target_at_d:
            emitted.append(d)
            continue
        residual = (target_probs[j] - draft_probs[j]).clamp(min=0)
        stop = residual if float(residual.double().sum()) > MIN_RESIDUAL_MASS else target_probs[j]
        emitted.append(reference_inverse_cdf(stop, u[k]))
        return emitted, j
    emitted.append(reference_inverse_cdf(target_probs[k], u[k]))
    return emitted, k


def random_batch(seed: int):
    """A messy batch: mixed k_i, zeros in the target, dense / sparse / one-hot / equal drafts,
    some draft tokens the draft could not have produced, NaN padding."""
    gen = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 9, (1,), generator=gen))
    vocab = int(torch.randint(2, 40, (1,), generator=gen))
    k_max = int(torch.randint(0, 6, (1,), generator=gen))
    num_draft = torch.randint(0, k_max + 1, (batch,), generator=gen)
    target = random_probs((batch, k_max + 1, vocab), gen, scale=2.0)
    target = target * (torch.rand(target.shape, generator=gen) > 0.3)  # holes in the support
    target[..., 0] += 1e-3  # every row keeps some mass
    target = target / target.sum(-1, keepdim=True)
    kinds = torch.randint(0, 4, (batch,), generator=gen)
    draft = random_probs((batch, k_max, vocab), gen, scale=2.0)
    draft_ids = torch.zeros(batch, k_max, dtype=torch.int64)
    for i in range(batch):
        if kinds[i] == 1:  # draft equals the target exactly
            draft[i] = target[i, :k_max]
        elif kinds[i] == 2:  # truncated sparse draft
            top = draft[i].topk(min(3, vocab), dim=-1)
            draft[i] = sparse_to_dense_draft_probs(top.indices, top.values / top.values.sum(-1, keepdim=True), vocab)
        for j in range(k_max):
            draft_ids[i, j] = int(torch.multinomial(draft[i, j], 1, generator=gen))
        if kinds[i] == 3:  # one-hot drafts
            draft[i] = one_hot_draft_probs(draft_ids[i], vocab)
    # A few draft tokens the draft could not have sampled (caller bug: must be rejected safely).
    bad = torch.rand(batch, k_max, generator=gen) < 0.1
    draft_ids = torch.where(bad, torch.randint(0, vocab, (batch, k_max), generator=gen), draft_ids)
    # Padding is arbitrary: garbage ids and NaN probabilities beyond each row's drafts.
    pos = torch.arange(k_max)
    draft_ids = torch.where(pos < num_draft[:, None], draft_ids, torch.full_like(draft_ids, -7))
    draft = torch.where((pos < num_draft[:, None])[..., None], draft, torch.full_like(draft, float("nan")))
    target_pad = torch.arange(k_max + 1) > num_draft[:, None]
    target = torch.where(target_pad[..., None], torch.full_like(target, float("nan")), target)
    return target, draft_ids, draft, num_draft


@pytest.mark.parametrize("seed", range(40))
def test_batched_matches_row_by_row_reference(seed):
    target, draft_ids, draft, num_draft = random_batch(seed)
    result = run(target, draft_ids, draft, num_draft, seed=seed)
    gens = make_generators(len(num_draft), seed)
    for i in range(len(num_draft)):
        k = int(num_draft[i])
        emitted, accepted = reference_row(target[i], draft_ids[i], draft[i], k, gens[i])
        row = result.output_token_ids[i].tolist()
        assert int(result.num_accepted[i]) == accepted
        assert row[: accepted + 1] == emitted
        assert all(t == -1 for t in row[accepted + 1 :])
        for j, token in enumerate(emitted):
            assert float(target[i, j, token]) > 0, "emitted a token with zero target probability"


def test_each_generator_advances_by_exactly_k_plus_one_float64_draws():
    target, draft_ids, draft, num_draft = random_batch(3)
    gens = make_generators(len(num_draft), 5)
    rejection_sample(target, draft_ids, draft, num_draft, gens)
    for i, gen in enumerate(make_generators(len(num_draft), 5)):
        torch.rand(int(num_draft[i]) + 1, generator=gen, dtype=torch.float64)
        assert torch.equal(gens[i].get_state(), gen.get_state())


# ---------------------------------------------------------------------------------------------
# Exact cases
# ---------------------------------------------------------------------------------------------


def greedy_case(argmaxes: list[int], drafts: list[int], vocab: int = 7):
    target = torch.stack([one_hot(t, vocab) for t in argmaxes]).unsqueeze(0)  # [1, k+1, vocab]
    draft_ids = torch.tensor([drafts])
    return target, draft_ids, one_hot_draft_probs(draft_ids, vocab)


@pytest.mark.parametrize("seed", range(20))
def test_greedy_all_drafts_match_emits_bonus_argmax(seed):
    target, draft_ids, draft = greedy_case([3, 1, 4, 1, 5], [3, 1, 4, 1])
    result = run(target, draft_ids, draft, [4], seed=seed)
    assert result.output_token_ids.tolist() == [[3, 1, 4, 1, 5]]
    assert result.num_accepted.tolist() == [4]


@pytest.mark.parametrize("seed", range(20))
def test_greedy_first_mismatch_emits_argmax_and_drops_the_rest(seed):
    target, draft_ids, draft = greedy_case([3, 1, 4, 1, 5], [3, 2, 4, 1])
    result = run(target, draft_ids, draft, [4], seed=seed)
    assert result.output_token_ids.tolist() == [[3, 1, -1, -1, -1]]
    assert result.num_accepted.tolist() == [1]


@pytest.mark.parametrize("seed", range(10))
def test_greedy_target_from_logits_equals_plain_greedy_decoding(seed):
    gen = torch.Generator().manual_seed(seed)
    batch, k, vocab = 16, 4, 11
    logits = torch.randn(batch * (k + 1), vocab, generator=gen)
    zeros = torch.zeros(batch * (k + 1))
    target = logits_to_probs(logits, zeros, zeros.long(), zeros + 1, zeros).view(batch, k + 1, vocab)
    greedy = logits.argmax(-1).view(batch, k + 1)
    # Drafts agree with the target argmax for a random prefix, then differ.
    agree = torch.randint(0, k + 1, (batch,), generator=gen)
    draft_ids = torch.where(torch.arange(k) < agree[:, None], greedy[:, :k], (greedy[:, :k] + 1) % vocab)
    # Non-greedy (sparse, spread) draft distributions must not matter for a greedy target.
    draft = random_probs((batch, k, vocab), gen)
    draft.scatter_(-1, draft_ids.unsqueeze(-1), 0.5)
    result = run(target, draft_ids, draft, [k] * batch, seed=seed)
    assert result.num_accepted.tolist() == agree.tolist()
    for i in range(batch):
        n = int(agree[i])
        assert result.output_token_ids[i, : n + 1].tolist() == greedy[i, : n + 1].tolist()


def test_zero_drafts_samples_one_token_from_first_target_row():
    vocab = 6
    target = torch.full((3, 3, vocab), float("nan"))  # only row 0 of each sequence is read
    target[:, 0] = torch.stack([one_hot(2, vocab), one_hot(5, vocab), one_hot(0, vocab)])
    draft_ids = torch.full((3, 2), -1)
    draft = torch.full((3, 2, vocab), float("nan"))
    result = run(target, draft_ids, draft, [0, 0, 0])
    assert result.output_token_ids.tolist() == [[2, -1, -1], [5, -1, -1], [0, -1, -1]]
    assert result.num_accepted.tolist() == [0, 0, 0]


def test_zero_drafts_uses_the_single_uniform_by_inverse_cdf():
    target_row = torch.tensor([0.1, 0.0, 0.6, 0.3])
    result = run(target_row.view(1, 1, 4), torch.zeros(1, 0, dtype=torch.int64), torch.zeros(1, 0, 4), [0], seed=9)
    u = torch.rand(1, generator=make_generators(1, 9)[0], dtype=torch.float64).item()
    assert result.output_token_ids.tolist() == [[reference_inverse_cdf(target_row, u)]]


def test_k_max_zero_batch():
    gen = torch.Generator().manual_seed(0)
    target = random_probs((5, 1, 9), gen)
    result = run(target, torch.zeros(5, 0, dtype=torch.int64), torch.zeros(5, 0, 9), [0] * 5)
    assert result.output_token_ids.shape == (5, 1)
    assert result.num_accepted.tolist() == [0] * 5


def test_padding_rows_with_different_k_in_one_batch():
    vocab = 8
    argmaxes = [[1, 2, 3, 4, 5], [6, 7, 0, 1, 2], [3, 3, 3, 3, 3], [0, 1, 2, 3, 4]]
    target = torch.stack([torch.stack([one_hot(t, vocab) for t in row]) for row in argmaxes])
    draft_ids = torch.tensor([[1, 2, 3, 4], [6, 7, 99, -5], [3, 0, 3, 3], [-1, -1, -1, -1]])
    num_draft = [4, 2, 3, 0]
    draft = one_hot_draft_probs(draft_ids, vocab)
    draft[1, 2:] = float("nan")  # padding may be anything
    target[1, 3:] = float("nan")
    target[3, 1:] = float("nan")
    result = run(target, draft_ids, draft, num_draft)
    assert result.output_token_ids.tolist() == [
        [1, 2, 3, 4, 5],  # all 4 accepted, bonus
        [6, 7, 0, -1, -1],  # both accepted, bonus from target row k_i = 2
        [3, 3, -1, -1, -1],  # second draft rejected, argmax emitted
        [0, -1, -1, -1, -1],  # no drafts
    ]
    assert result.num_accepted.tolist() == [4, 2, 1, 0]


@pytest.mark.parametrize("seed", range(5))
def test_disjoint_supports_always_reject(seed):
    batch, k, vocab = 2000, 3, 6
    target = torch.zeros(batch, k + 1, vocab)
    target[..., :3] = torch.tensor([0.5, 0.3, 0.2])
    draft = torch.zeros(batch, k, vocab)
    draft[..., 3:] = torch.tensor([0.2, 0.3, 0.5])
    draft_ids = torch.multinomial(draft.view(-1, vocab), 1, generator=torch.Generator().manual_seed(seed)).view(
        batch, k
    )
    result = run(target, draft_ids, draft, [k] * batch, seed=seed)
    assert result.num_accepted.eq(0).all()
    assert (result.output_token_ids[:, 1:] == -1).all()
    assert stats_pvalue(result.output_token_ids[:, 0], target[0, 0]) > ALPHA


@pytest.mark.parametrize("seed", range(5))
def test_target_equal_to_draft_always_accepts(seed):
    gen = torch.Generator().manual_seed(seed)
    batch, k, vocab = 2000, 4, 7
    target = random_probs((k + 1, vocab), gen, scale=3.0).expand(batch, k + 1, vocab)
    draft = target[:, :k].clone()
    draft_ids = torch.multinomial(draft[0], batch, replacement=True, generator=gen).T.contiguous()
    result = run(target, draft_ids, draft, [k] * batch, seed=seed)
    assert result.num_accepted.eq(k).all()
    assert torch.equal(result.output_token_ids[:, :k], draft_ids)
    assert stats_pvalue(result.output_token_ids[:, k], target[0, k]) > ALPHA


def test_zero_residual_falls_back_to_target():
    # Target == draft, and the "draft" token is one the draft could not produce (q = p = 0 there):
    # it is rejected, the residual is exactly zero, and the row must still emit a target token.
    batch, vocab = 4000, 5
    dist = torch.tensor([0.4, 0.0, 0.35, 0.25, 0.0])
    target = dist.expand(batch, 2, vocab)
    draft = dist.expand(batch, 1, vocab)
    draft_ids = torch.full((batch, 1), 1)
    result = run(target, draft_ids, draft, [1] * batch)
    assert result.num_accepted.eq(0).all()
    emitted = result.output_token_ids[:, 0]
    assert (dist[emitted] > 0).all()
    assert stats_pvalue(emitted, dist) > ALPHA


def test_near_equal_distributions_with_rounding_noise_fall_back_to_target():
    gen = torch.Generator().manual_seed(1)
    vocab = 1000
    target_row = random_probs((vocab,), gen, scale=3.0)
    noisy = target_row * (1 + 1e-7 * torch.randn(vocab, generator=gen))  # what a second forward gives
    assert 0 < float((target_row - noisy).clamp(min=0).sum()) < MIN_RESIDUAL_MASS
    # Force a rejection with a zero-draft-probability token, then check the emitted token's support.
    noisy[0] = 0.0
    target_row[0] = 0.0
    target = target_row.expand(50, 2, vocab)
    result = run(target, torch.zeros(50, 1, dtype=torch.int64), noisy.expand(50, 1, vocab), [1] * 50)
    assert result.num_accepted.eq(0).all()
    assert (target_row[result.output_token_ids[:, 0]] > 0).all()


def test_draft_token_with_zero_draft_probability_is_rejected():
    # p(d) > 0 but q(d) = 0: the proposer could not have sampled d. It is rejected, and the residual
    # (which includes d, since p(d) - q(d) = p(d) > 0) is sampled.
    vocab = 4
    target = torch.tensor([[0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0]]).expand(3000, 2, vocab)
    draft = torch.tensor([[0.0, 0.5, 0.5, 0.0]]).expand(3000, 1, vocab)
    result = run(target, torch.zeros(3000, 1, dtype=torch.int64), draft, [1] * 3000)
    assert result.num_accepted.eq(0).all()
    residual = torch.tensor([0.25, 0.0, 0.0, 0.25])
    assert stats_pvalue(result.output_token_ids[:, 0], residual) > ALPHA


def test_never_emits_zero_target_probability_tokens():
    gen = torch.Generator().manual_seed(11)
    batch, k, vocab = 3000, 3, 12
    target = random_probs((batch, k + 1, vocab), gen, scale=2.0)
    target = target * (torch.rand(target.shape, generator=gen) > 0.5)
    target[..., 0] += 1e-30  # tiny but positive mass survives; everything else zero stays zero
    draft = random_probs((batch, k, vocab), gen, scale=2.0)
    draft_ids = torch.multinomial(draft.view(-1, vocab), 1, generator=gen).view(batch, k)
    result = run(target, draft_ids, draft, [k] * batch)
    for j in range(k + 1):
        emitted = result.num_accepted >= j
        tokens = result.output_token_ids[emitted, j]
        assert (target[emitted, j].gather(-1, tokens[:, None]) > 0).all()


def test_low_precision_inputs_are_upcast():
    gen = torch.Generator().manual_seed(2)
    target = random_probs((64, 3, 10), gen)
    draft = random_probs((64, 2, 10), gen)
    draft_ids = torch.multinomial(draft.view(-1, 10), 1, generator=gen).view(64, 2)
    low = run(target.half(), draft_ids, draft.bfloat16(), [2] * 64)
    high = run(target.half().float(), draft_ids, draft.bfloat16().float(), [2] * 64)
    assert torch.equal(low.output_token_ids, high.output_token_ids)


def test_invalid_inputs_raise():
    target = torch.full((2, 3, 5), 0.2)
    draft = torch.full((2, 2, 5), 0.2)
    ids = torch.zeros(2, 2, dtype=torch.int64)
    gens = make_generators(2, 0)
    with pytest.raises(ValueError, match="generator"):
        rejection_sample(target, ids, draft, torch.tensor([2, 2]), gens[:1])
    with pytest.raises(ValueError, match="num_draft_tokens"):
        rejection_sample(target, ids, draft, torch.tensor([3, 2]), gens)
    with pytest.raises(ValueError, match="draft token ids"):
        rejection_sample(target, torch.tensor([[0, 5], [0, 0]]), draft, torch.tensor([2, 2]), gens)
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(target[:, :2], ids, draft, torch.tensor([2, 2]), gens)
    with pytest.raises(ValueError, match="mass"):
        rejection_sample(torch.zeros(2, 3, 5), ids, draft, torch.tensor([0, 0]), gens)


def test_sparse_to_dense_adds_duplicates_and_ignores_zero_padding():
    ids = torch.tensor([[[1, 1, 3, 0, 0], [4, 2, 4, -1, 99]]])
    probs = torch.tensor([[[0.2, 0.3, 0.5, 0.0, 0.0], [0.25, 0.5, 0.25, 0.0, 0.0]]])
    dense = sparse_to_dense_draft_probs(ids, probs, vocab_size=5)
    expected = torch.tensor([[[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.5, 0.0, 0.5]]])
    torch.testing.assert_close(dense, expected)
    assert dense.dtype == torch.float32


def test_sparse_to_dense_rejects_out_of_vocab_mass():
    with pytest.raises(ValueError, match="outside"):
        sparse_to_dense_draft_probs(torch.tensor([[[7]]]), torch.tensor([[[1.0]]]), vocab_size=5)


def test_one_hot_draft_probs():
    dense = one_hot_draft_probs(torch.tensor([[2, 0, -1]]), vocab_size=3)
    assert dense.tolist() == [[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]]
    assert dense.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Determinism and batch invariance
# ---------------------------------------------------------------------------------------------


def spread_batch(seed: int, batch: int = 300, k: int = 4, vocab: int = 9):
    gen = torch.Generator().manual_seed(seed)
    target = random_probs((batch, k + 1, vocab), gen)
    draft = random_probs((batch, k, vocab), gen)
    draft_ids = torch.multinomial(draft.view(-1, vocab), 1, generator=gen).view(batch, k)
    return target, draft_ids, draft


def test_same_seeds_give_identical_outputs_and_different_seeds_differ():
    target, draft_ids, draft = spread_batch(0)
    k = [4] * 300
    first = run(target, draft_ids, draft, k, seed=1)
    again = run(target, draft_ids, draft, k, seed=1)
    other = run(target, draft_ids, draft, k, seed=2)
    assert torch.equal(first.output_token_ids, again.output_token_ids)
    assert torch.equal(first.num_accepted, again.num_accepted)
    assert not torch.equal(first.output_token_ids, other.output_token_ids)
    assert not torch.equal(first.num_accepted, other.num_accepted)


def test_row_alone_equals_row_inside_a_batch():
    gen = torch.Generator().manual_seed(4)
    batch, k_max, vocab = 6, 5, 10
    num_draft = [5, 0, 3, 1, 5, 2]
    target = torch.stack([random_probs((k_max + 1, vocab), gen, scale=0.5 + i) for i in range(batch)])
    draft = torch.stack([random_probs((k_max, vocab), gen, scale=0.5 + i) for i in range(batch)])
    draft_ids = torch.multinomial(draft.view(-1, vocab), 1, generator=gen).view(batch, k_max)
    seeds = [101, 7, 55, 3, 900, 42]
    together = rejection_sample(
        target, draft_ids, draft, torch.tensor(num_draft), [torch.Generator().manual_seed(s) for s in seeds]
    )
    for i, (k, seed) in enumerate(zip(num_draft, seeds, strict=True)):
        alone = rejection_sample(
            target[i : i + 1, : k + 1],
            draft_ids[i : i + 1, :k],
            draft[i : i + 1, :k],
            torch.tensor([k]),
            [torch.Generator().manual_seed(seed)],
        )
        assert alone.num_accepted.item() == together.num_accepted[i].item()
        assert alone.output_token_ids[0].tolist() == together.output_token_ids[i, : k + 1].tolist()
        assert (together.output_token_ids[i, k + 1 :] == -1).all()


# ---------------------------------------------------------------------------------------------
# Output law vs closed forms
# ---------------------------------------------------------------------------------------------


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Goodness of fit of category counts to a distribution; p = 0 if an impossible category occurs."""
    observed = observed.double()
    expected_probs = expected_probs.double() / expected_probs.double().sum()
    total = observed.sum()
    possible = expected_probs > 0
    if observed[~possible].sum() > 0:
        return 0.0
    observed, expected = observed[possible], expected_probs[possible] * total
    # Pool sparse categories so the chi-square approximation holds (expected count >= 5).
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    if len(observed) < 2:
        return 1.0
    return float(stats.chisquare(observed.numpy(), expected.numpy()).pvalue)


def stats_pvalue(tokens: torch.Tensor, expected_probs: torch.Tensor) -> float:
    return chi_square_pvalue(torch.bincount(tokens, minlength=len(expected_probs)), expected_probs)


MIN_GROUP = 300  # each conditional law below is tested on at least this many rows


def marginal_law_pvalues(target_probs, num_draft, output_token_ids, num_accepted) -> dict[str, float]:
    """Every emitted position j of a row is distributed as target_probs[j] (drafts independent of
    the prefix, so conditioning on reaching position j does not change its law)."""
    pvalues = {}
    for k in num_draft.unique().tolist():
        for j in range(k + 1):
            rows = (num_draft == k) & (num_accepted >= j)
            assert rows.sum() >= MIN_GROUP, f"too few rows reach position {j} with k={k}"
            pvalues[f"k={k} marginal@{j}"] = stats_pvalue(output_token_ids[rows, j], target_probs[j])
    return pvalues


def output_law_pvalues(target_probs, draft_probs, num_draft, output_token_ids, num_accepted) -> dict[str, float]:
    """Chi-square p-values of every closed form the sampler's output must follow.

    target_probs [k_max+1, vocab] and draft_probs [k_max, vocab] are shared by all rows."""
    pvalues = marginal_law_pvalues(target_probs, num_draft, output_token_ids, num_accepted)
    vocab = target_probs.shape[-1]
    overlap = torch.minimum(target_probs[:-1], draft_probs)  # [k_max, vocab]
    accept_rate = overlap.double().sum(-1)  # [k_max]: P(accept at j | reached j)
    for k in num_draft.unique().tolist():
        group = num_draft == k
        # (1) num_accepted: P(n) = prod_{j<n} a_j * (1 - a_n), P(k) = prod_{j<k} a_j.
        reach = torch.cat([torch.ones(1, dtype=torch.float64), accept_rate[:k].cumprod(0)])  # [k+1]
        law = reach.clone()
        law[:k] *= 1 - accept_rate[:k]
        counts = torch.bincount(num_accepted[group], minlength=k + 1)
        pvalues[f"k={k} num_accepted"] = chi_square_pvalue(counts, law)
        # (2) recovered token at the first rejection ~ norm(max(0, p_j - q_j)).
        for j in range(k):
            rows = group & (num_accepted == j)
            if law[j] * group.sum() >= MIN_GROUP:
                assert rows.sum() > 0
                residual = (target_probs[j] - draft_probs[j]).clamp(min=0)
                pvalues[f"k={k} recovered@{j}"] = stats_pvalue(output_token_ids[rows, j], residual)
        # (3) bonus token ~ p_k.
        rows = group & (num_accepted == k)
        assert rows.sum() >= MIN_GROUP
        pvalues[f"k={k} bonus"] = stats_pvalue(output_token_ids[rows, k], target_probs[k])
        # Joint of the first two tokens: an accepted first draft ~ min(p_0, q_0), and the next
        # token is independent of it with law p_1.
        if k >= 1:
            rows = group & (num_accepted >= 1)
            pairs = output_token_ids[rows, 0] * vocab + output_token_ids[rows, 1]
            joint = torch.outer(overlap[0], target_probs[1]).flatten()
            pvalues[f"k={k} joint@0,1"] = stats_pvalue(pairs, joint)
    return pvalues


def sample_drafts(draft_probs: torch.Tensor, num_rows: int, gen: torch.Generator) -> torch.Tensor:
    """[k, vocab] -> [num_rows, k] draft tokens, each position sampled from its own distribution."""
    if draft_probs.shape[0] == 0:
        return torch.zeros(num_rows, 0, dtype=torch.int64)
    return torch.multinomial(draft_probs, num_rows, replacement=True, generator=gen).T.contiguous()


def law_case(kind: str, vocab: int, k_max: int, seed: int):
    """Shared target / draft distributions for one law test (independent of the prefix)."""
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(k_max + 1, vocab, generator=gen)
    target = torch.softmax(target_logits, dim=-1)
    # Like a real draft model: close to the target but not equal, so every position is reached.
    draft_logits = target_logits[:k_max] + 0.8 * torch.randn(k_max, vocab, generator=gen)
    if kind == "dense":
        draft = torch.softmax(draft_logits, dim=-1)
    elif kind == "sparse":
        # The proposer sampled from its top-3 tokens, renormalised, and sent ids + probs (with one
        # id split over two entries, to exercise duplicates).
        top = draft_logits.topk(3, dim=-1)
        values = top.values / top.values.sum(-1, keepdim=True)
        ids = torch.cat([top.indices, top.indices[:, :1]], dim=-1).unsqueeze(0)
        probs = torch.cat([values[:, :1] / 2, values[:, 1:], values[:, :1] / 2], dim=-1).unsqueeze(0)
        draft = sparse_to_dense_draft_probs(ids, probs, vocab)[0]
    elif kind == "one_hot":
        # A greedy proposer: its token is fixed per position (its own argmax).
        fixed = draft_logits.argmax(dim=-1)
        draft = one_hot_draft_probs(fixed.unsqueeze(0), vocab)[0]
    else:
        raise AssertionError(kind)
    return target, draft, gen


LAW_CASES = [
    ("dense", 4, 1, False),
    ("dense", 5, 2, False),
    ("dense", 6, 3, False),
    ("dense", 8, 4, False),
    ("sparse", 6, 2, False),
    ("sparse", 8, 3, False),
    ("one_hot", 5, 2, False),
    ("one_hot", 7, 3, False),
    ("dense", 6, 3, True),  # k_i varies per row in the batch
]


@pytest.mark.parametrize(("kind", "vocab", "k_max", "mixed_k"), LAW_CASES)
def test_output_law_matches_closed_forms(kind, vocab, k_max, mixed_k):
    seed = vocab * 10 + k_max
    target, draft, gen = law_case(kind, vocab, k_max, seed)
    n = NUM_SAMPLES
    # Mixed: k_i varies per row, so each k is checked against its own closed forms.
    num_draft = torch.randint(0, k_max + 1, (n,), generator=gen) if mixed_k else torch.full((n,), k_max)
    draft_ids = sample_drafts(draft, n, gen)
    result = run(target.expand(n, -1, -1), draft_ids, draft.expand(n, -1, -1), num_draft, seed=seed)
    pvalues = output_law_pvalues(target, draft, num_draft, result.output_token_ids, result.num_accepted)
    failed = {name: p for name, p in pvalues.items() if p <= ALPHA}
    assert not failed, failed


def always_accept_sampler(target_probs, draft_token_ids, num_draft, gen) -> RejectionResult:
    """Wrong on purpose: accepts every draft and appends a bonus from target_probs[k]."""
    n, k = draft_token_ids.shape
    bonus = torch.multinomial(target_probs[:, k], 1, generator=gen)
    return RejectionResult(torch.cat([draft_token_ids, bonus], dim=1), torch.full((n,), k))


def resample_target_on_reject_sampler(target_probs, draft_token_ids, draft_probs, num_draft, gen):
    """Wrong on purpose (a classic bug): on rejection draws from target_probs, not the residual."""
    result = run(target_probs, draft_token_ids, draft_probs, num_draft, seed=77)
    rows = torch.arange(len(num_draft))
    rejected = result.num_accepted < num_draft
    stop_target = target_probs[rows, result.num_accepted]
    fresh = torch.multinomial(stop_target, 1, generator=gen).squeeze(1)
    out = result.output_token_ids.clone()
    out[rows[rejected], result.num_accepted[rejected]] = fresh[rejected]
    return RejectionResult(out, result.num_accepted)


@pytest.mark.parametrize("wrong", ["always_accept", "resample_target_on_reject"])
def test_marginal_law_check_catches_wrong_samplers(wrong):
    target, draft, gen = law_case("dense", 6, 3, seed=63)
    n = NUM_SAMPLES
    num_draft = torch.full((n,), 3)
    draft_ids = sample_drafts(draft, n, gen)
    targets, drafts = target.expand(n, -1, -1), draft.expand(n, -1, -1)
    if wrong == "always_accept":
        result = always_accept_sampler(targets, draft_ids, num_draft, gen)
    else:
        result = resample_target_on_reject_sampler(targets, draft_ids, drafts, num_draft, gen)
    pvalues = marginal_law_pvalues(target, num_draft, result.output_token_ids, result.num_accepted)
    assert min(pvalues.values()) < ALPHA, pvalues
    # The same check on the real sampler (same inputs) passes: the difference is the sampler.
    correct = run(targets, draft_ids, drafts, num_draft, seed=63)
    pvalues = marginal_law_pvalues(target, num_draft, correct.output_token_ids, correct.num_accepted)
    assert min(pvalues.values()) > ALPHA, pvalues
