"""Runs one mixed forward over the paged cache: prefill chunks and multi-query scoring in one call."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.kv.cache import KVCache
from shared.model.attention import SeqSpan, TreeSpec, build_metadata, select_backend, uses_kernel
from shared.model.llama import LlamaModel

FINAL_LAYER = (-1,)  # the features of an EAGLE-1 head: the final normed hidden states


@dataclass(frozen=True)
class ForwardItem:
    """`token_ids` are written at positions num_cached.. of the sequence whose blocks are `block_table`;
    logits are returned for the last `num_logits` of them (0 for a prefill chunk that is not the last).
    `tree`: the last tokens are a token tree's nodes, scored with tree attention (shared/model/attention.py;
    `tree_of_parents` makes one from the nodes' parents)."""

    block_table: list[int]
    num_cached: int
    token_ids: list[int]
    num_logits: int
    tree: TreeSpec | None = None

    def span(self) -> SeqSpan:
        return SeqSpan(self.block_table, self.num_cached, len(self.token_ids), self.tree)


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache, attention_backend: str = "auto") -> None:
        self.model = model
        self.cache = cache
        self.device = model.embed_tokens.weight.device
        k_cache = cache.layers[0][0] if cache.layers else None
        model.backend = select_backend(
            attention_backend,
            self.device,
            cache.block_size,
            None if k_cache is None else k_cache.dtype,
            None if k_cache is None else k_cache.shape[-1],
        )

    @property
    def vocab_size(self) -> int:
        return self.model.arch.vocab_size

    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor]:
        """Returns per item its logits [num_logits, vocab] fp32 (empty when num_logits == 0)."""
        return self.forward_with_hidden(items)[0]

    def forward_with_hidden(
        self, items: list[ForwardItem], layers: tuple[int, ...] = FINAL_LAYER
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Logits as `forward`, and per item the features an EAGLE drafter reads, of all its tokens, from the
        same pass that scored them: the hidden states of `layers` (decoder layer i's output; -1 the final
        normed state), concatenated [len(token_ids), len(layers) * hidden]."""
        spans = [it.span() for it in items]
        meta = build_metadata(spans, self.cache.block_size, self.device, kernel=uses_kernel(self.model.backend))
        input_ids = torch.tensor([t for it in items for t in it.token_ids], dtype=torch.int64, device=self.device)
        if tuple(layers) == FINAL_LAYER:
            hidden = features = self.model(input_ids, self.cache.layers, meta)  # [T, hidden]
        else:
            hidden, captured = self.model.forward_with_layers(input_ids, self.cache.layers, meta, tuple(layers))
            assert captured is not None
            features = captured  # [T, len(layers) * hidden]

        rows: list[int] = []
        end = 0
        for it in items:
            end += len(it.token_ids)
            rows.extend(range(end - it.num_logits, end))
        logits = self.model.compute_logits(hidden[rows]) if rows else hidden.new_zeros(0, self.vocab_size)
        per_item_features = list(features.split([len(it.token_ids) for it in items]))
        return list(logits.split([it.num_logits for it in items])), per_item_features
