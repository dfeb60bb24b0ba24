"""Linear weights packed at load into oneDNN's blocked layout (`shared/model/parallel.py: pack_weight`).

The packed product must equal the plain one to fp32 rounding, in every shape the model calls it with, and a
row's result must not depend on how many rows share the product: that is what lets a speculative step's
k + 1 scored rows give, bit for bit, the logits a one-token step would.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.model.eagle import build_head, head_config, init_head_state, save_head
from shared.model.parallel import ColumnParallelLinear, RowParallelLinear, linear, pack_weight
from tests.tiny import ours, tiny_hf_model

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("shape", [(96, 64), (192, 64), (64, 128), (1000, 64)])
def test_packed_product_equals_plain(shape):
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(*shape, generator=gen), torch.randn(shape[0], generator=gen)
    packed = pack_weight(weight)
    assert packed.is_mkldnn
    for rows in ((1, shape[1]), (7, shape[1]), (3, 5, shape[1])):  # 3-D: the EAGLE head's [batch, seq, hidden]
        x = torch.randn(*rows, generator=gen)
        torch.testing.assert_close(linear(x, packed), F.linear(x, weight), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(linear(x, packed, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


@needs_onednn
def test_a_rows_result_does_not_depend_on_the_other_rows():
    gen = torch.Generator().manual_seed(1)
    packed = pack_weight(torch.randn(3072, 576, generator=gen))
    x = torch.randn(40, 576, generator=gen)
    together = linear(x, packed)
    for start, stop in ((0, 1), (0, 5), (3, 4), (7, 16), (11, 40)):
        assert torch.equal(linear(x[start:stop], packed), together[start:stop]), (start, stop)


def test_weights_that_onednn_would_not_take_stay_plain():
    for weight in (torch.randn(8, 4, dtype=torch.float16), torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(8)):
        assert pack_weight(weight) is weight


@needs_onednn
def test_loaded_models_and_heads_are_packed_and_keep_their_plain_embedding(tmp_path):
    model, arch = ours(tiny_hf_model(seed=3))
    linears = [m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    assert linears and all(m.weight.is_mkldnn for m in linears)
    assert not model.embed_tokens.weight.is_mkldnn  # read by the embedding and by EAGLE heads
    hidden = torch.randn(4, arch.hidden_size)
    torch.testing.assert_close(
        model.compute_logits(hidden), F.linear(hidden, model.lm_head_weight), atol=1e-4, rtol=1e-5
    )
    config = head_config(arch, 1, 16)
    save_head(tmp_path, config, init_head_state(arch, torch.arange(16)))
    head, _ = build_head(tmp_path, model.embed_tokens.weight, model.lm_head_weight)
    assert head.fc_weight.is_mkldnn and head.subset_lm_head.is_mkldnn
    assert all(m.weight.is_mkldnn for m in head.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear))
