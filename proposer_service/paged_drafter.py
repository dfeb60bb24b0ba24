"""What the two model drafters (draft model, EAGLE head) share: per-sequence committed history and state over
a paged KV cache of their own, release, eviction of idle sequences when blocks run out, the drafter's own
sampling stream, and each sequence's format (structured output)."""

from __future__ import annotations

import secrets
from typing import Generic, TypeVar

import torch

from proposer_service.draft_grammar import DraftGrammar
from shared.drafting import SequenceHistory, SparseProbs
from shared.grammar import GrammarCompiler
from shared.kv.block_manager import BlockManager
from shared.kv.cache import KVCache
from shared.sampling import SamplingParams

# Offsets the drafter's stream from the verifier's, which is seeded from the same request seed.
DRAFT_SEED_OFFSET = 0x9E3779B97F4A7C15

State = TypeVar("State")


class PagedDrafter(Generic[State]):
    def __init__(
        self, kv_cache: KVCache, block_manager: BlockManager, top_n: int, grammar: GrammarCompiler | None = None
    ) -> None:
        self.kv_cache = kv_cache
        self.blocks = block_manager
        self.top_n = top_n  # sampled drafts come from the top_n tokens, and exactly that distribution is sent
        self.history = SequenceHistory()
        self.states: dict[str, State] = {}
        self.grammar = DraftGrammar(grammar)  # without a compiler, sequences with a format are not drafted

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            if seq_id in self.states:
                self._drop_cache(seq_id)
            self.history.release(seq_id)
            self.grammar.release(seq_id)
            self.states.pop(seq_id, None)
            self.blocks.free(seq_id)

    def _drop_cache(self, seq_id: str) -> None:
        """Free the sequence's blocks, leaving those that hold committed tokens exactly in the prefix cache."""
        raise NotImplementedError

    def _reserve(self, seq_id: str, num_tokens: int, keep: set[str]) -> bool:
        """Room for `num_tokens`, evicting the caches of idle sequences (not in `keep`), oldest first."""
        while not self.blocks.can_reserve(seq_id, num_tokens):
            victims = [s for s in self.states if s not in keep and self.blocks.has_seq(s)]
            if not victims:
                return False
            self._drop_cache(victims[0])  # dicts keep insertion order
        self.kv_cache.copy_blocks(self.blocks.reserve(seq_id, num_tokens))
        return True


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def stack_supports(supports: list[tuple[torch.Tensor, torch.Tensor]]) -> SparseProbs:
    return SparseProbs(torch.stack([ids for ids, _ in supports]), torch.stack([p for _, p in supports]))


def draft_generator(params: SamplingParams) -> torch.Generator:
    seed = secrets.randbits(63) if params.seed is None else (params.seed + DRAFT_SEED_OFFSET) % (2**63)
    return torch.Generator().manual_seed(seed)
