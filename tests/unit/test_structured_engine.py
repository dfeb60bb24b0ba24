"""Structured output through the engine on tiny models whose tokens are single characters: greedy output equal to
transformers' greedy run with the same grammar engine's logits processor, whatever the drafter; the sampling law
under a mask (with a negative control that leaves drafts unmasked and must fail); resume and bad formats.

The drafters here do not know the format, so they draft forbidden tokens all the time: the verifier must reject
every one of them (drafts masked on the proposer are tested with the proposer)."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import llguidance
import pytest
import torch
from llguidance._tokenizer import TokenizerWrapper

from proposer_service.ngram import NgramDrafter
from shared.errors import InvalidRequestError
from shared.grammar import GrammarCompiler, GrammarLogitsProcessor, StructuredOutput, allowed_tokens
from shared.sampling import SamplingParams
from tests.law import LAW_PROMPT, first_two_token_counts, law_pvalue
from tests.tiny import tiny_target, tiny_target_hf, tiny_weak_draft  # noqa: F401 (fixtures)
from tests.unit.test_engine import EOS, VOCAB, engine_with, prompts
from tests.unit.test_sampling import transformers_probs

FIRST_CHAR = 32  # token i is the character chr(32 + i) (space to '~'); token 95 is EOS


class _CharTokenizer:
    eos_token_id = EOS
    bos_token_id = None
    tokens = [bytes([FIRST_CHAR + i]) for i in range(EOS)] + [b"\xff<eos>"]
    special_token_ids = [EOS]

    def __call__(self, text):
        data = text.encode() if isinstance(text, str) else text
        return [b - FIRST_CHAR for b in data]


def char_ids(text: str) -> list[int]:
    return [ord(c) - FIRST_CHAR for c in text]


def char_text(ids: list[int]) -> str:
    return "".join(chr(FIRST_CHAR + t) for t in ids if t != EOS)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(llguidance.LLTokenizer(TokenizerWrapper(_CharTokenizer()), n_vocab=VOCAB), VOCAB, (EOS,))


SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "tag": {"enum": ["ab", "cd", "efg"]}},
    "required": ["id", "tag"],
    "additionalProperties": False,
}
FORMATS = {
    "json_schema": StructuredOutput("json_schema", json.dumps(SCHEMA)),
    "regex": StructuredOutput("regex", r"[a-m]{2,6}(, [n-z]{1,4}){1,3}\."),
    "grammar": StructuredOutput("grammar", 'start: sum "="\nsum: num (("+" | "-") num)*\nnum: /[1-9][0-9]?/'),
}


def constrained(engine, compiler, drafts: str = "masked"):
    """The engine (and its drafter) with the tiny tokenizer's compiler. drafts: "masked" (a proposer that
    knows the format) or "unaware" (an old proposer: it drafts from the unmasked distribution, so its drafts
    are often forbidden and the verifier must reject them)."""
    engine.grammar = compiler  # the tokenizer the tiny model would have
    if drafts == "masked" and hasattr(engine.drafter, "grammar"):
        engine.drafter.grammar.compiler = compiler
    elif drafts == "unaware" and engine.drafter is not None:
        engine.drafter = _Unaware(engine.drafter)
    return engine


class _Unaware:
    """A drafter that never sees the format."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def propose(self, requests):
        return self.inner.propose([replace(r, params=replace(r.params, structured_output=None)) for r in requests])

    def release(self, seq_ids):
        self.inner.release(seq_ids)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def hf_constrained_greedy(hf_model, compiler, prompt, fmt, max_tokens):
    """The plain decoder: transformers' greedy generate with the grammar engine's logits processor."""
    processor = GrammarLogitsProcessor(compiler, [fmt], len(prompt))
    out = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0, logits_processor=[processor]
    )
    return out[0, len(prompt) :].tolist()


