"""Engine benchmark: our engine (plain, draft model, EAGLE head, n-gram) against transformers `generate`.

    python -m specdec_bench.engine_bench [--quick] [--runs N] [--only c,d4,g4] [--out docs/BENCHMARKS.md]

One process loads each model once, then for batch 1 and batch 8, greedy and temperature 0.8, times every
configuration on the same prompts with the same forced number of new tokens, repeats that `--runs` times
(configurations rotate order from run to run), and reports medians. Every ratio is taken within one run
(side by side, so a busy machine slows both sides) and the median over runs is reported. Rows:

    (a) transformers generate, target alone (batch 8: one batched call, left padding)
    (b) transformers assisted generation with the draft (batch 1 only: HF supports nothing else)
    (c) our engine, k = 0
    (d) our engine with the draft model, k = 2 and k = 4
    (e) our engine with n-gram drafting, k = 4 and 8, on prompts that quote their input; (c) and (a) are run
        on those prompts too so that (e)/(c) is a fair ratio
    (d'), (e') the engine's default adaptive draft length with the draft model (k <= 4) and n-gram (k <= 8)
    (g) our engine with the EAGLE head (fed the target's hidden states), k = 4, and (g') adaptive k <= 6,
        general prompts; left out, with a message, when the head's folder (--eagle-head) does not exist
    seeded (d4s, es): (d) k = 4 and (e) k = 4 with a seed per request, i.e. coupled verification, at
        T = 0.8 only, beside the unseeded rows (rejection sampling) of the same run

It also measures the draft/target forward cost ratio c and compares (d)/(c) with the textbook prediction
(1 - a^(k+1)) / ((1 - a)(k c + 1)) (Leviathan et al. 2023), a = measured per-token acceptance rate; for the
EAGLE head the same ratio (one head draft position / one target step), and for every drafting row the
acceptance per draft position. `--only` runs a subset of the rows (their engine baseline (c) is added).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from shared.kv.block_manager import BlockManager
from shared.kv.cache import KVCache
from shared.malloc_tuning import tune_malloc
from shared.model.attention import SeqSpan, build_metadata
from shared.model.build import CacheConfig, default_num_blocks, make_runner
from shared.model.config import ModelArch
from shared.model.eagle import EagleHead
from shared.model.llama import LlamaModel
from shared.model.loader import (
    ModelSource,
    build_model,
    check_same_vocabulary,
    load_hf_config,
    load_hf_model,
    load_model,
    load_state_dict,
    load_tokenizer,
)
from shared.model.runner import ForwardItem
from shared.sampling import SamplingParams
from shared.settings import default_draft_model, default_eagle_head, default_target_model
from specdec_bench.memory import PeakRSS, max_rss
from specdec_bench.prompts import GENERAL_PROMPTS, QUOTING_PROMPTS
from specdec_bench.report import load_average, run_meta, write_report
from specdec_local.builder import build_engine, make_draft_model_drafter
from verifier_service.engine import Engine, EngineConfig

NUM_THREADS = 2
TEMPERATURES = (0.0, 0.8)
BATCH_SIZES = (1, 8)
MAX_MODEL_LEN = 512  # longest prompt (166 tokens) + 128 new + drafts fits; sizes the preallocated KV cache
MARK_START = "<!-- engine-bench:start -->"
MARK_END = "<!-- engine-bench:end -->"
MiB = 1024 * 1024


@dataclass(frozen=True)
class Config:
    key: str  # a, b, c, d2, d4, aq, cq, e
    label: str
    prompt_set: str  # "general" or "quoting"
    kind: str  # hf, hf-assisted, engine
    drafter: str | None = None  # engine: None, "draft", "eagle", "ngram"
    k: int = 0
    batch1_only: bool = False
    optional: bool = False  # run only with --hf-quoting
    adaptive: bool = False  # the engine's adaptive draft length (its default); the labelled k rows fix k
    # Requests carry a seed: coupled (Gumbel-max) verification instead of rejection sampling (docs/engine.md).
    # Sampled temperatures only; `unseeded` is the same drafter and k without seeds, for the side-by-side table.
    seeded: bool = False
    unseeded: str = ""
    tree_nodes: int = 0  # > 0: token trees of up to this many nodes, k deep

    @property
    def baseline_hf(self) -> str:
        return "a" if self.prompt_set == "general" else "aq"

    @property
    def baseline_engine(self) -> str:
        return "c" if self.prompt_set == "general" else "cq"


CONFIGS: tuple[Config, ...] = (
    Config("a", "(a) HF generate, target", "general", "hf"),
    Config("b", "(b) HF assisted, draft, 4 tokens", "general", "hf-assisted", batch1_only=True),
    Config("c", "(c) engine k=0", "general", "engine"),
    Config("d2", "(d) engine + draft, k=2", "general", "engine", "draft", 2),
    Config("d4", "(d) engine + draft, k=4", "general", "engine", "draft", 4),
    Config("da", "(d') engine + draft, adaptive k<=4 (engine default)", "general", "engine", "draft", 4, adaptive=True),
    Config("g4", "(g) engine + EAGLE head, k=4", "general", "engine", "eagle", 4),
    # Adaptive up to 6, not 4: a head position costs a fraction of a draft-model step, so the policy's best k
    # can be above 4; where it is not (low acceptance, costly scoring of extra tokens) the policy stays lower.
    Config(
        "ga",
        "(g') engine + EAGLE head, adaptive k<=6 (engine default policy)",
        "general",
        "engine",
        "eagle",
        6,
        adaptive=True,
    ),
    Config("gt", "(t) engine + EAGLE head, trees of 8 nodes, 4 deep", "general", "engine", "eagle", 4, tree_nodes=8),
    Config(
        "gat",
        "(t') engine + EAGLE head, adaptive k<=4 with trees of 8 nodes",
        "general",
        "engine",
        "eagle",
        4,
        adaptive=True,
        tree_nodes=8,
    ),
    Config("d4s", "(d) engine + draft, k=4, seeded", "general", "engine", "draft", 4, seeded=True, unseeded="d4"),
    Config("aq", "(a) HF generate, target [quoting]", "quoting", "hf", optional=True),
    Config("cq", "(c) engine k=0 [quoting]", "quoting", "engine"),
    Config("e", "(e) engine + n-gram, k=4 [quoting]", "quoting", "engine", "ngram", 4),
    Config(
        "es", "(e) engine + n-gram, k=4, seeded [quoting]", "quoting", "engine", "ngram", 4, seeded=True, unseeded="e"
    ),
    Config("e8", "(e) engine + n-gram, k=8 [quoting]", "quoting", "engine", "ngram", 8),
    Config(
        "ea",
        "(e') engine + n-gram, adaptive k<=8 (engine default) [quoting]",
        "quoting",
        "engine",
        "ngram",
        8,
        adaptive=True,
    ),
)
CONFIG_BY_KEY = {c.key: c for c in CONFIGS}


@dataclass
class Measurement:
    tokens: int
    seconds: float
    rss_delta: int  # bytes: peak RSS above the RSS at the start (engine build + generation)
    drafted: int = 0
    accepted: int = 0
    draft_rounds: int = 0
    outputs: list[list[int]] = field(default_factory=list)
    # per draft position i (0-based): steps that drafted at least i+1 tokens / accepted at least i+1
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass
class Models:
    tokenizer: object
    hf_target: object  # None when no transformers row is selected
    hf_draft: object
    target: tuple[LlamaModel, ModelArch]
    draft: tuple[LlamaModel, ModelArch]
    target_name: str
    draft_name: str
    eagle_head: EagleHead | None = None  # loaded once; each engine gets its own KV cache for it
    eagle_dir: str | None = None

    @property
    def pad_id(self) -> int:
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else self.target[1].eos_token_ids[0]


# ---- loading -------------------------------------------------------------------------------------------


def load_models(target_name: str, draft_name: str, hf: bool = True, eagle_dir: str | None = None) -> Models:
    """Each model once: ours from the (cached, de-quantised) weights, transformers' from the same tensors
    (only when `hf`: some transformers row is selected), the EAGLE head from `eagle_dir` (when given)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    source = ModelSource.resolve(target_name)
    hf_config = load_hf_config(source)
    state = load_state_dict(source)
    target_arch = ModelArch.from_hf_config(hf_config)
    target = (build_model(target_arch, state), target_arch)
    hf_target = hf_draft = None
    if hf:
        hf_target = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        hf_target.load_state_dict(state, strict=False)  # lm_head is tied to the embedding
        hf_target.tie_weights()
        hf_target.eval()
    del state
    draft = load_model(draft_name)
    check_same_vocabulary(target_arch, draft[1], target_name, draft_name)
    if hf:
        hf_draft = load_hf_model(draft_name)
    head = None
    if eagle_dir is not None:
        from shared.model.dtype import resolve_head_dtype
        from shared.model.eagle import build_head

        model = target[0]
        # The dtype an EAGLE proposer started as `make run` starts it gives its head (`--dtype auto`).
        dtype = resolve_head_dtype("auto", "cpu", target_name)
        head, _ = build_head(eagle_dir, model.embed_tokens.weight, model.lm_head_weight, dtype=dtype)
    tokenizer = load_tokenizer(target_name)
    return Models(tokenizer, hf_target, hf_draft, target, draft, target_name, draft_name, head, eagle_dir)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# ---- one configuration ------------------------------------------------------------------------------------


