"""The verifier's engine: one speculative step over every running sequence.

    schedule -> propose (one batched drafter call) -> score (one forward) -> verify -> commit

The core has no gRPC in it; the service drives `step()` from a worker thread.
"""

from __future__ import annotations

import itertools
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from shared.drafting import Draft, Drafter, DraftRequest, FeatureStore, SparseProbs
from shared.errors import InvalidRequestError, QueueFullError
from shared.grammar import GrammarCompiler, GrammarMatcher, mask_logits_
from shared.kv.block_manager import BlockManager
from shared.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprobs
from shared.model.runner import ForwardItem, ModelRunner
from shared.sampling import SamplingParams, logits_to_probs
from verifier_service.rejection_sampler import SparseDraftProbs, greedy_verify, rejection_sample
from verifier_service.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from verifier_service.seeded_verify import seeded_verify
from verifier_service.sequence import FinishReason, Sequence

# The engine's errors are the shared domain errors, so servicers map them in one place.
RequestError = InvalidRequestError
WARM_UP_TOKENS = 4  # generated per warm-up request: the prefill step, then speculative steps


@dataclass(frozen=True)
class EngineConfig:
    num_speculative_tokens: int = 4
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    max_waiting: int = 256
    # Draft only as far as it pays (see spec_policy.py); False drafts num_speculative_tokens always.
    adaptive_k: bool = True


