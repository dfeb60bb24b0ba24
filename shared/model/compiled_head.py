"""An EAGLE head's draft forward and logits as compiled graphs (the proposer's `--compile`), the way
shared/model/compiled.py compiles the target: the fc, the head's decoder layers and its LM head over the vocabulary
subset traced by torch.compile, the paged attention (tree nodes included) an opaque op, and with a bf16 head on a
CPU with AMX (`products_in_graph`) every product made by Inductor's C++ GEMM templates over the frozen weights.

Why: a draft position is one token per sequence through six products and ~60 small ops, each eager call paying
its dispatch (oneDNN's bf16 products ~35-75 us each before any arithmetic), and the head drafts k positions one
after the other on the verifier's critical path. Drafts never change what the verifier emits, so the compiled
head needs no exactness of its own: its states stay within bf16 rounding of the eager head's (the fused ops round
differently), and a position's result does not depend on what else the forward computes, as with the eager head.
`fuse_features` (an EAGLE-3 head's fuse of the target's layers, once per committed token) stays eager.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from shared.model.attention import AttentionMetadata
from shared.model.compiled import CompiledLayers, check_can_compile, plain_weight

if TYPE_CHECKING:
    from shared.model.eagle import EagleHead
    from shared.model.llama import DecoderLayer


class CompiledHead(CompiledLayers):
    def __init__(self, head: EagleHead, templates: bool | None = None) -> None:
        check_can_compile(head.fc_weight.device)
        layers: list[DecoderLayer] = list(head.layers)  # type: ignore[arg-type]
        super().__init__(head.backend, layers, head.dtype, templates)
        self.head = head
        if self.templates:  # the graph freezes plain weights; the packed ones are not read again
            head.fc_weight = plain_weight(head.fc_weight, head.dtype)
            head.subset_lm_head = plain_weight(head.subset_lm_head, head.dtype)
        self.fc = self._register(head.fc_weight, head.fc_bias)
        self.lm_head = self._register(head.subset_lm_head)
        self.graph: Callable | None = None
        self.logits_graph: Callable | None = None

    def __call__(
        self,
        features: torch.Tensor,  # [T, hidden] in the head's dtype
        next_ids: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        if self.graph is None:
            self.graph = torch.compile(self._body, dynamic=True, fullgraph=True)
        return self._run(self.graph, kv_caches, meta, features, next_ids, meta.positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, draft_vocab] fp32
        if self.logits_graph is None:
            self.logits_graph = torch.compile(self._logits_body, dynamic=True, fullgraph=True)
        return self._run(self.logits_graph, None, None, hidden)

    def _body(self, features: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The twin of `EagleHead.forward` (shared/model/eagle.py); tests/unit/test_compiled_head.py holds them
        together."""
        head = self.head
        x = torch.cat([features, F.embedding(next_ids, head.embed_weight)], dim=-1)  # [T, 2 * hidden]
        x = self._matmul(x, self.fc, head.fc_weight, head.fc_bias)
        cos, sin = head.rotary(positions, x.dtype)
        for i in range(len(self.layers)):
            x = self._layer(i, x, cos, sin)
        return x

    def _logits_body(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.head
        return self._matmul(head.norm(hidden) if head.fused else hidden, self.lm_head, head.subset_lm_head).float()