def sampling_params(temperature: float, max_tokens: int, seed: int | None) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, ignore_eos=True)


def engine_config(k: int, adaptive: bool, tree_nodes: int = 0) -> EngineConfig:
    return EngineConfig(
        num_speculative_tokens=max(k, 1),
        max_num_seqs=8,
        max_model_len=MAX_MODEL_LEN,
        adaptive_k=adaptive,
        max_tree_nodes=tree_nodes,
    )


def make_eagle_engine_drafter(head: EagleHead, config: EngineConfig):
    """The head loaded once, a fresh head KV cache per engine."""
    from proposer_service.eagle import drafter_for_head

    sizing = (config.max_num_seqs, config.max_model_len, config.num_speculative_tokens)
    return drafter_for_head(head, default_num_blocks(*sizing, CacheConfig()))


def build(models: Models, cfg: Config) -> Engine:
    config = engine_config(cfg.k, cfg.adaptive, cfg.tree_nodes)
    if cfg.drafter == "draft":
        drafter = make_draft_model_drafter(*models.draft, config, CacheConfig())
        return build_engine(models.target, drafter, config)
    if cfg.drafter == "eagle":
        assert models.eagle_head is not None
        return build_engine(models.target, make_eagle_engine_drafter(models.eagle_head, config), config)
    return build_engine(models.target, cfg.drafter, config)  # None (k = 0) or "ngram"


def run_engine(
    models: Models, cfg: Config, prompts: list[list[int]], batch: int, temperature: float, max_tokens: int, seed: int
) -> Measurement:
    outputs: dict[str, list[int]] = {}
    pos_drafted = [0] * cfg.k
    pos_accepted = [0] * cfg.k
    with PeakRSS() as mem:
        engine = build(models, cfg)
        groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        start = time.perf_counter()
        for g, group in enumerate(groups):
            for i, ids in enumerate(group):
                n = g * batch + i
                # Unseeded rows sample as most traffic does (rejection sampling from the engine's generator).
                request_seed = seed + n if cfg.seeded else None
                engine.add_request(str(n), ids, sampling_params(temperature, max_tokens, request_seed))
            while engine.has_unfinished():
                for out in engine.step():
                    # the accepted drafts are a prefix of the drafted ones: positions 0..num_accepted-1
                    for i in range(min(out.draft_depth, len(pos_drafted))):
                        pos_drafted[i] += 1
                    for i in range(out.num_accepted):
                        pos_accepted[i] += 1
                    if out.finished:
                        outputs[out.request_id] = out.output_ids
        seconds = time.perf_counter() - start
    stats = engine.stats
    del engine
    ordered = [outputs[str(n)] for n in range(len(prompts))]
    assert all(len(o) == max_tokens for o in ordered), [len(o) for o in ordered]
    return Measurement(
        sum(map(len, ordered)),
        seconds,
        mem.delta,
        stats.drafted_tokens,
        stats.accepted_tokens,
        stats.draft_rounds,
        ordered,
        pos_drafted,
        pos_accepted,
    )