def run_params(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                outs[out.request_id] = out.output_ids
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return outs


@pytest.mark.parametrize("drafter", [None, "same", "weak", "weak-unaware", "ngram"])
@pytest.mark.parametrize(("k", "max_num_seqs"), [(1, 1), (3, 8), (5, 8)])
def test_greedy_equals_transformers_with_the_same_processor(
    target_hf,  # noqa: F811
    target,  # noqa: F811
    weak_draft,  # noqa: F811
    compiler,
    drafter,
    k,
    max_num_seqs,
):
    """Each format on two prompts, plus free requests in the same batch (greedy, unconstrained: plain output)."""
    d = {"weak": weak_draft, "weak-unaware": weak_draft, "ngram": NgramDrafter()}.get(drafter, drafter)
    drafts = "unaware" if drafter == "weak-unaware" else "masked"
    engine = constrained(engine_with(target, d, k=k, max_num_seqs=max_num_seqs), compiler, drafts)
    ps = prompts(8, seed=11)
    requests, refs = {}, {}
    for i, p in enumerate(ps):
        fmt = list(FORMATS.values())[i % 4] if i % 4 < 3 else None
        requests[f"r{i}"] = (p, SamplingParams(max_tokens=40, structured_output=fmt))
        processor_fmt = [fmt] if fmt is not None else [None]
        processor = GrammarLogitsProcessor(compiler, processor_fmt, len(p))
        out = target_hf.generate(
            torch.tensor([p]), max_new_tokens=40, do_sample=False, pad_token_id=0, logits_processor=[processor]
        )
        refs[f"r{i}"] = out[0, len(p) :].tolist()
    outs = run_params(engine, requests)
    assert outs == refs
    if drafter is not None:
        assert engine.stats.drafted_tokens > 0
    for i in range(0, 8, 4):  # the formats really constrained the text
        text = char_text(outs[f"r{i}"])
        assert json.loads(text).keys() == {"id", "tag"}, text


def test_output_matches_each_format(target, weak_draft, compiler):  # noqa: F811
    """Complete outputs end with EOS exactly where the format may end; the text is in the language."""
    import re

    engine = constrained(engine_with(target, weak_draft, k=3, max_num_seqs=4), compiler)
    ps = prompts(6, seed=4)
    params = [SamplingParams(max_tokens=60, structured_output=fmt) for fmt in FORMATS.values()]
    outs = run_params(engine, {f"r{i}": (p, params[i % 3]) for i, p in enumerate(ps)})
    for i in range(6):
        ids = outs[f"r{i}"]
        assert ids[-1] == EOS, f"r{i} did not finish its format: {char_text(ids)!r}"
        text = char_text(ids)
        if i % 3 == 0:
            assert json.loads(text)["tag"] in {"ab", "cd", "efg"}
        elif i % 3 == 1:
            assert re.fullmatch(r"[a-m]{2,6}(, [n-z]{1,4}){1,3}\.", text), text
        else:
            assert re.fullmatch(r"[1-9][0-9]?([+-][1-9][0-9]?)*=", text), text


def two_token_masked_law(hf_model, compiler, fmt, params, prompt):
    """Exact laws of output tokens 1 and 2 under the format: masked logits, then the sampling transform."""
    bitmask = compiler.new_bitmask(1)
    matcher = compiler.matcher(fmt)
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0, -1:].float()
        matcher.fill_masks([], bitmask)
        first = transformers_probs(logits.masked_fill(~allowed_tokens(bitmask, VOCAB), float("-inf")), params)[0]
        second = torch.zeros(VOCAB)
        for token in first.nonzero().flatten().tolist():
            matcher.consume([token])
            matcher.fill_masks([], bitmask)
            matcher.rollback(1)
            logits = hf_model(torch.tensor([prompt + [token]])).logits[0, -1:].float()
            masked = logits.masked_fill(~allowed_tokens(bitmask, VOCAB), float("-inf"))
            second += first[token] * transformers_probs(masked, params)[0]
    return first, second


LAW_FORMAT = StructuredOutput("regex", "(a[b-e]|f[g-m]|[n-s][t-z])")


