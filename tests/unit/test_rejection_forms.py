"""The draft forms that never build vocabulary-wide draft tensors: sparse (ids + probs) and one-hot (None)
drafts give the dense distribution's result draw for draw (a dense row handed over as a whole-vocabulary
support), and pass the output-law tests on their own; greedy
targets verified by id comparison equal rejection sampling of one-hot targets."""

from __future__ import annotations

import pytest
import torch

from shared.drafting import SparseProbs
from tests.draft_forms import one_hot_draft_probs, sparse_to_dense_draft_probs
from tests.unit.test_rejection_sampler import (
    ALPHA,
    NUM_SAMPLES,
    law_case,
    make_generators,
    output_law_pvalues,
    random_probs,
    rejection_sample,
    sample_drafts,
)
from verifier_service.rejection_sampler import greedy_verify

torch.set_num_threads(2)


def sparse_batch(seed: int, one_hot: bool):
    """Mixed k_i, a target with holes, drafts sampled from a top-3 sparse draft (or fixed, one-hot)."""
    gen = torch.Generator().manual_seed(seed)
    batch, vocab, k_max = (
        7,
        int(torch.randint(3, 30, (1,), generator=gen)),
        int(torch.randint(1, 5, (1,), generator=gen)),
    )
    num_draft = torch.randint(0, k_max + 1, (batch,), generator=gen)
    target = random_probs((batch, k_max + 1, vocab), gen, scale=2.0)
    target = target * (torch.rand(target.shape, generator=gen) > 0.3)
    target[..., 0] += 1e-3
    target = target / target.sum(-1, keepdim=True)
    top = random_probs((batch, k_max, vocab), gen, scale=2.0).topk(3, dim=-1)
    ids, probs = top.indices, top.values / top.values.sum(-1, keepdim=True)  # [batch, k_max, 3]
    probs[..., 2] = torch.where(torch.rand(batch, k_max, generator=gen) < 0.3, 0.0, probs[..., 2])  # padding
    ids[..., 2] = torch.where(probs[..., 2] == 0, -5, ids[..., 2])  # padding carries any id
    probs = probs / probs.sum(-1, keepdim=True)
    if one_hot:
        draft_ids = ids[..., 0].clone()
    else:
        picks = torch.multinomial(probs.view(-1, 3), 1, generator=gen).view(batch, k_max)
        draft_ids = ids.gather(-1, picks.unsqueeze(-1)).squeeze(-1)
    draft_ids[torch.rand(batch, k_max, generator=gen) < 0.1] = 0  # tokens the draft could not have produced
    return target, draft_ids, SparseProbs(ids, probs), num_draft, vocab


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("one_hot", [False, True])
def test_sparse_and_one_hot_forms_equal_the_dense_form(seed, one_hot):
    target, draft_ids, sparse, num_draft, vocab = sparse_batch(seed, one_hot)
    if one_hot:
        dense, form = one_hot_draft_probs(draft_ids, vocab), None
    else:
        dense, form = sparse_to_dense_draft_probs(sparse.token_ids, sparse.probs, vocab), sparse
    want = rejection_sample(target, draft_ids, dense, num_draft, make_generators(len(num_draft), seed))
    got = rejection_sample(target, draft_ids, form, num_draft, make_generators(len(num_draft), seed))
    assert torch.equal(got.num_accepted, want.num_accepted)
    assert torch.equal(got.output_token_ids, want.output_token_ids)


@pytest.mark.parametrize("seed", range(6))
def test_greedy_verify_equals_rejection_sampling_of_one_hot_targets(seed):
    gen = torch.Generator().manual_seed(seed)
    batch, k_max, vocab = 9, 4, 6  # a small vocabulary: drafts often match
    argmax = torch.randint(0, vocab, (batch, k_max + 1), generator=gen)
    target = torch.zeros(batch, k_max + 1, vocab).scatter_(-1, argmax.unsqueeze(-1), 1.0)
    draft_ids = torch.where(
        torch.rand(batch, k_max, generator=gen) < 0.7, argmax[:, :k_max], (argmax[:, :k_max] + 1) % vocab
    )
    num_draft = torch.randint(0, k_max + 1, (batch,), generator=gen)
    want = rejection_sample(target, draft_ids, None, num_draft, make_generators(batch, seed))
    got = greedy_verify(argmax, draft_ids, num_draft)
    assert torch.equal(got.num_accepted, want.num_accepted)
    assert torch.equal(got.output_token_ids, want.output_token_ids)
    assert int(got.num_accepted.sum()) > 0 and bool((got.num_accepted < num_draft).any())


def test_out_of_vocabulary_sparse_mass_is_refused():
    bad = SparseProbs(torch.tensor([[[1, 7]]]), torch.tensor([[[0.5, 0.5]]]))
    with pytest.raises(ValueError, match="outside"):
        bad.check(vocab_size=5)
    SparseProbs(torch.tensor([[[1, -1]]]), torch.tensor([[[1.0, 0.0]]])).check(vocab_size=5)  # padding is fine


@pytest.mark.parametrize(("kind", "vocab", "k_max"), [("sparse", 8, 3), ("one_hot", 7, 3)])
def test_output_law_of_the_sparse_and_one_hot_forms(kind, vocab, k_max):
    seed = vocab * 10 + k_max
    target, draft, gen = law_case(kind, vocab, k_max, seed)
    n = NUM_SAMPLES
    num_draft = torch.full((n,), k_max)
    draft_ids = sample_drafts(draft, n, gen)
    if kind == "sparse":
        top = draft.topk(3, dim=-1)  # the dense draft is exactly this support
        form: SparseProbs | None = SparseProbs(top.indices.expand(n, -1, -1), top.values.expand(n, -1, -1))
    else:
        form = None
    result = rejection_sample(target.expand(n, -1, -1), draft_ids, form, num_draft, make_generators(n, seed))
    pvalues = output_law_pvalues(target, draft, num_draft, result.output_token_ids, result.num_accepted)
    failed = {name: p for name, p in pvalues.items() if p <= ALPHA}
    assert not failed, failed
