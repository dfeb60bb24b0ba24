"""Drafts on the wire (shared/draft_codec.py): what the proposer packs the verifier unpacks exactly, and
drafts that verification could not use are refused."""

from __future__ import annotations

import pytest
import torch

from shared.draft_codec import pack_draft, unpack_draft
from shared.drafting import Draft, SparseProbs
from shared.proto_gen.specdec.v1 import proposer_pb2
from tests.draft_forms import sparse_to_dense_draft_probs

VOCAB = 128


def test_pack_unpack_round_trip_is_exact():
    probs = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float32)
    ids = torch.tensor([[7, 3, 9, 0], [1, 2, 3, 4]])
    draft = Draft("q", 11, [3, 4], SparseProbs(ids, probs), needs_resync=True)
    msg = pack_draft("q", draft)
    assert list(msg.draft_prob_counts) == [3, 4]  # the zero-probability entry is left out
    back = unpack_draft(proposer_pb2.Draft.FromString(msg.SerializeToString()), VOCAB)
    assert (back.seq_id, back.token_ids, back.committed_len, back.needs_resync) == ("q", [3, 4], 11, True)
    assert back.probs is not None
    dense = sparse_to_dense_draft_probs(back.probs.token_ids, back.probs.probs, VOCAB)
    assert torch.equal(dense, sparse_to_dense_draft_probs(ids, probs, VOCAB))
    one_hot = unpack_draft(pack_draft("g", Draft("g", 5, [9, 8])), VOCAB)
    assert (one_hot.token_ids, one_hot.probs) == ([9, 8], None)


@pytest.mark.parametrize(
    "bad",
    [
        proposer_pb2.Draft(seq_id="q", draft_token_ids=[VOCAB]),
        proposer_pb2.Draft(
            seq_id="q", draft_token_ids=[1], draft_prob_token_ids=[2], draft_probs=[1.0], draft_prob_counts=[1]
        ),  # the drafted token has no probability
        proposer_pb2.Draft(
            seq_id="q", draft_token_ids=[1, 2], draft_prob_token_ids=[1], draft_probs=[1.0], draft_prob_counts=[1]
        ),
    ],
)
def test_unusable_drafts_are_refused(bad):
    with pytest.raises(ValueError):
        unpack_draft(bad, VOCAB)
