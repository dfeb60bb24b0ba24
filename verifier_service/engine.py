"""The verifier's engine: one speculative step over every running sequence.

    schedule -> propose (one batched drafter call) -> score (one forward) -> verify -> commit

The core has no gRPC in it; the service drives `step()` from a worker thread.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from shared.drafting import Draft, Drafter, DraftRequest, FeatureStore
from shared.errors import InvalidRequestError, QueueFullError
from shared.grammar import GrammarCompiler
from shared.kv.block_manager import BlockManager
from shared.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprobs
from shared.model.runner import FINAL_LAYER, ForwardItem, ModelRunner
from shared.sampling import SamplingParams
from verifier_service import grammar_masks
from verifier_service.config import EngineConfig
from verifier_service.grammar_masks import GrammarMasks, MaskTiming
from verifier_service.scheduler import ScheduledSeq, Scheduler
from verifier_service.sequence import FinishReason, Sequence
from verifier_service.verify import ScoredRow, trim, verify

# The engine's errors are the shared domain errors, so servicers map them in one place.
RequestError = InvalidRequestError
WARM_UP_TOKENS = 4  # generated per warm-up request: the prefill step, then speculative steps


class SpeculationRatios:
    """The ratios of the speculation counters, for every class that holds them (EngineStats, StatsSnapshot)."""

    sequence_steps: int
    draft_rounds: int
    drafted_tokens: int
    accepted_tokens: int
    emitted_tokens: int

    @property
    def tokens_per_step(self) -> float:
        """Emitted / sequence steps: tokens per sequence per step, steps that drafted nothing included."""
        return self.emitted_tokens / self.sequence_steps if self.sequence_steps else 0.0

    @property
    def tokens_per_draft_round(self) -> float:
        """1 + accepted / draft rounds: tokens per step among the sequence steps that drafted."""
        return 1.0 + self.accepted_tokens / self.draft_rounds if self.draft_rounds else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


@dataclass
class EngineStats(SpeculationRatios):
    steps: int = 0
    sequence_steps: int = 0  # (sequence, step) pairs that sampled tokens
    draft_rounds: int = 0  # sequence steps that scored at least one draft token
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # sampled tokens: accepted + one recovered or bonus per sequence step
    stale_drafts: int = 0


class StepObserver(Protocol):
    """Sees each step: its batch, then the end of the propose phase, then its outputs and phase times
    (time.perf_counter values: start, end of propose, end of score, end of verify)."""

    def step_started(self, batch: list[ScheduledSeq]) -> None: ...

    def propose_finished(self, proposed: float) -> None: ...

    def step_finished(
        self, outputs: list[RequestOutput], start: float, proposed: float, scored: float, verified: float
    ) -> None: ...


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    num_drafted: int = 0
    num_accepted: int = 0
    prompt_len: int = 0
    output_ids: list[int] = field(default_factory=list)
    num_cached_prompt: int = 0  # prompt tokens whose K/V came from the prefix cache
    features: FeatureStore | None = None  # on the finishing output, when the engine captures features
    error: str | None = None  # set when this request failed alone (finish_reason ABORT): why, for a person
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        blocks: BlockManager,
        drafter: Drafter | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        capacity = blocks.num_blocks * blocks.block_size
        if capacity < config.max_model_len + config.num_speculative_tokens + 1:
            # Otherwise a lone long sequence could never fit and preemption would loop forever.
            raise ValueError(
                f"the KV cache holds {capacity} tokens, less than one full sequence "
                f"(max_model_len {config.max_model_len} + {config.num_speculative_tokens} draft slots + 1): "
                "add blocks or lower max_model_len"
            )
        self.config = config
        self.runner = runner
        self.blocks = blocks
        self.drafter = drafter
        self.eos_token_ids = frozenset(eos_token_ids)
        # Without a drafter nothing is drafted: the scheduler reserves no draft slots.
        self.scheduler = Scheduler(config if drafter is not None else replace(config, num_speculative_tokens=0), blocks)
        self.seqs: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self._arrivals = itertools.count()
        # Telemetry hooks (verifier_service/telemetry.py), called from step(); None costs nothing.
        self.observer: StepObserver | None = None
        # Keep every sequence's target hidden states even without a drafter that reads them (the trainer).
        self.capture_features = False
        # Structured output (verifier_service/grammar_masks.py): None until a compiler is set.
        self._masks: GrammarMasks | None = None

    def enable_structured_output(self, tokenizer) -> None:
        """Accept requests with a format; `tokenizer` is the target's (the grammar is matched on its tokens)."""
        self.grammar = GrammarCompiler(tokenizer, self.runner.vocab_size, tuple(self.eos_token_ids))

    @property
    def grammar(self) -> GrammarCompiler | None:
        return self._masks.compiler if self._masks is not None else None

    @grammar.setter
    def grammar(self, compiler: GrammarCompiler | None) -> None:
        self._masks = GrammarMasks(compiler) if compiler is not None else None

    @property
    def last_masks(self) -> MaskTiming | None:
        """The grammar masks of the last step that masked, for telemetry."""
        return self._masks.last if self._masks is not None else None

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        max_draft_tokens: int | None = None,
        output_offset: int = 0,
        num_logprobs: int | None = None,
        tenant: str = "",
    ) -> None:
        """`max_draft_tokens` lowers this request's k below the engine's (0: no speculation for it).
        `output_offset`: output tokens already emitted at the end of `prompt_ids` (a resumed request), where
        seeded sampling's output positions start. `num_logprobs`: None, or report each emitted token's
        log-probability with that many top alternatives (shared/logprobs.py). `tenant`: the API key's name
        ('' = anonymous), passed to the drafter."""
        self._validate(request_id, prompt_ids, params)
        if num_logprobs is not None and not 0 <= num_logprobs <= min(MAX_TOP_LOGPROBS, self.runner.vocab_size):
            raise RequestError(f"top_logprobs must lie in [0, {MAX_TOP_LOGPROBS}], got {num_logprobs}")
        if max_draft_tokens is not None and max_draft_tokens < 0:
            raise RequestError(f"max_draft_tokens must be >= 0, got {max_draft_tokens}")
        if not 0 <= output_offset <= len(prompt_ids):
            raise RequestError(f"output_offset must lie in [0, {len(prompt_ids)}] (the prompt), got {output_offset}")
        seq = Sequence(
            request_id,
            list(prompt_ids),
            params,
            next(self._arrivals),
            max_draft_tokens,
            output_offset=output_offset,
            num_logprobs=num_logprobs,
            tenant=tenant,
        )
        if params.structured_output is not None:
            if self.grammar is None:
                raise RequestError("structured output needs the target's tokenizer, which this verifier did not load")
            seq.grammar = self.grammar.matcher(params.structured_output)
            # A resumed request's emitted tokens end its prompt: the format continues after them.
            seq.grammar.consume(prompt_ids[len(prompt_ids) - output_offset :])
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        seq.finish_reason = FinishReason.ABORT
        self._release(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def warm_up(self) -> None:
        """Serve one synthetic full batch before any request, as vLLM's profile run does: every sequence slot, a
        prefill as large as one step feeds, then speculative steps, greedy and sampled rows. The step's tensors
        reach their serving size now, so resident memory does not climb later as load first fills the batch
        (shared/malloc_tuning.py keeps that heap), and the first users pay no first-touch cost. The counters
        start from zero afterwards."""
        num_seqs = self.config.max_num_seqs
        room = self.config.max_model_len - WARM_UP_TOKENS - self.config.num_speculative_tokens - 1
        prompt_len = max(1, min(self.config.max_num_batched_tokens // num_seqs, room))
        rng = random.Random(0)
        for i in range(num_seqs):
            params = SamplingParams(
                temperature=0.0 if i % 2 else 1.0, top_p=0.9, max_tokens=WARM_UP_TOKENS, ignore_eos=True
            )
            prompt = [rng.randrange(self.runner.vocab_size) for _ in range(prompt_len)]
            self.add_request(f"warm-up-{i}", prompt, params)
        while self.has_unfinished():
            self.step()
        for counters in (self.stats, self.scheduler.prefix_cache):  # in place: telemetry holds these objects
            for name in vars(counters):
                setattr(counters, name, 0)
        self.scheduler.num_preemptions = 0

    def _validate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab = self.runner.vocab_size
        if request_id in self.seqs:
            raise RequestError(f"request id {request_id!r} is already running")
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_ids) >= self.config.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens; the context limit is {self.config.max_model_len} "
                "and at least one token must be generated"
            )
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        try:
            params.validate(vocab)
        except ValueError as err:
            raise RequestError(str(err)) from err
        # Requests the next step will admit do not wait: only those beyond the free batch slots count.
        free_slots = max(0, self.config.max_num_seqs - len(self.scheduler.running))
        if len(self.scheduler.waiting) - free_slots >= self.config.max_waiting:
            raise QueueFullError(f"{self.config.max_waiting} requests are already waiting; retry later")

    # ---- the step -------------------------------------------------------------------------------

    @property
    def keeps_features(self) -> bool:
        """Hidden states cost a copy per step, so only a drafter that reads them (EAGLE) or the trainer asks."""
        return self.capture_features or bool(getattr(self.drafter, "needs_target_features", False))

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose hidden states are kept, as the drafter reads them (an EAGLE-3 head: a low,
        a middle and a high layer, concatenated per position); the final normed state by default."""
        return tuple(getattr(self.drafter, "feature_layers", FINAL_LAYER))

    def step(self) -> list[RequestOutput]:
        """One speculative step over every running sequence: schedule, propose, score, verify, commit."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        observer = self.observer
        if observer is not None:
            observer.step_started(batch)
        start = time.perf_counter()
        drafts, ingesting = self._propose(batch)
        proposed = time.perf_counter()
        if observer is not None:
            observer.propose_finished(proposed)
        sampling = [s for s in batch if s.samples]
        masks = self._masks.start([(s.seq, drafts.get(s.seq.seq_id)) for s in sampling]) if self._masks else None
        logits, hidden = self._score(batch, drafts)  # the masks are computed meanwhile
        scored = time.perf_counter()
        if not ingesting:  # a prompt's early ingest would count as drafting cost
            self._measure_costs(batch, drafts, proposed - start, scored - proposed)
        rows = [
            ScoredRow(s.seq, drafts.get(s.seq.seq_id), lg) for s, lg in zip(batch, logits, strict=True) if s.samples
        ]
        emitted = verify(rows, self._masks.finish(masks) if self._masks else {}, self.runner.vocab_size)
        verified = time.perf_counter()
        self.stats.steps += 1
        outputs = self._commit_step(batch, rows, emitted, hidden)
        if observer is not None:
            observer.step_finished(outputs, start, proposed, scored, verified)
        return outputs

    def _score(
        self, batch: list[ScheduledSeq], drafts: dict[str, Draft]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """ONE forward over every sequence's fed tokens and drafts: per sequence its logits [num_logits, vocab]
        and, when features are kept, its final hidden states [num_tokens, hidden]."""
        items = [self._forward_item(s, drafts.get(s.seq.seq_id)) for s in batch]
        if self.keeps_features:
            logits, hidden_states = self.runner.forward_with_hidden(items, self.feature_layers)
            return logits, list(hidden_states)
        return self.runner.forward(items), [None] * len(items)

    def _commit_step(
        self,
        batch: list[ScheduledSeq],
        rows: list[ScoredRow],
        emitted: list[list[int] | str],
        hidden: list[torch.Tensor | None],
    ) -> list[RequestOutput]:
        sampled_hidden = []
        for s, h in zip(batch, hidden, strict=True):
            if s.samples:
                sampled_hidden.append(h)
                continue
            self._keep_features(s.seq, h, s.num_feed)
            s.seq.num_computed += s.num_feed  # a prefill chunk that is not the last one
            self._rollback_blocks(s.seq)
        outputs = []
        for s, row, tokens, h in zip([s for s in batch if s.samples], rows, emitted, sampled_hidden, strict=True):
            if isinstance(tokens, str):
                outputs.append(self._fail(s.seq, tokens))
                continue
            self._keep_features(s.seq, h, s.num_feed + len(tokens) - 1)  # fed tokens and accepted drafts
            # Token j of a row was decided at its scored position j (accepted drafts, then the recovered or
            # bonus token), so the raw logits of this one scoring pass give every token's log-probability.
            num_top = s.seq.num_logprobs
            logprobs = token_logprobs(row.logits, tokens, num_top) if num_top is not None else None
            out = self._commit(s, row.draft, tokens, logprobs)
            why = grammar_masks.advance(s.seq, out.new_token_ids) if not out.finished else None
            outputs.append(out if why is None else self._fail(s.seq, why))
        return outputs

    @staticmethod
    def _keep_features(seq: Sequence, hidden: torch.Tensor | None, num_valid: int) -> None:
        """Features of the positions this step computed for good (fed tokens and accepted drafts)."""
        if hidden is None:
            return
        if seq.features is None:
            seq.features = FeatureStore()
        seq.features.add(seq.num_computed, hidden[:num_valid].clone())  # a view would keep the step's whole batch

    def _measure_costs(self, batch: list[ScheduledSeq], drafts: dict[str, Draft], propose_s: float, score_s: float):
        if drafts:
            draft_positions = max(len(d.token_ids) for d in drafts.values())
            self.scheduler.cost_ratio.update(propose_s, draft_positions, score_s)
        if all(s.samples and s.num_feed == 1 for s in batch):  # prefill chunks would skew the per-token cost
            query_tokens = len(batch) + sum(len(d.token_ids) for d in drafts.values())
            self.scheduler.scoring_cost.update(query_tokens, score_s)

    def _propose(self, batch: list[ScheduledSeq]) -> tuple[dict[str, Draft], bool]:
        """Drafts of the sequences that sample this step with k > 0. A prompt being prefilled in chunks is
        also sent, its chunk's tokens with k = 0, so the drafter ingests it alongside the target instead of
        catching up on all of it in the first draft round. Returns (drafts, whether any prompt was sent)."""
        if self.drafter is None:
            return {}, False
        scheduled = []
        for s in batch:
            seq = s.seq
            committed = len(seq.tokens) if s.samples else seq.num_computed + s.num_feed
            if (s.samples and s.k > 0) or (not s.samples and committed > seq.num_sent_to_proposer):
                scheduled.append((s, committed))
        if not scheduled:
            return {}, False
        requests = []
        for s, committed in scheduled:
            seq = s.seq
            new = seq.tokens[seq.num_sent_to_proposer : committed]
            feature_start, features = 0, None
            if seq.features is not None and self.keeps_features:
                feature_start, features = seq.features.since(seq.num_features_sent)
                seq.num_features_sent = seq.features.end
            k = s.k if s.samples else 0
            requests.append(
                DraftRequest(
                    seq.seq_id, committed, new, k, seq.params, features, feature_start, seq.output_position, seq.tenant
                )
            )
            seq.num_sent_to_proposer = committed
        drafts = {}
        for (s, _), draft in zip(scheduled, self.drafter.propose(requests), strict=True):
            if draft.needs_resync:
                s.seq.num_sent_to_proposer = 0
                s.seq.num_features_sent = 0
            if not s.samples:
                continue  # an ingest: nothing to verify
            if draft.committed_len != len(s.seq.tokens) or draft.seq_id != s.seq.seq_id:
                self.stats.stale_drafts += 1  # built on another prefix: never applied
                continue
            if draft.token_ids:
                drafts[draft.seq_id] = trim(draft, s.k)
        return drafts, any(not s.samples for s, _ in scheduled)

    def _forward_item(self, s: ScheduledSeq, draft: Draft | None) -> ForwardItem:
        seq = s.seq
        feed = seq.tokens[seq.num_computed : seq.num_computed + s.num_feed]
        draft_ids = draft.token_ids if draft else []
        num_logits = len(draft_ids) + 1 if s.samples else 0
        return ForwardItem(self.blocks.block_table(seq.seq_id), seq.num_computed, feed + draft_ids, num_logits)

    def _fail(self, seq: Sequence, why: str) -> RequestOutput:
        """End one sequence alone (ABORT with `error`), its KV blocks freed."""
        self.abort(seq.seq_id)
        out = RequestOutput(seq.seq_id, [], FinishReason.ABORT, prompt_len=len(seq.prompt_ids), error=why)
        out.output_ids = seq.output_ids
        return out

    def _commit(
        self, s: ScheduledSeq, draft: Draft | None, tokens: list[int], logprobs: list[TokenLogprob] | None = None
    ) -> RequestOutput:
        seq = s.seq
        k = len(draft.token_ids) if draft else 0
        num_accepted = len(tokens) - 1
        # K/V were written for the fed tokens and all drafts; only the accepted drafts' stay valid.
        seq.num_computed += s.num_feed + num_accepted
        self._update_stats(seq, k, num_accepted, len(tokens))
        new_tokens = []
        for token in tokens:
            seq.tokens.append(token)
            new_tokens.append(token)
            seq.finish_reason = self._finish_reason(seq, token)
            if seq.finish_reason is not None:
                break
        seq.num_computed = min(seq.num_computed, len(seq.tokens))
        out = RequestOutput(seq.seq_id, new_tokens, seq.finish_reason, k, num_accepted, len(seq.prompt_ids))
        out.num_cached_prompt = seq.num_cached_prompt or 0
        if logprobs is not None:
            out.logprobs = logprobs[: len(new_tokens)]
        if seq.is_finished:
            out.output_ids = seq.output_ids
            out.features = seq.features
            self.seqs.pop(seq.seq_id, None)
            self._release(seq)
        else:
            self._rollback_blocks(seq)
        return out

    def _update_stats(self, seq: Sequence, k: int, num_accepted: int, num_emitted: int) -> None:
        self.stats.sequence_steps += 1
        self.stats.emitted_tokens += num_emitted
        if k:
            seq.acceptance.update(k, num_accepted)
            self.stats.draft_rounds += 1
            self.stats.drafted_tokens += k
            self.stats.accepted_tokens += num_accepted
            seq.num_drafted += k
            seq.num_accepted += num_accepted

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return FinishReason.STOP
        if len(seq.output_ids) >= params.max_tokens or len(seq.tokens) >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _rollback_blocks(self, seq: Sequence) -> None:
        """Return the slots of rejected drafts; the next step reserves what it needs again."""
        if self.blocks.has_seq(seq.seq_id) and self.blocks.num_tokens(seq.seq_id) > seq.num_computed:
            self.blocks.rollback(seq.seq_id, seq.num_computed)

    def _release(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        if self.drafter is not None:
            self.drafter.release([seq.seq_id])