def hf_generation_config(models: Models, temperature: float, max_tokens: int, assisted: bool):
    from transformers import GenerationConfig

    kwargs: dict = dict(
        max_new_tokens=max_tokens,
        eos_token_id=None,  # never stop early: the same as our ignore_eos, so greedy outputs are comparable
        pad_token_id=models.pad_id,
        bos_token_id=models.tokenizer.bos_token_id,
        do_sample=temperature > 0,
    )
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    if assisted:
        kwargs.update(
            num_assistant_tokens=4, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0
        )
    return GenerationConfig(**kwargs)


def run_hf(
    models: Models, cfg: Config, prompts: list[list[int]], batch: int, temperature: float, max_tokens: int, seed: int
) -> Measurement:
    assisted = cfg.kind == "hf-assisted"
    gen_config = hf_generation_config(models, temperature, max_tokens, assisted)
    extra = {"assistant_model": models.hf_draft} if assisted else {}
    outputs: list[list[int]] = []
    seconds = 0.0
    with PeakRSS() as mem:
        for g in range(0, len(prompts), batch):
            group = prompts[g : g + batch]
            width = max(map(len, group))
            pad = models.pad_id
            input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])  # left padding
            attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            torch.manual_seed(seed + g)
            start = time.perf_counter()
            out = models.hf_target.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=gen_config, **extra
            )
            seconds += time.perf_counter() - start
            outputs.extend(out[:, width:].tolist())
    assert all(len(o) == max_tokens for o in outputs), [len(o) for o in outputs]
    return Measurement(sum(map(len, outputs)), seconds, mem.delta, outputs=outputs)


def run_config(models: Models, cfg: Config, prompts, batch, temperature, max_tokens, seed) -> Measurement:
    runner = run_engine if cfg.kind == "engine" else run_hf
    return runner(models, cfg, prompts, batch, temperature, max_tokens, seed)


# ---- the draft/target cost ratio ---------------------------------------------------------------------------