@dataclass
class EngineStats:
    steps: int = 0
    sequence_steps: int = 0  # (sequence, step) pairs that sampled tokens
    draft_rounds: int = 0  # sequence steps that scored at least one draft token
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # sampled tokens: accepted + one recovered or bonus per sequence step
    stale_drafts: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per draft round: 1 + accepted / draft rounds."""
        return 1.0 + self.accepted_tokens / self.draft_rounds if self.draft_rounds else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


@dataclass(frozen=True)
class MaskTiming:
    """The grammar masks of one step (time.perf_counter values): computed in a worker thread from `start` to
    `end` while the target scored, and how long verification then `waited` for them."""

    start: float
    end: float
    waited: float
    rows: int  # scored positions masked


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
        k = config.num_speculative_tokens if drafter is not None else 0
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
                num_speculative_tokens=k,
                adaptive_k=config.adaptive_k,
            ),
            blocks,
        )
        self.seqs: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self._arrivals = itertools.count()
        # Telemetry hooks (verifier_service/telemetry.py), called from step(); None costs nothing.
        self.observer: StepObserver | None = None
        # Keep every sequence's target hidden states even without a drafter that reads them (the trainer).
        self.capture_features = False
        # Structured output (shared/grammar.py): None until enable_structured_output gives a tokenizer.
        self.grammar: GrammarCompiler | None = None
        self._mask_worker: ThreadPoolExecutor | None = None
        self.last_masks: MaskTiming | None = None  # of the last step that masked, for telemetry

    def enable_structured_output(self, tokenizer) -> None:
        """Accept requests with a format; `tokenizer` is the target's (the grammar is matched on its tokens)."""
        self.grammar = GrammarCompiler(tokenizer, self.runner.vocab_size, tuple(self.eos_token_ids))

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

    def step(self) -> list[RequestOutput]:
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
        masks = self._start_masks(batch, drafts)  # computed while the target scores
        items = [self._forward_item(s, drafts.get(s.seq.seq_id)) for s in batch]
        hidden: list[torch.Tensor | None]
        if self.keeps_features:
            logits, hidden_states = self.runner.forward_with_hidden(items)  # per sequence [num_tokens, hidden]
            hidden = list(hidden_states)
        else:
            logits, hidden = self.runner.forward(items), [None] * len(items)  # logits: [num_logits, vocab]
        scored = time.perf_counter()
        if not ingesting:  # a prompt's early ingest would count as drafting cost
            self._measure_costs(batch, drafts, proposed - start, scored - proposed)
        sampling = [(s, drafts.get(s.seq.seq_id), lg) for s, lg in zip(batch, logits, strict=True) if s.samples]
        emitted = self._verify(sampling, self._finish_masks(masks))
        verified = time.perf_counter()
        self.stats.steps += 1
        outputs = []
        sampled_hidden = []
        for s, h in zip(batch, hidden, strict=True):
            if s.samples:
                sampled_hidden.append(h)
                continue
            self._keep_features(s.seq, h, s.num_feed)
            s.seq.num_computed += s.num_feed  # a prefill chunk that is not the last one
            self._rollback_blocks(s.seq)
        for (s, draft, lg), tokens, h in zip(sampling, emitted, sampled_hidden, strict=True):
            if isinstance(tokens, str):
                outputs.append(self._fail(s.seq, tokens))
                continue
            self._keep_features(s.seq, h, s.num_feed + len(tokens) - 1)  # fed tokens and accepted drafts
            # Token j of a row was decided at its scored position j (accepted drafts, then the recovered or
            # bonus token), so the raw logits of this one scoring pass give every token's log-probability.
            num_top = s.seq.num_logprobs
            logprobs = token_logprobs(lg, tokens, num_top) if num_top is not None else None
            outputs.append(self._commit(s, draft, tokens, logprobs))
        outputs = [self._advance_grammar(out) for out in outputs]
        if observer is not None:
            observer.step_finished(outputs, start, proposed, scored, verified)
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
                drafts[draft.seq_id] = _trim(draft, s.k)
        return drafts, any(not s.samples for s, _ in scheduled)

    def _start_masks(self, batch: list[ScheduledSeq], drafts: dict[str, Draft]) -> Future | None:
        """Per constrained sequence that samples this step: the tokens its format allows at each scored position
        along its draft ([k + 1, words] bitmask), computed in a worker thread. None when no sequence has one."""
        rows = [(s.seq, drafts.get(s.seq.seq_id)) for s in batch if s.samples and s.seq.grammar is not None]
        if not rows:
            return None
        if self._mask_worker is None:
            self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return self._mask_worker.submit(self._compute_masks, rows)

    def _compute_masks(self, rows: list[tuple[Sequence, Draft | None]]) -> tuple[dict[str, torch.Tensor], float, float]:
        start = time.perf_counter()
        assert self.grammar is not None
        masks = {}
        for seq, draft in rows:
            draft_ids = draft.token_ids if draft is not None else []
            bitmask = self.grammar.new_bitmask(len(draft_ids) + 1)  # [k + 1, words]
            assert seq.grammar is not None
            seq.grammar.fill_masks(draft_ids, bitmask)
            masks[seq.seq_id] = bitmask
        return masks, start, time.perf_counter()

    def _finish_masks(self, job: Future | None) -> dict[str, torch.Tensor]:
        if job is None:
            return {}
        wait_start = time.perf_counter()
        masks, start, end = job.result()
        rows = sum(m.shape[0] for m in masks.values())
        self.last_masks = MaskTiming(start, end, time.perf_counter() - wait_start, rows)
        return masks

    def _advance_grammar(self, out: RequestOutput) -> RequestOutput:
        """Move a constrained sequence's matcher past its emitted tokens. The masks allowed only such tokens, so
        a mismatch is an internal fault: that request alone ends."""
        seq = self.seqs.get(out.request_id)
        if seq is None or seq.grammar is None or out.finished:
            return out
        try:
            seq.grammar.consume(out.new_token_ids)
        except InvalidRequestError as err:
            return self._fail(seq, f"structured output: {err}")
        return out

    def _forward_item(self, s: ScheduledSeq, draft: Draft | None) -> ForwardItem:
        seq = s.seq
        feed = seq.tokens[seq.num_computed : seq.num_computed + s.num_feed]
        draft_ids = draft.token_ids if draft else []
        num_logits = len(draft_ids) + 1 if s.samples else 0
        return ForwardItem(self.blocks.block_table(seq.seq_id), seq.num_computed, feed + draft_ids, num_logits)

    def _verify(
        self, rows: list[tuple[ScheduledSeq, Draft | None, torch.Tensor]], masks: dict[str, torch.Tensor]
    ) -> list[list[int] | str]:
        """Per row: the emitted tokens, or why the row failed (its numbers went bad: that row alone ends).
        `masks`: the allowed tokens of constrained rows at their scored positions, applied to the logits before
        temperature and truncation, so every rule below samples the plain decoder's masked distribution; a
        drafted token the format forbids has target probability 0 and is rejected.

        Tensors stay on the model's device; the host reads the bad-row flags and the emitted ids. Greedy rows
        are verified by comparing ids, sampled rows by rejection sampling over sparse or one-hot drafts (no
        vocabulary-wide draft tensors), seeded rows by their seeded tokens."""
        if not rows:
            return []
        params = [s.seq.params for s, _, _ in rows]
        num_drafts = torch.tensor([lg.shape[0] - 1 for _, _, lg in rows], dtype=torch.int64)  # [batch] CPU
        k_max = int(num_drafts.max())
        draft_ids = torch.zeros(len(rows), k_max, dtype=torch.int64)  # [batch, k_max] CPU
        for i, (_, draft, _) in enumerate(rows):
            if draft is not None and num_drafts[i]:
                draft_ids[i, : int(num_drafts[i])] = torch.tensor(draft.token_ids, dtype=torch.int64)
        flat_logits = torch.cat([lg for _, _, lg in rows])  # [sum(k_i + 1), vocab]: no padding rows scored
        if masks:  # a copy: the raw logits stay as they were for logprobs
            starts = (torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)).tolist()
            for i, (s, _, _) in enumerate(rows):
                bitmask = masks.get(s.seq.seq_id)
                if bitmask is not None:
                    mask_logits_(flat_logits[starts[i] : starts[i] + bitmask.shape[0]], bitmask)
        flat_probs = self._target_probs(flat_logits, params, num_drafts + 1)
        target_logits = _pad_rows(flat_logits, num_drafts + 1, k_max + 1)  # [batch, k_max + 1, vocab]
        target_probs = _pad_rows(flat_probs, num_drafts + 1, k_max + 1)  # [batch, k_max + 1, vocab]
        failures = _bad_rows(target_logits, target_probs, num_drafts)
        emitted: list[list[int] | str] = [failures.get(i, "") for i in range(len(rows))]
        live = [i for i in range(len(rows)) if i not in failures]
        greedy = [i for i in live if params[i].is_greedy]
        seeded = [i for i in live if params[i].is_seeded]
        sampled = [i for i in live if not params[i].is_greedy and not params[i].is_seeded]
        # Seeded rows: the token at each output position is fixed by (seed, position, target_probs).
        for i in seeded:
            seq, k = rows[i][0].seq, int(num_drafts[i])
            seed = seq.params.seed
            assert seed is not None
            emitted[i] = seeded_verify(target_probs[i, : k + 1], draft_ids[i, :k].tolist(), seed, seq.output_position)
        results = []
        if greedy:
            index = torch.tensor(greedy)
            argmax = target_logits[index.to(target_logits.device)].argmax(dim=-1)  # [g, k_max + 1]
            results.append((greedy, greedy_verify(argmax, draft_ids[index], num_drafts[index])))
        if sampled:
            index = torch.tensor(sampled)
            result = rejection_sample(
                target_probs[index.to(target_probs.device)], draft_ids[index],
                _sparse_draft_probs([rows[i][1] for i in sampled], draft_ids[index], self.runner.vocab_size),
                num_drafts[index], [rows[i][0].seq.generator for i in sampled], check_mass=False,
            )  # fmt: skip
            results.append((sampled, result))
        if results:  # one read of every emitted id
            tokens = torch.cat([r.output_token_ids for _, r in results]).tolist()
            for i, row_tokens in zip([i for group, _ in results for i in group], tokens, strict=True):
                emitted[i] = row_tokens[: row_tokens.index(-1)] if -1 in row_tokens else row_tokens
        return emitted

    def _fail(self, seq: Sequence, why: str) -> RequestOutput:
        """End one sequence alone (ABORT with `error`), its KV blocks freed."""
        self.abort(seq.seq_id)
        out = RequestOutput(seq.seq_id, [], FinishReason.ABORT, prompt_len=len(seq.prompt_ids), error=why)
        out.output_ids = seq.output_ids
        return out

    @staticmethod
    def _target_probs(
        flat_logits: torch.Tensor, params: list[SamplingParams], counts: torch.Tensor
    ) -> torch.Tensor:  # [sum(counts), vocab]
        """The plain decoder's distribution at every scored position; `counts`: scored positions per row."""
        per_position = {
            name: torch.tensor([getattr(p, name) for p in params], dtype=dtype).repeat_interleave(counts)
            for name, dtype in (
                ("temperature", torch.float32),
                ("top_k", torch.int64),
                ("top_p", torch.float32),
                ("min_p", torch.float32),
            )
        }
        return logits_to_probs(flat_logits, **per_position)

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


