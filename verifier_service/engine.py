"""The verifier's engine: one speculative step over every running sequence.

    schedule -> propose (one batched drafter call) -> score (one forward) -> verify -> commit

The core has no gRPC in it; the service drives `step()` from a worker thread.

A drafter that can be asked without waiting (`send` / `collect`: the remote proposer) is asked early: the next
step's propose request leaves as soon as this step's tokens are committed, before their logprobs, and before
the service streams and records them, so the proposer drafts while the verifier finishes the step; the next
step's propose phase then only collects the drafts (early_ask.py).
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from shared.drafting import FEATURE_WINDOW, Draft, Drafter, DraftRequest, FeatureStore
from shared.errors import InvalidRequestError, QueueFullError
from shared.grammar import GrammarCompiler, GrammarMatcher
from shared.kv.block_manager import BlockManager
from shared.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprobs
from shared.model.attention import tree_of_parents
from shared.model.runner import FINAL_LAYER, ForwardItem, ModelRunner
from shared.sampling import SamplingParams
from verifier_service import grammar_masks
from verifier_service.calibration import calibrate
from verifier_service.config import EngineConfig
from verifier_service.early_ask import EarlyAsk, EarlyAskStats
from verifier_service.grammar_masks import GrammarMasks, MaskTiming
from verifier_service.scheduler import ScheduledSeq, Scheduler
from verifier_service.sequence import FinishReason, Sequence
from verifier_service.spec_policy import Plan
from verifier_service.step_times import StepCost
from verifier_service.verify import ScoredRow, Verdict, trim, verify

# The engine's errors are the shared domain errors, so servicers map them in one place.
RequestError = InvalidRequestError
log = logging.getLogger("specdec.verifier.engine")
RESYNC_BURST = 3  # whole-history resends a sequence may ask for in a row ...
RESYNC_REFILL_TOKENS = 64  # ... and one more per this many tokens committed since
WARM_UP_TOKENS = 4  # generated per warm-up request: the prefill step, then speculative steps
FEATURE_SLAB_ROWS = 64  # a sequence's features are copied into slabs of this many rows (147 KB at width 576, fp32)


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
    resyncs_refused: int = 0  # sequences turned to k = 0: their proposer asked for their history too often


@dataclass(frozen=True)
class UnfinishedStep:
    """A decode step whose whole time is known only when the next one starts."""

    batch: int
    depth: int  # its deepest draft request (0: plain decoding)
    verified: float
    predicted: StepCost | None  # what its parts' medians say it costs (None: some never measured)
    realised: StepCost  # as it ran, but for its rest
    catch_up: bool  # its propose call carried more than one step's tokens
    probe: bool  # the policy ran it to learn, not because it expected it to pay


class StepObserver(Protocol):
    """Sees each step: its batch, then the end of the propose phase, then its outputs and phase times
    (time.perf_counter values: start, end of propose, end of score, end of verify)."""

    def step_started(self, batch: list[ScheduledSeq]) -> None: ...

    def propose_finished(self, proposed: float) -> None: ...

    def asking_early(self, num_seqs: int) -> Any:
        """Just before the next step's drafts are asked for (after this step committed); returns a token for
        `asked_early`, which follows the send."""

    def asked_early(self, token: Any) -> None: ...

    def step_finished(
        self, outputs: list[RequestOutput], start: float, proposed: float, scored: float, verified: float
    ) -> None: ...


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    num_drafted: int = 0  # draft tokens scored (a tree's nodes)
    num_accepted: int = 0  # accepted drafts that bought tokens: emitted - 1 at most (none past the finishing token)
    prompt_len: int = 0
    output_ids: list[int] = field(default_factory=list)
    draft_depth: int = 0  # draft positions: a chain's length, a tree's depth (per-position acceptance counts these)
    tree: bool = False  # the draft was a token tree
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
        self._early: EarlyAsk | None = None  # the next step's drafts, asked for when this step committed
        # The last decode step, whose rest (from its verification to the next step's start) and whole time are
        # known when the next step starts (spec_policy.py). None when it left nothing running (the loop may idle).
        self._unfinished_step: UnfinishedStep | None = None
        self.early_stats = EarlyAskStats()

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
        grammar: GrammarMatcher | None = None,
    ) -> None:
        """`max_draft_tokens` lowers this request's k below the engine's (0: no speculation for it).
        `output_offset`: output tokens already emitted at the end of `prompt_ids` (a resumed request), where
        seeded sampling's output positions start. `num_logprobs`: None, or report each emitted token's
        log-probability with that many top alternatives (shared/logprobs.py). `tenant`: the API key's name
        ('' = anonymous), passed to the drafter. `grammar`: the request's matcher from `build_grammar`, built
        beforehand off the engine's loop (EngineLoop does); without it a format is compiled here."""
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
        seq.acceptance = self.scheduler.policy.new_estimate(params.is_greedy)
        if params.structured_output is not None:
            seq.grammar = grammar or self.build_grammar(params, prompt_ids, output_offset)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def build_grammar(self, params: SamplingParams, prompt_ids: list[int], output_offset: int = 0) -> GrammarMatcher:
        """The matcher of a request's format, advanced past a resumed request's output. Thread-safe and
        touches no engine state: EngineLoop runs it in a worker thread while the engine steps."""
        assert params.structured_output is not None
        if self.grammar is None:
            raise RequestError("structured output needs the target's tokenizer, which this verifier did not load")
        if not 0 <= output_offset <= len(prompt_ids):
            raise RequestError(f"output_offset must lie in [0, {len(prompt_ids)}] (the prompt), got {output_offset}")
        matcher = self.grammar.matcher(params.structured_output)
        # A resumed request's emitted tokens end its prompt: the format continues after them.
        matcher.consume(prompt_ids[len(prompt_ids) - output_offset :])
        return matcher

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
        calibrate(self)  # the policy's scoring times, per batch size and draft length
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
            self._unfinished_step = None
            return []
        observer = self.observer
        if observer is not None:
            observer.step_started(batch)
        start = time.perf_counter()
        self._record_rest(start)
        drafts, catch_up = self._propose(batch)  # positions caught up beyond a step's (0: none)
        proposed = time.perf_counter()
        if observer is not None:
            observer.propose_finished(proposed)
        sampling = [s for s in batch if s.samples]
        masks = self._masks.start([(s.seq, drafts.get(s.seq.seq_id)) for s in sampling]) if self._masks else None
        logits, hidden = self._score(batch, drafts)  # the masks are computed meanwhile
        scored = time.perf_counter()
        rows = [
            ScoredRow(s.seq, drafts.get(s.seq.seq_id), lg) for s, lg in zip(batch, logits, strict=True) if s.samples
        ]
        emitted = verify(rows, self._masks.finish(masks) if self._masks else {}, self.runner.vocab_size)
        verified = time.perf_counter()
        self._measure_costs(batch, drafts, (start, proposed, verified), catch_up, emitted)
        self.stats.steps += 1
        outputs, logprobs_due = self._commit_step(batch, rows, emitted, hidden)
        self._ask_early()
        for out, scored_logits, tokens, num_top in logprobs_due:
            out.logprobs = token_logprobs(scored_logits, tokens, num_top)[: len(out.new_token_ids)]
        if observer is not None:
            observer.step_finished(outputs, start, proposed, scored, verified)
        if not self.scheduler.running:
            self._unfinished_step = None
        return outputs

    def _record_rest(self, start: float) -> None:
        """The previous decode step's time beyond scoring and proposing, up to this step's start: what the policy
        cannot see from inside a step (commit, streaming by the serving loop, the proposer's work beside it)."""
        step, self._unfinished_step = self._unfinished_step, None
        if step is not None:
            policy = self.scheduler.policy
            policy.record_rest(step.batch, step.depth, start - step.verified)
            realised = replace(step.realised, rest=start - step.verified)
            policy.record_outcome(step.batch, step.depth, step.predicted, realised, step.catch_up, step.probe)

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
        verdicts: list[Verdict | str],
        hidden: list[torch.Tensor | None],
    ) -> tuple[list[RequestOutput], list[tuple[RequestOutput, torch.Tensor, list[int], int]]]:
        """The step's outputs, and the logprobs still to compute (output, scored logits, tokens, top n): after the
        next step's drafts were asked for."""
        sampled_hidden = []
        for s, h in zip(batch, hidden, strict=True):
            if s.samples:
                sampled_hidden.append(h)
                continue
            self._keep_features(s.seq, h, list(range(s.num_feed)))
            s.seq.num_computed += s.num_feed  # a prefill chunk that is not the last one
            self._rollback_blocks(s.seq)
        outputs, logprobs_due = [], []
        for s, row, verdict, h in zip([s for s in batch if s.samples], rows, verdicts, sampled_hidden, strict=True):
            if isinstance(verdict, str):
                outputs.append(self._fail(s.seq, verdict))
                continue
            # Fed tokens and accepted drafts (a tree's path, moved onto consecutive slots) computed for good.
            self._keep_features(s.seq, h, [*range(s.num_feed), *(s.num_feed + node for node in verdict.path)])
            if row.draft is not None and row.draft.is_tree:
                self._move_path(s, verdict.path)
            # Token j of a row was decided at the scored position of its parent (the root's for the first; a
            # chain's position j), so the raw logits of this one scoring pass give every token's log-probability.
            num_top = s.seq.num_logprobs
            out = self._commit(s, row.draft, verdict.tokens)
            if num_top is not None:
                scored_at = [0, *(node + 1 for node in verdict.path)]
                logprobs_due.append((out, row.logits[scored_at], verdict.tokens, num_top))
            why = grammar_masks.advance(s.seq, out.new_token_ids) if not out.finished else None
            outputs.append(out if why is None else self._fail(s.seq, why))
        return outputs, logprobs_due

    def _move_path(self, s: ScheduledSeq, path: list[int]) -> None:
        """A tree's nodes were written at slots root + 1 + node; the accepted path's K/V go to root + 1 + depth,
        the slots plain decoding would have written (ascending: a destination is never a later source)."""
        root = s.seq.num_computed + s.num_feed - 1
        table, size = self.blocks.block_table(s.seq.seq_id), self.blocks.block_size

        def slot(offset: int) -> int:
            return table[offset // size] * size + offset % size

        pairs = [(slot(root + 1 + node), slot(root + 1 + depth)) for depth, node in enumerate(path) if node != depth]
        self.runner.cache.copy_slots(pairs)

    @staticmethod
    def _keep_features(seq: Sequence, hidden: torch.Tensor | None, rows: list[int]) -> None:
        """Features of the positions this step computed for good (`rows` of the step's hidden states, in order);
        none for a sequence that never drafts (max_draft_tokens = 0, or a resync refused)."""
        if seq.max_draft_tokens == 0:
            seq.features = seq.feature_slab = None  # it never drafts: nobody reads them
            return
        if hidden is None:
            return
        if seq.features is None:
            seq.features = FeatureStore()
        # A copy: a view would keep the step's whole batch. Rows 0..n-1 (a plain step, a prefill chunk, a chain's
        # accepted prefix) are one slice: an index tensor per sequence and step cost about twice that (0.046
        # against 0.025 ms for 8 sequences' one row each, bf16).
        if rows == list(range(len(rows))):
            assert len(rows) <= hidden.shape[0], (len(rows), hidden.shape)  # as index_select would have refused
            new = hidden[: len(rows)]
        else:
            new = hidden.index_select(0, torch.tensor(rows, device=hidden.device))
        seq.features.add(seq.num_computed, _in_slab(seq, new))

    def _measure_costs(
        self,
        batch: list[ScheduledSeq],
        drafts: dict[str, Draft],
        times: tuple[float, float, float],
        catch_up: int,
        verdicts: list[Verdict | str],
    ) -> None:
        """The policy's times, from decode steps only (a prefill chunk is not what a draft token costs): the
        propose call, scoring + verifying, and (at the next step's start) the rest and the whole step, with the
        tokens it emitted against what the policy expected of it."""
        if not all(s.samples and s.num_feed == 1 for s in batch):
            return
        start, proposed, verified = times
        policy = self.scheduler.policy
        propose_s, score_s = proposed - start, verified - proposed
        scored = sum(len(d.token_ids) for d in drafts.values())  # draft tokens scored: fewer may come than asked
        policy.record_step(len(batch), len(batch) + scored, score_s)
        asked = [s for s in batch if s.k > 0]
        depth = max((s.k for s in asked), default=0)
        tree = any(s.tree_nodes for s in asked)
        if asked and not catch_up:
            policy.record_propose(len(batch), depth, tree, propose_s)
        elif asked:
            policy.record_catch_up(len(batch), depth, tree, propose_s, catch_up)
        # After recording: the medians then include this step's own parts (a size measured for the first time is
        # what it took, not a guess), and a step costs more than they say by what they leave out: a slow moment,
        # a catch-up.
        predicted = policy.predict([(s.seq.acceptance, Plan(s.k, s.tree_nodes)) for s in batch], scored)
        if predicted is not None and asked and catch_up:  # as the plan expected it: the catch-up apart
            predicted = replace(predicted, propose=predicted.propose + policy.catch_up_seconds(catch_up))
        emitted = sum(len(v.tokens) for v in verdicts if not isinstance(v, str))
        realised = StepCost(emitted, score_s, propose_s, 0.0)
        probe = policy.probed and depth > 0  # a probe whose drafts the scheduler cut (memory, budget) ran plainly
        self._unfinished_step = UnfinishedStep(len(batch), depth, verified, predicted, realised, catch_up > 0, probe)

    def _propose(self, batch: list[ScheduledSeq]) -> tuple[dict[str, Draft], int]:
        """Drafts of the sequences that sample this step with k > 0. A prompt being prefilled in chunks is
        also sent, its chunk's tokens with k = 0, so the drafter ingests it alongside the target instead of
        catching up on all of it in the first draft round (to a remote proposer without waiting, and not to one
        sharing our cores, see below). A drafter that can be told without waiting
        (`notify`: the remote proposer) also follows the sequences that decode with k = 0, off the critical path,
        k tokens at a time, so that a later probe carries no stale catch-up (no more than a drafting step may
        commit), unless it says not to (`follows_plain`: a proposer sharing this verifier's CPU cores, where that
        work slows every plain step; a draft request then carries the catch-up). Returns (drafts, the positions
        of the requests that carried a catch-up: a prompt, or more than one step's tokens; 0 where none did, and
        otherwise the call's time is not what a drafting round costs)."""
        if self.drafter is None:
            return {}, 0
        early, self._early = self._early, None
        # Followed sequences are sent k tokens at a time: every message costs the proposer CPU (co-located at 8
        # clients it took ~20% of a core at plain steps, beside a verifier that wants both), and a probe then
        # still carries at most what one step commits, so it counts as a drafting round.
        follow_every = max(1, self.config.num_speculative_tokens)
        remote = hasattr(self.drafter, "notify")
        follows = remote and getattr(self.drafter, "follows_plain", True)
        drafting, following, asked_early = [], [], []
        for s in batch:
            seq = s.seq
            committed = len(seq.tokens) if s.samples else seq.num_computed + s.num_feed
            if early is not None and early.answers(s):
                asked_early.append(s)
            elif s.samples and s.k > 0:
                drafting.append((s, self._draft_request(s, committed)))
            elif not s.samples and committed > seq.num_sent_to_proposer:
                # A prompt's chunk: an in-process drafter ingests it now; a remote proposer is told without waiting
                # (the verifier waited for it: at 8 clients it added 31 ms to the time to first token), and one on
                # our own cores not at all: a request that never drafts (at 8 clients, most) costs it nothing, and
                # the first draft request carries the prompt, charged as a catch-up by the policy.
                if not remote:
                    drafting.append((s, self._draft_request(s, committed)))
                elif follows:
                    following.append(self._draft_request(s, committed))
            elif s.samples and committed - seq.num_sent_to_proposer >= follow_every and follows:
                following.append(self._draft_request(s, committed))
        if following:
            self.drafter.notify(following)  # type: ignore[attr-defined]
        answered = []
        if asked_early:
            assert early is not None
            pending = self.drafter.send([r for _, r in drafting]) if drafting else None  # type: ignore[attr-defined]
            answered = early.drafts_for(asked_early, self.drafter)
            self.early_stats.used += len(asked_early)
            answered += zip(drafting, self.drafter.collect(pending) if pending else [], strict=True)  # type: ignore[attr-defined]
        elif drafting:
            answered = list(zip(drafting, self.drafter.propose([r for _, r in drafting]), strict=True))
        if not answered:
            return {}, 0
        drafts = {}
        for (s, _), draft in answered:
            if draft.needs_resync:
                self._resync(s.seq, charged=not draft.unreachable)
            if not s.samples:
                continue  # an ingest: nothing to verify
            if draft.committed_len != len(s.seq.tokens) or draft.seq_id != s.seq.seq_id:
                self.stats.stale_drafts += 1  # built on another prefix: never applied
                continue
            if draft.token_ids:
                drafts[draft.seq_id] = trim(draft, s.draft_slots)
        # The prompt's features go with the first decode step's request (the prefill computed them): a catch-up
        # too, though it carries one new token.
        sent = [(s, max(len(r.new_token_ids), _rows(r.features))) for (s, r), _ in answered]
        catch_up = sum(n for s, n in sent if not s.samples or n > self.config.step_tokens)
        return drafts, catch_up

    def _ask_early(self) -> None:
        """Send the next step's propose request now (a drafter with `send`): the plans the next schedule will
        keep, for every sequence that will decode and draft, but not a call that would carry a catch-up. A prompt
        that arrives before the next step would wait for that call, and once it is sent the scheduler no longer
        sees the lag that makes it plan around new prompts (scheduler.py): at 8 clients through the gateway
        (co-located, Zen 4 host) a burst's first request, prefilled alone, was asked early with its prompt and
        drafted a tree while the other seven prompts waited (time to first token 196 ms against target-only's 163,
        median of 12 rounds)."""
        if (
            not hasattr(self.drafter, "send")
            or not getattr(self.drafter, "connected", True)
            or not self.scheduler.running
        ):
            return
        plans = self.scheduler.plan_ahead()
        asks = []
        for seq in self.scheduler.running:
            plan = plans.get(seq.seq_id)
            if plan is not None and plan.k > 0 and seq.num_uncomputed == 1 and not self._catches_up(seq):
                asks.append(self._request(seq, len(seq.tokens), plan.k, plan.tree_nodes, plan.min_node_prob))
        if not asks:
            return
        self.early_stats.asked += len(asks)
        observer = self.observer
        token = observer.asking_early(len(asks)) if observer is not None else None
        try:
            self._early = EarlyAsk({r.seq_id: r for r in asks}, self.drafter.send(asks))  # type: ignore[union-attr]
        finally:
            if observer is not None:
                observer.asked_early(token)

    def _catches_up(self, seq: Sequence) -> bool:
        """Whether the sequence's next propose call would carry a catch-up: more than a step's tokens, or its whole
        history to a proposer stream that has not seen it (a reconnect: `_request` sends it whole)."""
        return bool(self.scheduler.lag(seq)) or seq.proposer_stream != self._stream

    @property
    def _stream(self) -> int:
        """The drafter's proposer stream now (RemoteProposer.connections; 0 for a drafter in this process)."""
        return getattr(self.drafter, "connections", 0)

    def _draft_request(self, s: ScheduledSeq, committed: int) -> DraftRequest:
        """What the drafter is told of a sequence: the tokens (and features) it has not seen, and this step's
        draft shape (k = 0 for a prompt chunk or a sequence that does not draft)."""
        k, nodes = (s.k, s.tree_nodes) if s.samples else (0, 0)
        return self._request(s.seq, committed, k, nodes, s.min_node_prob)

    def _request(self, seq: Sequence, committed: int, k: int, nodes: int, min_node_prob: float) -> DraftRequest:
        stream = self._stream
        if seq.proposer_stream != stream:
            # A new stream holds nothing of the sequence: send it whole now, uncharged, rather than have the
            # proposer ask (a resend charged to the sequence, and a step without drafts). Tokens counted as sent
            # while no stream was up (followed, asked early and not scheduled) were never seen either.
            seq.proposer_stream, seq.num_sent_to_proposer, seq.num_features_sent = stream, 0, 0
        new = seq.tokens[seq.num_sent_to_proposer : committed]
        feature_start, features = 0, None
        if seq.features is not None and self.keeps_features:
            feature_start, features = seq.features.since(seq.num_features_sent)
            seq.num_features_sent = seq.features.end
            seq.features.trim(seq.features.end - FEATURE_WINDOW)  # kept only for a resync: its recent part
        seq.num_sent_to_proposer = committed
        return DraftRequest(
            seq.seq_id,
            committed,
            new,
            k,
            seq.params,
            features,
            feature_start,
            seq.output_position,
            seq.tenant,
            nodes,
            min_node_prob,
        )

    def _resync(self, seq: Sequence, charged: bool = True) -> None:
        """The proposer lost this sequence's history: resend it whole (and its features) next time, at most
        RESYNC_BURST times in a row plus one per RESYNC_REFILL_TOKENS committed tokens. A proposer that asks on
        every step would otherwise have the verifier resend whole histories forever; past the budget the
        sequence decodes without speculation (k = 0, its own output unchanged). An unreachable proposer's
        resyncs are not `charged`: nothing is resent until it is back."""
        if charged:
            refill = (len(seq.tokens) - seq.resync_mark) / RESYNC_REFILL_TOKENS
            seq.resyncs_left = min(RESYNC_BURST, seq.resyncs_left + refill)
            seq.resync_mark = len(seq.tokens)
            if seq.resyncs_left < 1:
                if seq.max_draft_tokens != 0:
                    seq.max_draft_tokens = 0
                    self.stats.resyncs_refused += 1
                    log.warning("proposer asked for seq %s's history too often: k = 0 for it from now", seq.seq_id)
                return
            seq.resyncs_left -= 1
        seq.num_sent_to_proposer = 0
        seq.num_features_sent = 0

    def _forward_item(self, s: ScheduledSeq, draft: Draft | None) -> ForwardItem:
        seq = s.seq
        feed = seq.tokens[seq.num_computed : seq.num_computed + s.num_feed]
        draft_ids = draft.token_ids if draft else []
        num_logits = len(draft_ids) + 1 if s.samples else 0
        tokens = feed + draft_ids
        tree = None
        if draft is not None and draft.parents is not None:
            tree = tree_of_parents(seq.num_computed, len(tokens), draft.parents)
        return ForwardItem(self.blocks.block_table(seq.seq_id), seq.num_computed, tokens, num_logits, tree)

    def _fail(self, seq: Sequence, why: str) -> RequestOutput:
        """End one sequence alone (ABORT with `error`), its KV blocks freed."""
        self.abort(seq.seq_id)
        out = RequestOutput(seq.seq_id, [], FinishReason.ABORT, prompt_len=len(seq.prompt_ids), error=why)
        out.output_ids = seq.output_ids
        return out

    def _commit(self, s: ScheduledSeq, draft: Draft | None, tokens: list[int]) -> RequestOutput:
        seq = s.seq
        k = len(draft.token_ids) if draft else 0
        num_accepted = len(tokens) - 1
        # K/V were written for the fed tokens and all drafts; only the accepted drafts' stay valid.
        seq.num_computed += s.num_feed + num_accepted
        new_tokens = []
        for token in tokens:
            seq.tokens.append(token)
            new_tokens.append(token)
            seq.finish_reason = self._finish_reason(seq, token)
            if seq.finish_reason is not None:
                break
        seq.num_computed = min(seq.num_computed, len(seq.tokens))
        # Drafts accepted past an EOS, a stop token or the length limit are never emitted: the counts say what
        # speculation bought, the tokens beyond the one a step emits anyway (the policy still learns from the whole
        # verdict, which measured agreement all the same).
        num_gained = len(new_tokens) - 1  # new_tokens is a prefix of tokens: never more than num_accepted
        self._update_stats(seq, draft, tokens, s.k, num_gained)
        out = RequestOutput(seq.seq_id, new_tokens, seq.finish_reason, k, num_gained, len(seq.prompt_ids))
        out.draft_depth, out.tree = (draft.depth(), draft.is_tree) if draft is not None else (0, False)
        out.num_cached_prompt = seq.num_cached_prompt or 0
        if seq.is_finished:
            out.output_ids = seq.output_ids
            out.features = seq.features
            self.seqs.pop(seq.seq_id, None)
            self._release(seq)
        else:
            self._rollback_blocks(seq)
        return out

    def _update_stats(self, seq: Sequence, draft: Draft | None, tokens: list[int], depth: int, num_gained: int) -> None:
        """`tokens`: the accepted drafts, then the target's own token; `depth`: the draft depth asked for (a tree that
        stopped short of it, all accepted, fell short of what a tree that deep is expected to accept);
        `num_gained`: the tokens emitted beyond the step's one (a step that ended on a draft counts that draft as
        its own token), counted as accepted, so that emitted = accepted + sequence steps holds at every step."""
        num_accepted = len(tokens) - 1
        self.stats.sequence_steps += 1
        self.stats.emitted_tokens += num_gained + 1
        if draft is not None and draft.token_ids:
            k = len(draft.token_ids)  # scored draft tokens: a tree's nodes
            if draft.is_tree:  # a chain's verdict for alpha: the tree's best-guess path's
                drafted, accepted = draft.best_guess_verdict(tokens[:num_accepted])
                seq.acceptance.update_tree(max(depth, draft.depth()), num_accepted, drafted, accepted, k)
            else:
                drafted, accepted = k, num_accepted
                seq.acceptance.update(drafted, accepted)
            self.scheduler.policy.record_acceptance(seq.params.is_greedy, drafted, accepted)
            self.stats.draft_rounds += 1
            self.stats.drafted_tokens += k
            self.stats.accepted_tokens += num_gained
            seq.num_drafted += k
            seq.num_accepted += num_gained

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return FinishReason.STOP
        if seq.tokens_left <= 0 or len(seq.tokens) >= self.config.max_model_len:
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


def _in_slab(seq: Sequence, rows: torch.Tensor) -> torch.Tensor:  # rows [n, width] -> a copy of them [n, width]
    """A copy of a step's feature rows, in the sequence's slab of FEATURE_SLAB_ROWS rows (a new one when it is
    full). One small tensor per sequence and step, kept for the request's life, landed in the heap space the
    step's large buffers had just freed, so that the next step's came from fresh pages: at 8 clients the
    speculating stack's verifier took 7.6x target-only's page faults, 70% of them in the sampler's float64 CDF
    (docs/BENCHMARKS.md)."""
    n, width = rows.shape
    slab = seq.feature_slab
    if slab is None or seq.feature_slab_used + n > slab.shape[0] or slab.shape[1] != width or slab.dtype != rows.dtype:
        slab = seq.feature_slab = rows.new_empty(max(FEATURE_SLAB_ROWS, n), width)
        seq.feature_slab_used = 0
    kept = slab[seq.feature_slab_used : seq.feature_slab_used + n]
    kept.copy_(rows)
    seq.feature_slab_used += n
    return kept


def _rows(features: torch.Tensor | None) -> int:
    return 0 if features is None else features.shape[0]