def time_forward(model: LlamaModel, arch: ModelArch, prompts: list[list[int]], query_lens: Sequence[int], reps: int):
    """Median seconds of one forward over len(prompts) sequences, q new tokens each (logits at all q), per q.

    The sequences are prefilled first; each timed forward writes at the same positions after the prompt, so
    the context length stays fixed. This is the model's own cost: no scheduler, sampler or drafter around it."""
    cache = CacheConfig()
    longest = max(map(len, prompts)) + max(query_lens)
    per_seq = -(-longest // cache.block_size)
    runner = make_runner(model, arch, per_seq * len(prompts), cache)
    blocks = BlockManager(per_seq * len(prompts), cache.block_size)
    tables = []
    for i in range(len(prompts)):
        blocks.reserve(str(i), longest)
        tables.append(blocks.block_table(str(i)))
    runner.forward([ForwardItem(t, 0, ids, 1) for t, ids in zip(tables, prompts, strict=True)])
    samples: dict[int, list[float]] = {q: [] for q in query_lens}
    for rep in range(reps + 1):
        for q in query_lens:
            items = [ForwardItem(t, len(ids), ids[-q:], q) for t, ids in zip(tables, prompts, strict=True)]
            start = time.perf_counter()
            runner.forward(items)
            if rep:  # the first round is a warm-up
                samples[q].append(time.perf_counter() - start)
    return {q: statistics.median(s) for q, s in samples.items()}


def time_head_forward(head: EagleHead, prompts: list[list[int]], reps: int) -> float:
    """Median seconds of one EAGLE draft position over len(prompts) sequences: one head forward of one
    token per sequence plus its logits over the head's vocabulary subset, as `EagleDrafter._draft` does per
    position after the first. The head's cache is filled first (positions 0..len-2, as after catch-up) and
    every timed forward writes position len-1, so the context length stays fixed. Feature values do not
    change the cost: random ones stand in for the target's."""
    arch, block_size = head.arch, CacheConfig().block_size
    per_seq = -(-max(map(len, prompts)) // block_size)
    num_blocks = per_seq * len(prompts)
    cache = KVCache(
        arch.num_layers, num_blocks, block_size, arch.num_kv_heads, arch.head_dim, head.fc_weight.dtype, "cpu"
    )
    blocks = BlockManager(num_blocks, block_size)
    tables = []
    for i, ids in enumerate(prompts):
        blocks.reserve(str(i), len(ids))
        tables.append(blocks.block_table(str(i)))
    gen = torch.Generator().manual_seed(0)

    def forward(spans: list[SeqSpan], next_ids: list[int]) -> torch.Tensor:
        meta = build_metadata(spans, block_size, head.fc_weight.device)
        features = torch.randn(len(next_ids), arch.hidden_size, generator=gen)
        return head(features, torch.tensor(next_ids, dtype=torch.int64), cache.layers, meta)

    forward(
        [SeqSpan(t, 0, len(ids) - 1) for t, ids in zip(tables, prompts, strict=True)],
        [x for p in prompts for x in p[1:]],
    )
    spans = [SeqSpan(t, len(ids) - 1, 1) for t, ids in zip(tables, prompts, strict=True)]
    last = [ids[-1] for ids in prompts]
    samples = []
    for rep in range(reps + 1):
        start = time.perf_counter()
        head.compute_logits(forward(spans, last)).argmax(dim=-1)
        if rep:  # the first round is a warm-up
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_costs(models: Models, prompts: list[list[int]], batch: int, ks: Sequence[int], reps: int) -> dict:
    """c = draft forward time / target forward time for one token per sequence at this batch size, and
    v_k = target forward time for k+1 tokens per sequence / for 1 (the textbook formula assumes v_k = 1);
    with an EAGLE head also c_eagle = one head draft position / the same target step.
    Target, draft and head are timed in alternation, 3 times, and the medians taken."""
    group = prompts[:batch]
    target_q = sorted({1, *(k + 1 for k in ks)})
    target_t: dict[int, list[float]] = {q: [] for q in target_q}
    draft_t: list[float] = []
    head_t: list[float] = []
    for _ in range(3):
        for q, t in time_forward(*models.target, group, target_q, reps).items():
            target_t[q].append(t)
        draft_t.append(time_forward(*models.draft, group, [1], reps)[1])
        if models.eagle_head is not None:
            head_t.append(time_head_forward(models.eagle_head, group, reps))
    target = {q: statistics.median(v) for q, v in target_t.items()}
    draft = statistics.median(draft_t)
    out = {
        "batch": batch,
        "target_step_s": target[1],
        "draft_step_s": draft,
        "c": draft / target[1],
        "verify_cost": {k: target[k + 1] / target[1] for k in ks},
    }
    if head_t:
        eagle_step = statistics.median(head_t)
        out["eagle_step_s"] = eagle_step
        out["c_eagle"] = eagle_step / target[1]
    return out


def per_token_alpha(accepted_per_round: float, k: int) -> float:
    """The paper's alpha (each draft position accepted with probability alpha, independently): the value
    whose expected accepted drafts per round, alpha (1 - alpha^k) / (1 - alpha), equal the measured ones.
    accepted / drafted is not it: it counts the positions after a rejection, which are never tested."""
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        expected = mid * k if mid >= 1.0 else mid * (1 - mid**k) / (1 - mid)
        low, high = (mid, high) if expected < accepted_per_round else (low, mid)
    return (low + high) / 2


def predicted_speedup(a: float, k: int, c: float, verify_cost: float = 1.0) -> float:
    tokens_per_round = k + 1 if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
    return tokens_per_round / (k * c + verify_cost)


# ---- the benchmark ---------------------------------------------------------------------------------------


@dataclass
class Plan:
    runs: int
    max_tokens: int
    batch1_prompts: int
    cost_reps: int
    hf_quoting: bool = False
    threads: int = NUM_THREADS
    keys: tuple[str, ...] = ()  # the selected rows (select_configs); empty: all but the optional ones


def select_configs(only: str, hf_quoting: bool, eagle: bool, eagle_dir: str = "") -> tuple[tuple[str, ...], list[str]]:
    """The keys to run and notes about the choice. `only`: comma-separated keys ('' for the default set);
    the engine baseline of every selected engine row is added, so its x (c) can be computed. Without an
    EAGLE head the eagle rows are left out (an error when asked for by name)."""
    notes = []
    if only:
        wanted = [k.strip() for k in only.split(",") if k.strip()]
        unknown = [k for k in wanted if k not in CONFIG_BY_KEY]
        if unknown:
            raise SystemExit(f"--only: unknown row(s) {unknown}; rows are {', '.join(CONFIG_BY_KEY)}")
        picked = set(wanted)
        for key in wanted:
            cfg = CONFIG_BY_KEY[key]
            for base in (cfg.baseline_engine if cfg.kind == "engine" else "", cfg.unseeded):
                if base and base not in picked:
                    picked.add(base)
                    notes.append(f"added {base} (the baseline of {key})")
        if not eagle and any(CONFIG_BY_KEY[k].drafter == "eagle" for k in picked):
            raise SystemExit(
                f"--only asks for EAGLE rows but there is no head at {eagle_dir or '?'} (no config.json): "
                "set --eagle-head or SPECDEC_EAGLE_HEAD"
            )
    else:
        picked = {c.key for c in CONFIGS if hf_quoting or not c.optional}
        if not eagle:
            picked -= {c.key for c in CONFIGS if c.drafter == "eagle"}
    return tuple(c.key for c in CONFIGS if c.key in picked), notes


class Progress:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f}s] {message}", flush=True)


def run_benchmark(models: Models, plan: Plan, log: Callable[[str], None]) -> dict:
    tok = models.tokenizer
    prompt_ids = {
        "general": [chat_ids(tok, p) for p in GENERAL_PROMPTS],
        "quoting": [chat_ids(tok, p) for p in QUOTING_PROMPTS],
    }
    log(
        "prompt lengths: general "
        + ", ".join(str(len(p)) for p in prompt_ids["general"])
        + "; quoting "
        + ", ".join(str(len(p)) for p in prompt_ids["quoting"])
    )

    costs = {}
    for batch in BATCH_SIZES:
        costs[batch] = measure_costs(models, prompt_ids["general"], batch, (2, 4), plan.cost_reps)
        c = costs[batch]
        eagle = (
            f", EAGLE head position {c['eagle_step_s'] * 1e3:.2f} ms, c_eagle = {c['c_eagle']:.3f}"
            if "c_eagle" in c
            else ""
        )
        log(
            f"cost ratio batch {batch}: target step {costs[batch]['target_step_s'] * 1e3:.1f} ms, draft step "
            f"{costs[batch]['draft_step_s'] * 1e3:.1f} ms, c = {costs[batch]['c']:.3f}{eagle}, verify cost "
            + ", ".join(f"k={k}: {v:.2f}x" for k, v in costs[batch]["verify_cost"].items())
        )

    groups = [(b, t) for b in BATCH_SIZES for t in TEMPERATURES]
    wanted = [CONFIG_BY_KEY[k] for k in plan.keys]
    active = {
        (b, t): [c for c in wanted if not (c.batch1_only and b > 1) and not (c.seeded and t == 0)] for b, t in groups
    }

    def prompts_for(cfg: Config, batch: int, run: int) -> list[list[int]]:
        """Batch 8: the 8 prompts of the set. Batch 1: `batch1_prompts` of them, the next ones each run."""
        ids = prompt_ids[cfg.prompt_set]
        if batch > 1:
            return ids[:batch]
        return [ids[(run * plan.batch1_prompts + i) % len(ids)] for i in range(plan.batch1_prompts)]

    log("warm-up (4 tokens per configuration, 1 sequence; one batch-8 call each of HF and the engine)")
    for cfg in active[(1, TEMPERATURES[-1])]:
        run_config(models, cfg, prompts_for(cfg, 1, 0)[:1], 1, TEMPERATURES[-1], 4, seed=0)
    for key in ("a", "c"):
        if key in plan.keys:
            run_config(models, CONFIG_BY_KEY[key], prompt_ids["general"][:8], 8, 0.0, 2, seed=0)

    results: dict[tuple[int, float, str], list[Measurement]] = {}
    for run in range(plan.runs):
        for batch, temperature in groups:
            cfgs = active[(batch, temperature)]
            shift = run % len(cfgs)
            for cfg in cfgs[shift:] + cfgs[:shift]:  # rotate the order from run to run
                prompts = prompts_for(cfg, batch, run)
                m = run_config(models, cfg, prompts, batch, temperature, plan.max_tokens, 1000 + 100 * run)
                results.setdefault((batch, temperature, cfg.key), []).append(m)
                extra = f", acceptance {m.accepted / m.drafted:.3f}" if m.drafted else ""
                log(
                    f"run {run + 1}/{plan.runs} batch {batch} T={temperature}: {cfg.label}: "
                    f"{m.tokens} tokens in {m.seconds:.1f} s = {m.tokens_per_s:.1f} tok/s{extra}"
                )
    return summarise(results, costs, active, plan, models)