@pytest.mark.parametrize(
    ("drafts", "mask_drafts"),
    [("masked", True), ("unaware", True), ("unaware", False)],
    ids=["masked-drafts", "unaware-drafts", "negative-control-drafts-judged-unmasked"],
)
def test_sampling_law_under_a_mask(target_hf, target, weak_draft, compiler, drafts, mask_drafts):  # noqa: F811
    """Rejection sampling must give the masked target law at output positions 1 and 2 (the second from a
    speculative step) with drafts sampled from the masked draft distribution, and with drafts from a proposer
    unaware of the format (mostly forbidden). The negative control masks only each row's last scored position,
    so drafted tokens are judged against the unmasked target: it must fail."""
    params = SamplingParams(temperature=2.0, max_tokens=3, structured_output=LAW_FORMAT)
    first, second = two_token_masked_law(target_hf, compiler, LAW_FORMAT, params, LAW_PROMPT)
    assert int((first > 0.02).sum()) >= 4 and int((second > 0.02).sum()) >= 4  # several valid continuations
    engine = engine_with(target, weak_draft, k=3, max_num_seqs=64, max_waiting=5000)
    engine.drafter.top_n = 16
    engine = constrained(engine, compiler, drafts)
    if not mask_drafts:
        compute = engine._masks._compute

        def drafts_unmasked(rows):
            masks, start, end = compute(rows)
            for bitmask in masks.values():
                bitmask[:-1] = -1
            return masks, start, end

        engine._masks._compute = drafts_unmasked
    n = 3000 if mask_drafts else 600  # the control fails by far: forbidden tokens are emitted
    counts = first_two_token_counts(engine, n, lambda i: params, VOCAB)
    assert engine.stats.drafted_tokens > 0 and engine.stats.accepted_tokens > 0
    if drafts == "unaware":
        assert engine.stats.accepted_tokens < engine.stats.drafted_tokens / 2  # forbidden drafts were rejected
    if mask_drafts:
        for observed, law in ((counts[0], first), (counts[1], second)):
            assert law_pvalue(observed, law, n) > 1e-4
    else:
        forbidden = float(counts[1][second == 0].sum())
        assert forbidden > 0 or law_pvalue(counts[1], second, n) < 1e-4


def test_seeded_under_a_mask_is_drafter_invariant(target, weak_draft, compiler):  # noqa: F811
    """Seeded tokens are a function of (seed, position, masked distribution): any drafter, same text."""
    fmt = FORMATS["regex"]
    ps = prompts(4, seed=9)
    results = []
    for drafter, k in ((None, 0), (weak_draft, 3), (NgramDrafter(), 5)):
        engine = constrained(engine_with(target, drafter, k=max(k, 1), max_num_seqs=4), compiler)
        reqs = {
            f"r{i}": (p, SamplingParams(temperature=1.0, seed=100 + i, max_tokens=40, structured_output=fmt))
            for i, p in enumerate(ps)
        }
        results.append(run_params(engine, reqs))
    assert results[0] == results[1] == results[2]


def test_resumed_request_continues_its_format(target_hf, target, compiler):  # noqa: F811
    """A failover resume sends prompt + emitted tokens with output_offset: the format continues after them."""
    fmt = FORMATS["json_schema"]
    prompt = prompts(1, seed=2)[0]
    ref = hf_constrained_greedy(target_hf, compiler, prompt, fmt, 40)
    engine = constrained(engine_with(target, "same", k=3), compiler)
    cut = 7
    engine.add_request("r", prompt + ref[:cut], SamplingParams(max_tokens=40 - cut, structured_output=fmt), None, cut)
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.output_ids
    assert ref[:cut] + outs["r"] == ref


