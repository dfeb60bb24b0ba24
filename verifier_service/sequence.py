"""A request's state inside the engine."""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field

import torch

from shared.drafting import FeatureStore
from shared.grammar import GrammarMatcher
from shared.sampling import SamplingParams
from verifier_service.acceptance import AcceptanceEstimate


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"


@dataclass
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order; preemption takes the newest first
    max_draft_tokens: int | None = None  # the request's own cap on k
    # Output tokens emitted before this prompt's end (a request resumed on this verifier after a failover):
    # seeded sampling counts output positions from here, so the resumed text is the uninterrupted one.
    output_offset: int = 0
    num_logprobs: int | None = None  # None: no logprobs; else the top alternatives reported per token
    tenant: str = ""  # the API key's name ('' = anonymous): cached state that reveals text stays per tenant
    tokens: list[int] = field(default_factory=list)  # prompt + output, all committed
    num_computed: int = 0  # tokens whose K/V are in the cache; the rest are fed next step
    num_cached_prompt: int | None = None  # prompt tokens found in the prefix cache at first admission
    finish_reason: FinishReason | None = None
    generator: torch.Generator = field(default_factory=torch.Generator)
    num_drafted: int = 0
    num_accepted: int = 0
    num_sent_to_proposer: int = 0  # committed tokens the proposer has seen
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    features: FeatureStore | None = None  # kept only when the drafter reads them (EAGLE)
    num_features_sent: int = 0  # positions whose features the proposer has been sent
    feature_slab: torch.Tensor | None = None  # [rows, width]: where its next features are copied (engine._in_slab)
    feature_slab_used: int = 0  # its rows written
    proposer_stream: int = 0  # the proposer stream (RemoteProposer.connections) that saw it last
    resyncs_left: float = 3.0  # whole-history resends this sequence may still ask for (engine.py refills them)
    resync_mark: int = 0  # len(tokens) at the last refill
    grammar: GrammarMatcher | None = None  # the request's format, past its committed output (shared/grammar.py)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)
        seed = secrets.randbits(63) if self.params.seed is None else self.params.seed
        self.generator.manual_seed(seed)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids) :]

    @property
    def output_position(self) -> int:
        """Output position (0 = the request's first generated token) of the next token to sample."""
        return self.output_offset + len(self.tokens) - len(self.prompt_ids)

    @property
    def tokens_left(self) -> int:
        """Output tokens the request may still emit (max_tokens less what it emitted)."""
        return self.params.max_tokens - (len(self.tokens) - len(self.prompt_ids))

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