def summarise(results, costs, active, plan: Plan, models: Models) -> dict:
    rows = []
    for (batch, temperature), cfgs in active.items():
        keys = [c.key for c in cfgs]
        for cfg in CONFIGS:
            ms = results.get((batch, temperature, cfg.key))
            row = {"batch": batch, "temperature": temperature, "key": cfg.key, "label": cfg.label}
            row["prompts"] = f"{plan.batch1_prompts}/run" if batch == 1 else f"{batch}"
            row["prompts"] += f" {cfg.prompt_set}"
            if ms is None:
                if cfg.batch1_only and cfg.key in plan.keys:
                    row["na"] = "n/a (HF supports batch 1 only)"
                    rows.append(row)
                continue
            row["tokens_per_s"] = statistics.median(m.tokens_per_s for m in ms)
            row["tokens_per_s_runs"] = [m.tokens_per_s for m in ms]
            for name, base in (("vs_a", cfg.baseline_hf), ("vs_c", cfg.baseline_engine)):
                if base in keys:
                    bm = results[(batch, temperature, base)]
                    row[name] = statistics.median(m.tokens_per_s / b.tokens_per_s for m, b in zip(ms, bm, strict=True))
            drafted = sum(m.drafted for m in ms)
            if drafted:
                accepted = sum(m.accepted for m in ms)
                row["acceptance_rate"] = accepted / drafted
                row["mean_accepted_length"] = 1 + accepted / sum(m.draft_rounds for m in ms)
                pos_drafted = [sum(v) for v in zip(*(m.position_drafted for m in ms), strict=True)]
                pos_accepted = [sum(v) for v in zip(*(m.position_accepted for m in ms), strict=True)]
                row["position_acceptance"] = [
                    a / d if d else None for a, d in zip(pos_accepted, pos_drafted, strict=True)
                ]
                row["position_drafted"] = pos_drafted
            if cfg.unseeded in keys:
                bm = results[(batch, temperature, cfg.unseeded)]
                row["vs_unseeded"] = statistics.median(
                    m.tokens_per_s / b.tokens_per_s for m, b in zip(ms, bm, strict=True)
                )
            same_k = {"g4": "d4"}.get(cfg.key)  # the draft model at the same fixed k, for (g)/(d)
            if same_k and same_k in keys:
                bm = results[(batch, temperature, same_k)]
                row["vs_same_k_draft"] = statistics.median(
                    m.tokens_per_s / b.tokens_per_s for m, b in zip(ms, bm, strict=True)
                )
            if cfg.drafter in ("draft", "eagle"):
                cost = costs[batch]
                row["draft_cost"] = cost["c"] if cfg.drafter == "draft" else cost.get("c_eagle")
                fixed = not cfg.adaptive and "mean_accepted_length" in row and cfg.k in cost["verify_cost"]
                if fixed and row["draft_cost"] is not None:
                    a = per_token_alpha(row["mean_accepted_length"] - 1, cfg.k)
                    row["predicted_v"] = predicted_speedup(a, cfg.k, row["draft_cost"], cost["verify_cost"][cfg.k])
            row["rss_delta_mib"] = statistics.median(m.rss_delta for m in ms) / MiB
            if cfg.drafter == "draft" and not cfg.adaptive and not cfg.seeded:  # the formula is rejection sampling
                cost = costs[batch]
                a = per_token_alpha(row["mean_accepted_length"] - 1, cfg.k)
                row["alpha"] = a
                row["c"] = cost["c"]
                row["predicted"] = predicted_speedup(a, cfg.k, cost["c"])
                row["predicted_with_verify_cost"] = predicted_speedup(a, cfg.k, cost["c"], cost["verify_cost"][cfg.k])
                row["verify_cost"] = cost["verify_cost"][cfg.k]
                row["prediction_rel_diff"] = row["vs_c"] / row["predicted"] - 1
                row["prediction_rel_diff_v"] = row["vs_c"] / row["predicted_with_verify_cost"] - 1
            rows.append(row)
    checks = output_checks(results, models, plan)
    return {"rows": rows, "costs": {str(b): c for b, c in costs.items()}, "checks": checks}


def output_checks(results, models: Models, plan: Plan) -> list[str]:
    """Greedy outputs must agree: the engine with any drafter equals the engine at k = 0 (lossless), and
    the engine at k = 0 equals transformers (same weights, fp32; batched kernels may break near-ties)."""
    lines = []
    for batch in BATCH_SIZES:
        pairs = [("c", "a"), ("cq", "aq"), ("d2", "c"), ("d4", "c"), ("da", "c"), ("g4", "c"), ("ga", "c")]
        pairs += [("e", "cq"), ("e8", "cq"), ("ea", "cq"), ("b", "a")]
        for x, y in pairs:
            mx, my = results.get((batch, 0.0, x)), results.get((batch, 0.0, y))
            if not mx or not my:
                continue
            same = sum(
                ox == oy for m1, m2 in zip(mx, my, strict=True) for ox, oy in zip(m1.outputs, m2.outputs, strict=True)
            )
            total = sum(len(m.outputs) for m in mx)
            lines.append(
                f"batch {batch}, greedy: {CONFIG_BY_KEY[x].label} output == {CONFIG_BY_KEY[y].label} output "
                f"on {same}/{total} sequences"
            )
    return lines


