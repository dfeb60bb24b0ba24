"""shared/logprobs.py: the log-softmax of the deciding positions, and its packed wire form."""

from __future__ import annotations

import pytest
import torch

from shared.logprobs import check_top_logprobs, from_proto, to_proto, token_logprobs
from shared.proto_gen.specdec.v1 import common_pb2


def test_token_logprobs_are_the_log_softmax_rows_of_the_deciding_positions():
    logits = torch.randn(4, 50)  # [positions, vocab]; only the first 3 decided emitted tokens
    entries = token_logprobs(logits, [7, 3, 49], num_top=4)
    expected = torch.log_softmax(logits, dim=-1)
    assert [e.token_id for e in entries] == [7, 3, 49]
    for row, (entry, token) in enumerate(zip(entries, [7, 3, 49], strict=True)):
        assert entry.logprob == pytest.approx(expected[row, token].item(), abs=1e-6)
        values, ids = expected[row].topk(4)
        assert list(entry.top_ids) == ids.tolist()
        assert list(entry.top_logprobs) == pytest.approx(values.tolist(), abs=1e-6)
    assert all(e.top_ids == () for e in token_logprobs(logits, [1], num_top=0))


def test_wire_round_trip_and_a_mismatch_is_refused():
    entries = token_logprobs(torch.randn(3, 20), [1, 2, 3], num_top=2)
    msg = common_pb2.Logprobs()
    to_proto(entries, 2, msg)
    assert msg.num_top == 2 and len(msg.top_token_ids) == 6
    back = from_proto(common_pb2.Logprobs.FromString(msg.SerializeToString()), [1, 2, 3])
    assert [e.token_id for e in back] == [1, 2, 3]
    assert [e.top_ids for e in back] == [e.top_ids for e in entries]
    assert [e.logprob for e in back] == pytest.approx([e.logprob for e in entries], abs=1e-6)  # float32 on the wire
    with pytest.raises(ValueError, match="do not match"):
        from_proto(msg, [1, 2])


@pytest.mark.parametrize(
    ("logprobs", "top", "ok"),
    [(False, 0, True), (True, 0, True), (True, 20, True), (True, 21, False), (False, 1, False)],
)
def test_top_logprobs_checks(logprobs, top, ok):
    assert (check_top_logprobs(logprobs, top) is None) == ok


def test_token_bytes_join_into_the_exact_text_even_where_a_character_spans_tokens():
    from gateway.token_text import TokenText
    from shared.model.loader import load_tokenizer
    from shared.settings import default_target_model

    tokenizer = load_tokenizer(default_target_model())
    text = "龘 naïve 🙂 — ok"
    ids = tokenizer.encode(text)
    tokens = TokenText(tokenizer)
    assert any("\ufffd" in tokens.text(i) for i in ids), "no character spans tokens here: pick another text"
    assert bytes(b for i in ids for b in tokens.bytes(i)).decode() == tokenizer.decode(ids)