def _bad_rows(
    target_logits: torch.Tensor,  # [batch, k_max + 1, vocab]
    target_probs: torch.Tensor,  # [batch, k_max + 1, vocab]
    num_drafts: torch.Tensor,  # [batch]
) -> dict[int, str]:
    """Rows whose scored positions have NaN or +inf logits, or probabilities that are not a distribution.
    Checked on the logits too: argmax over NaN still yields a one-hot 'greedy' row."""
    failures = {}
    # NaN and +inf survive a sum (-inf logits are legitimate masks); two reductions, no [.., vocab] masks.
    logit_sums = target_logits.sum(dim=-1)  # [batch, k_max + 1]
    mass = target_probs.sum(dim=-1, dtype=torch.float64)  # [batch, k_max + 1]
    bad = torch.isnan(logit_sums) | (logit_sums == float("inf")) | ~torch.isfinite(mass) | ~(mass > 0)
    for i in bad.any(dim=-1).nonzero().flatten().tolist():
        positions = bad[i, : int(num_drafts[i]) + 1].nonzero().flatten().tolist()
        if positions:
            failures[i] = (
                f"the model's probabilities for this request were not finite at {len(positions)} scored "
                "position(s); the request was ended, other requests are unaffected"
            )
    return failures


def _pad_rows(flat: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """[sum(counts), vocab] -> [len(counts), width, vocab], each row's positions first, zeros after."""
    if bool((counts == width).all()):
        return flat.view(len(counts), width, flat.shape[-1])
    padded = flat.new_zeros(len(counts) * width, flat.shape[-1])
    index = torch.cat([torch.arange(n) + i * width for i, n in enumerate(counts.tolist())])
    padded[index.to(flat.device)] = flat
    return padded.view(len(counts), width, flat.shape[-1])


def _sparse_draft_probs(drafts: list[Draft | None], draft_ids: torch.Tensor, vocab: int) -> SparseDraftProbs | None:
    """The rows' draft distributions as one padded sparse batch [batch, k_max, n] (CPU, checked), or None when
    every row's drafts are one-hot. A one-hot row is its drafted id with probability 1."""
    supports = [d.probs for d in drafts if d is not None and d.probs is not None]
    if not supports:
        return None
    batch, k_max = draft_ids.shape
    n = max(p.token_ids.shape[-1] for p in supports)
    ids = torch.zeros(batch, k_max, n, dtype=torch.int64)
    probs = torch.zeros(batch, k_max, n, dtype=torch.float32)
    ids[:, :, 0] = draft_ids
    probs[:, :, 0] = 1.0
    for i, draft in enumerate(drafts):
        if draft is not None and draft.probs is not None:
            k, width = draft.probs.token_ids.shape
            ids[i, :k, :width] = draft.probs.token_ids
            probs[i, :k, :width] = draft.probs.probs
            probs[i, :k, width:] = 0.0
    sparse = SparseDraftProbs(ids, probs)
    sparse.check(vocab)
    return sparse


def _trim(draft: Draft, k: int) -> Draft:
    """A drafter may propose fewer tokens than asked, never more: extra ones are cut with their probs."""
    if len(draft.token_ids) <= k:
        return draft
    probs = draft.probs
    if probs is not None:
        probs = SparseProbs(probs.token_ids[:k], probs.probs[:k])
    return Draft(draft.seq_id, draft.committed_len, draft.token_ids[:k], probs)