# ---- the report ------------------------------------------------------------------------------------------


def _fmt(value, spec: str, default: str = "—") -> str:
    return default if value is None else format(value, spec)


def render(summary: dict, meta: dict) -> str:
    rows = summary["rows"]
    out = [MARK_START, "## Engine benchmark (`specdec_bench.engine_bench`)", ""]
    m = meta["machine"]
    out += [
        f"- Date: {meta['date']}; wall time of the whole benchmark: {meta['runtime_s'] / 60:.1f} min"
        + (" (**--quick smoke run: 1 run, short outputs; not a measurement**)" if meta["quick"] else ""),
        f"- Command: `{meta['command']}`",
        f"- Machine: {m['cpu']}, {m['cores']} cores available, torch threads {m['torch_threads']}, "
        f"OMP_WAIT_POLICY={m['omp_wait_policy']}, malloc: {m['malloc']}, torch {m['torch']}, "
        f"transformers {m['transformers']}, Python {m['python']}; "
        f"load average at start / end: {meta['load_start']} / {meta['load_end']} (the machine is shared)",
        f"- Models: target `{meta['target']}`, draft `{meta['draft']}` (fp32 on CPU); EAGLE head: {meta['eagle']}",
        f"- Work per configuration and run: {meta['max_tokens']} new tokens per sequence (forced: EOS ignored), "
        f"batch 1: {meta['batch1_prompts']} prompt(s) per run one after another (different ones each run, "
        f"the same for every row of a run), batch 8: the 8 prompts of the set together; "
        f"{meta['runs']} run(s), median reported; engine `max_model_len` {MAX_MODEL_LEN}, block size 16",
        f"- Process peak RSS (getrusage ru_maxrss) at the end: {meta['max_rss_mib']:.0f} MiB; "
        f"RSS with the models loaded, before the first configuration: {meta['rss_loaded_mib']:.0f} MiB"
        + (f"; rows run: {', '.join(meta['keys'])} (`--only`)" if meta.get("only") else ""),
        "",
        "| row | batch | T | prompts | tokens/s | × (a) | × (c) | acceptance | mean acc. len | peak RSS Δ MiB |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        head = f"| {r['label']} | {r['batch']} | {r['temperature']:g} | {r['prompts']} "
        if "na" in r:
            out.append(head + f"| {r['na']} | | | | | |")
            continue
        out.append(
            head + f"| {r['tokens_per_s']:.1f} | {_fmt(r.get('vs_a'), '.2f')} | {_fmt(r.get('vs_c'), '.2f')} "
            f"| {_fmt(r.get('acceptance_rate'), '.3f')} | {_fmt(r.get('mean_accepted_length'), '.2f')} "
            f"| {r['rss_delta_mib']:.0f} |"
        )
    out += ["", "### Draft model: measured speed-up against the prediction", ""]
    cost_lines = []
    for b, c in summary["costs"].items():
        vc = ", ".join(f"k={k}: {v:.2f}" for k, v in c["verify_cost"].items())
        cost_lines.append(
            f"- batch {b}: target forward {c['target_step_s'] * 1e3:.1f} ms, draft forward "
            f"{c['draft_step_s'] * 1e3:.1f} ms per step (one token per sequence, logits included): "
            f"**c = {c['c']:.3f}**; target forward with k+1 tokens per sequence / with 1 token (v_k): {vc}"
        )
    out += cost_lines + [
        "",
        "| batch | T | k | acceptance (accepted/drafted) | a (per-token alpha) | c | v_k | measured (d)/(c) "
        "| predicted (1-a^(k+1))/((1-a)(kc+1)) | rel. diff | predicted with v_k: .../(kc+v_k) | rel. diff |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "predicted" not in r:
            continue
        k = CONFIG_BY_KEY[r["key"]].k
        out.append(
            f"| {r['batch']} | {r['temperature']:g} | {k} | {r['acceptance_rate']:.3f} | {r['alpha']:.3f} "
            f"| {r['c']:.3f} | {r['verify_cost']:.2f} | {r['vs_c']:.2f} | {r['predicted']:.2f} "
            f"| {r['prediction_rel_diff']:+.0%} | {r['predicted_with_verify_cost']:.2f} "
            f"| {r['prediction_rel_diff_v']:+.0%} |"
        )
    out += render_drafting(summary)
    out += render_seeded(summary)
    out += ["", "### Targets", "", "| target | batch | T | measured | result |", "| --- | ---: | ---: | ---: | --- |"]
    by = {(r["batch"], r["temperature"], r["key"]): r for r in rows}
    for b in BATCH_SIZES:
        for t in TEMPERATURES:
            c = by.get((b, t, "c"), {})
            if "vs_a" in c:
                ok = c["vs_a"] >= 1.0
                out.append(f"| (c) >= (a) | {b} | {t:g} | {c['vs_a']:.2f}x | {'PASS' if ok else 'FAIL'} |")
    for key in ("e", "e8", "ea"):
        for b in BATCH_SIZES:
            for t in TEMPERATURES:
                e = by.get((b, t, key), {})
                if "vs_c" in e:
                    verdict = "PASS" if e["vs_c"] >= 1.8 else "FAIL"
                    cfg = CONFIG_BY_KEY[key]
                    drafts = f"adaptive k<={cfg.k}" if cfg.adaptive else f"k={cfg.k}"
                    target = f"(e) n-gram {drafts} >= 1.8x (c), quoting prompts"
                    out.append(f"| {target} | {b} | {t:g} | {e['vs_c']:.2f}x | {verdict} |")
    for r in rows:
        if "predicted" in r:
            k = CONFIG_BY_KEY[r["key"]].k
            for label, pred, diff in (
                ("(kc+1), the formula as written", r["predicted"], r["prediction_rel_diff"]),
                ("(kc+v_k), scoring cost measured", r["predicted_with_verify_cost"], r["prediction_rel_diff_v"]),
            ):
                out.append(
                    f"| (d)/(c) within 10 % of prediction {label}, k={k} | {r['batch']} | {r['temperature']:g} "
                    f"| {r['vs_c']:.2f}x vs {pred:.2f}x ({diff:+.0%}) | {'PASS' if abs(diff) <= 0.10 else 'FAIL'} |"
                )
    out += ["", "### Output checks (greedy)", ""] + [f"- {line}" for line in summary["checks"]]
    out += ["", "### How to read this", "", HOW_TO_READ, MARK_END, ""]
    return "\n".join(out)


def render_drafting(summary: dict) -> list[str]:
    """Every drafting row (EAGLE head, draft model, n-gram): cost and acceptance per draft position."""
    rows = [r for r in summary["rows"] if "position_acceptance" in r]
    if not rows:
        return []
    out = ["", "### Draft cost and acceptance per draft position (EAGLE head beside the draft model)", ""]
    for b, c in summary["costs"].items():
        if "c_eagle" in c:
            out.append(
                f"- batch {b}: one EAGLE head draft position (1-layer head forward + logits over its vocabulary "
                f"subset) {c['eagle_step_s'] * 1e3:.2f} ms, target step {c['target_step_s'] * 1e3:.1f} ms: "
                f"**c_eagle = {c['c_eagle']:.3f}** (draft model: c = {c['c']:.3f})"
            )
    out += [
        "",
        "| row | batch | T | tokens/s | × (c) | × (d) k=4 | mean acc. len | acceptance per draft position 1, 2, ... "
        "| draft cost / target step | predicted × (c): .../(kc+v_k) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for r in rows:
        positions = " / ".join(_fmt(a, ".2f") for a in r["position_acceptance"])
        out.append(
            f"| {r['label']} | {r['batch']} | {r['temperature']:g} | {r['tokens_per_s']:.1f} "
            f"| {_fmt(r.get('vs_c'), '.2f')} | {_fmt(r.get('vs_same_k_draft'), '.2f')} "
            f"| {_fmt(r.get('mean_accepted_length'), '.2f')} | {positions} | {_fmt(r.get('draft_cost'), '.3f')} "
            f"| {_fmt(r.get('predicted_v'), '.2f')} |"
        )
    out += [
        "",
        "Acceptance at position i is (draft rounds that accepted draft i) / (draft rounds that drafted i), from "
        "each step's `RequestOutput.num_drafted` / `num_accepted` (accepted drafts are a prefix of the drafted "
        "ones), over all runs; with adaptive k later positions are drafted in fewer rounds. The draft cost is "
        "c (draft model) or c_eagle (head) at that batch, measured above; the EAGLE head's rounds also include "
        "one catch-up forward over the newly committed tokens, which c_eagle leaves out. × (d) k=4 is (g) "
        "against the draft model at the same fixed k in the same run.",
    ]
    return out


def render_seeded(summary: dict) -> list[str]:
    """Seeded rows beside their unseeded twins: the acceptance that coupled verification costs or gains."""
    by = {(r["batch"], r["temperature"], r["key"]): r for r in summary["rows"]}
    pairs = [
        (r, by[(r["batch"], r["temperature"], CONFIG_BY_KEY[r["key"]].unseeded)])
        for r in summary["rows"]
        if CONFIG_BY_KEY[r["key"]].seeded and (r["batch"], r["temperature"], CONFIG_BY_KEY[r["key"]].unseeded) in by
    ]
    if not pairs:
        return []
    out = [
        "",
        "### Seeded (coupled) vs unseeded (rejection) sampling, same run",
        "",
        "| drafter | batch | T | acceptance unseeded / seeded | mean acc. len unseeded / seeded "
        "| tokens/s unseeded / seeded | seeded × unseeded |",
        "| --- | ---: | ---: | --- | --- | --- | ---: |",
    ]
    for seeded, unseeded in pairs:

        def both(name: str, spec: str) -> str:
            return f"{_fmt(unseeded.get(name), spec)} / {_fmt(seeded.get(name), spec)}"  # noqa: B023

        out.append(
            f"| {unseeded['label']} | {seeded['batch']} | {seeded['temperature']:g} | {both('acceptance_rate', '.3f')} "
            f"| {both('mean_accepted_length', '.2f')} | {both('tokens_per_s', '.1f')} "
            f"| {_fmt(seeded.get('vs_unseeded'), '.2f')} |"
        )
    out += [
        "",
        'A request with a `seed` is verified by coupling (docs/engine.md, "Seeded sampling"): the emitted token '
        "is argmax(log target_probs + Gumbel noise keyed by (seed, position)) and a draft token is accepted only "
        "when it equals that token; the draft model draws its proposal with the same noise, the n-gram drafter "
        "cannot. Unseeded requests use rejection sampling, which accepts a draft token with probability "
        "min(1, target/draft).",
    ]
    return out


HOW_TO_READ = """\
tokens/s is generated tokens (all sequences) divided by the wall time of generation alone (model loading and
engine construction excluded; batch 1 runs its prompts one after another). Every row of a run works on the
same prompts with the same forced number of new tokens, so rows differ only in how the tokens are produced.
× (a) and × (c) are computed inside each run, row against baseline measured minutes apart on the same busy
machine, and the median over runs is shown; they are the numbers to trust, the absolute tokens/s move with
the load of the shared 2-core machine. Rows marked [quoting] use the 8 prompts that quote their input (code
edits, summaries with quotations); their × (c) is against (c) run on those same prompts, and their × (a) is
shown only when `--hf-quoting` also ran (a) on them (left out by default to fit the time budget).
acceptance is accepted draft tokens / drafted tokens over all runs; mean acc. len is tokens emitted per
draft round (1 + accepted / rounds), i.e. target forwards saved. peak RSS Δ is the highest resident set size
seen (sampled every 20 ms) while the configuration ran, minus the RSS just before it (after gc and
malloc_trim), with all models already loaded: for the engine it includes building it, i.e. its preallocated
paged KV cache (target and, for the draft model, draft cache) and activations; for transformers it is
its dynamic KV cache and activations. The default draft was distilled on CPU and agrees with the target
only ~10-30 % of the time (shared/models/README.md), so the draft-model rows show a low-acceptance case, not
what a good draft gives. The (g) rows draft with the EAGLE head (one decoder layer fed the target's
hidden states, shared/model/eagle.py), in the engine's process as the draft model is. The (d), (e) and (g)
rows fix k (`EngineConfig(adaptive_k=False)`) so that the formula applies; (d'), (e') and (g') are the
engine's default, which picks k per sequence (0 when it predicts no gain) from the sequence's acceptance,
the measured draft cost and the measured cost of scoring extra tokens. The prediction uses
the paper's per-token acceptance a (each draft position accepted independently with probability a),
estimated from the measured accepted drafts per round: a (1 - a^k) / (1 - a) = accepted / rounds, so that
the formula's numerator is the measured tokens per round; accepted / drafted (the acceptance column) is
smaller, because it counts positions after a rejection that were never tested. c is the draft/target forward
cost ratio. The formula as written assumes the target scores k+1 tokens in the time of one (v_k = 1), true of
a GPU at small batch, where a forward is bound by reading the weights; on this CPU the matrix products of k+1
rows are compute-bound and v_k, measured above, is well over 1, so the second prediction, with measured v_k
in place of 1, is the one that isolates the engine's own overhead (the target's intent: the engine adds
little of its own). Both are reported. With an even number of runs the median is the mean of the middle two."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke check: 1 run, 32 tokens")
    parser.add_argument(
        "--runs",
        type=int,
        default=None,
        help="repetitions, median reported (default 2: ~25 min on 2 idle cores; quick 1)",
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per sequence (default 128; quick 32)")
    parser.add_argument("--batch1-prompts", type=int, default=None, help="prompts per batch-1 run (default 1)")
    parser.add_argument("--hf-quoting", action="store_true", help="also run (a) on the quoting prompts")
    parser.add_argument("--threads", type=int, default=NUM_THREADS, help="torch threads (default 2)")
    parser.add_argument("--out", default="docs/BENCHMARKS.md", help="Markdown file to update ('' to skip)")
    parser.add_argument("--json", default="", help="also write the raw summary as JSON here")
    parser.add_argument("--target", default=None, help="target model (default: shared.settings)")
    parser.add_argument("--draft", default=None, help="draft model (default: shared.settings)")
    parser.add_argument(
        "--eagle-head",
        default=None,
        help="EAGLE head folder (default: $SPECDEC_EAGLE_HEAD or models/smollm2-135m-eagle); rows (g) are "
        "left out when it does not exist",
    )
    parser.add_argument(
        "--only",
        default="",
        help=f"comma-separated rows to run, e.g. c,d4,g4 (rows: {','.join(CONFIG_BY_KEY)}); the engine baseline "
        "(c or cq) of every selected row is added",
    )
    args = parser.parse_args(argv)

    eagle_dir = args.eagle_head or default_eagle_head()
    has_eagle = Path(eagle_dir, "config.json").is_file()
    keys, notes = select_configs(args.only, args.hf_quoting, has_eagle, eagle_dir)
    if not has_eagle:
        print(
            f"EAGLE rows (g4, ga) left out: no head at {eagle_dir} (config.json missing). Train one with "
            "`make train-draft`, or point --eagle-head / SPECDEC_EAGLE_HEAD at a head folder.",
            file=sys.stderr,
        )
    for note in notes:
        print(f"--only: {note}", file=sys.stderr)
    plan = Plan(
        runs=args.runs or (1 if args.quick else 2),
        max_tokens=args.max_tokens or (32 if args.quick else 128),
        batch1_prompts=args.batch1_prompts or 1,
        cost_reps=5 if args.quick else 8,
        hf_quoting=args.hf_quoting,
        threads=args.threads,
        keys=keys,
    )
    use_eagle = any(CONFIG_BY_KEY[k].drafter == "eagle" for k in keys)
    use_hf = any(CONFIG_BY_KEY[k].kind != "engine" for k in keys)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    malloc_tuned = tune_malloc()  # as the services do; for the whole process, transformers rows included
    torch.set_num_threads(plan.threads)
    torch.manual_seed(0)
    log = Progress()
    load_start = load_average()
    target_name = args.target or default_target_model()
    draft_name = args.draft or default_draft_model()
    log(f"loading target {target_name} and draft {draft_name}" + (f", EAGLE head {eagle_dir}" if use_eagle else ""))
    models = load_models(target_name, draft_name, hf=use_hf, eagle_dir=eagle_dir if use_eagle else None)
    from specdec_bench.memory import current_rss, trim_heap

    trim_heap()
    rss_loaded = current_rss()
    log(f"loaded; RSS {rss_loaded / MiB:.0f} MiB; plan {asdict(plan)}")
    with torch.inference_mode():
        summary = run_benchmark(models, plan, log)
    runtime = time.perf_counter() - log.start
    meta = {
        **run_meta("engine_bench", argv, runtime, malloc_tuned, load_start),
        "quick": args.quick,
        "target": target_name,
        "draft": draft_name,
        "eagle": f"`{eagle_dir}`"
        if use_eagle
        else f"none (no head at `{eagle_dir}`: rows (g) left out)"
        if not has_eagle
        else "not selected",
        "only": args.only,
        "max_rss_mib": max_rss() / MiB,
        "rss_loaded_mib": rss_loaded / MiB,
        **asdict(plan),
    }
    section = render(summary, meta)
    print(section)
    if args.out:
        write_report(Path(args.out), section, MARK_START, MARK_END)
        log(f"wrote {args.out}")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, **summary}, indent=1, default=str))
    log(f"done in {runtime / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