def test_bad_formats_are_refused_and_leave_other_requests_running(target, compiler):  # noqa: F811
    engine = constrained(engine_with(target, "same", k=2), compiler)
    engine.add_request("good", [3, 4, 5], SamplingParams(max_tokens=8, structured_output=FORMATS["regex"]))
    for rid, fmt, message in (
        ("schema", StructuredOutput("json_schema", '{"type": "objekt"}'), "objekt"),
        ("json", StructuredOutput("json_schema", "{not json"), "not JSON"),
        ("regex", StructuredOutput("regex", "(a"), "unclosed group"),
        ("grammar", StructuredOutput("grammar", "start: missing_rule"), "missing_rule"),
        ("kind", StructuredOutput("xml", "<a/>"), "kind"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request(rid, [3, 4, 5], SamplingParams(structured_output=fmt))
        assert rid not in engine.seqs
    with pytest.raises(InvalidRequestError, match="does not match"):  # a resume whose output breaks the format
        engine.add_request(
            "resume", [3, 4] + char_ids("zz"), SamplingParams(structured_output=FORMATS["regex"]), None, 2
        )
    outs = run_params(engine, {})
    assert list(outs) == ["good"]


def test_without_a_tokenizer_a_format_is_refused(target):  # noqa: F811
    engine = engine_with(target, None, k=1)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        engine.add_request("r", [1, 2], SamplingParams(structured_output=FORMATS["regex"]))


def test_masks_are_a_span_of_the_step_and_a_phase_metric(target, weak_draft, compiler, monkeypatch):  # noqa: F811
    """Steps with a constrained request get a `grammar_mask` span under `engine.step` (overlapping `score`) and
    `grammar_mask` / `grammar_wait` observations of the phase histogram; steps without one get neither."""
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from shared.telemetry import setup_telemetry
    from verifier_service.telemetry import VerifierTelemetry

    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    telemetry = setup_telemetry(
        "specdec-verifier", span_processors=[SimpleSpanProcessor(spans)], metric_readers=[reader]
    )
    engine = constrained(engine_with(target, weak_draft, k=3, max_num_seqs=4), compiler)
    VerifierTelemetry(telemetry, engine, None, None)
    run_params(engine, {"free": ([3, 4, 5], SamplingParams(max_tokens=6, ignore_eos=True))})
    free_steps = engine.stats.steps
    assert not [s for s in spans.get_finished_spans() if s.name == "grammar_mask"]
    run_params(engine, {"json": ([3, 4, 5], SamplingParams(max_tokens=30, structured_output=FORMATS["json_schema"]))})
    finished = spans.get_finished_spans()
    steps = {s.context.span_id: s for s in finished if s.name == "engine.step"}
    masks = [s for s in finished if s.name == "grammar_mask"]
    assert len(masks) == engine.stats.steps - free_steps  # every step of the constrained request, no other
    for span in masks:
        step = steps[span.parent.span_id]
        assert step.start_time <= span.start_time <= span.end_time <= step.end_time
        assert span.attributes["specdec.masked_positions"] >= 1
    counts = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == "specdec_step_phase_duration_seconds":
                    for point in metric.data.data_points:
                        counts[point.attributes["phase"]] = point.count
    assert counts["grammar_mask"] == counts["grammar_wait"] == len(masks)
    assert counts["verify"] == engine.stats.steps


@pytest.mark.parametrize("tree_nodes", [0, 6])
def test_a_format_with_ignore_eos_is_exact_past_a_drafted_eos(target, weak_draft, compiler, tree_nodes):  # noqa: F811
    """A request that ignores EOS goes on past the EOS its format ends with, and plain decoding masks the next
    position as it masked the EOS's (the matcher skips an EOS). A drafter that drafts the EOS (the target
    itself as draft) must not leave the position after it unmasked: greedy and seeded output equal plain
    decoding's, chains and trees."""
    fmt = StructuredOutput("regex", r"ab")
    ps = prompts(3, seed=21)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True, structured_output=fmt)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True, structured_output=fmt)
    requests = {f"g{i}": (p, greedy) for i, p in enumerate(ps)} | {f"s{i}": (p, seeded) for i, p in enumerate(ps)}
    plain = run_params(constrained(engine_with(target, None, k=1, max_num_seqs=6), compiler), requests)
    for out in plain.values():  # the format, then only EOS: past every EOS the request went on
        assert out[:2] == char_ids("ab") and out[2:] == [EOS] * 6, out
    for drafter in ("same", weak_draft):
        engine = engine_with(target, drafter, k=3, max_num_seqs=6, max_tree_nodes=tree_nodes)
        engine = constrained(engine, compiler)
        assert run_params(engine, requests) == plain
        assert engine.stats.drafted_tokens > 0
