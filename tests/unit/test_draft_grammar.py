"""Drafts under a format (structured output): every drafter proposes only tokens the grammar allows, sampled drafts
send the masked distribution they came from, unconstrained sequences in the same batch draft as they do alone, and
a format that cannot be followed gives an empty draft, never an error. Tiny random models over the real tokenizer's
vocabulary: random drafts almost never follow a format, so a drafter that does not mask fails at once."""

from __future__ import annotations

import json
import logging
import random
from dataclasses import replace

import pytest
import torch

from proposer_service.draft_model import DraftModelDrafter
from proposer_service.eagle import make_eagle_drafter
from proposer_service.ngram import NgramDrafter
from proposer_service.suffix import SuffixDrafter
from shared.drafting import Draft, DraftRequest
from shared.grammar import GrammarCompiler, StructuredOutput, allowed_tokens
from shared.kv.block_manager import BlockManager
from shared.model.build import CacheConfig, make_runner, read_arch
from shared.model.config import ModelArch
from shared.sampling import SamplingParams
from shared.settings import default_target_model
from tests.tiny import ours, tiny_config, tiny_hf_model
from tests.unit.test_eagle import make_head_dir

SCHEMA = StructuredOutput(
    "json_schema",
    '{"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "tags": {"type": "array", '
    '"items": {"type": "integer"}, "maxItems": 4}}, "required": ["name", "tags"], "additionalProperties": false}',
)
REGEX = StructuredOutput("regex", r"[a-z]{2,12}(, [0-9]{1,4}){2,6}\.")
PARAMS = {
    "greedy": SamplingParams(),
    "seeded": SamplingParams(temperature=0.8, top_p=0.95, seed=11),
    "sampled": SamplingParams(temperature=1.0),
}
ROUNDS = 8
K = 4


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    arch = read_arch(default_target_model())
    return GrammarCompiler(tokenizer, arch.vocab_size, arch.eos_token_ids)


@pytest.fixture(scope="module")
def vocab(compiler) -> int:
    return compiler.vocab_size


@pytest.fixture(scope="module")
def draft_model(vocab):
    return ours(tiny_hf_model(seed=3, vocab_size=vocab, logit_scale=30.0))


def new_draft_model_drafter(draft_model, compiler) -> DraftModelDrafter:
    model, arch = draft_model
    cache = CacheConfig(block_size=8)
    return DraftModelDrafter(make_runner(model, arch, 256, cache), BlockManager(256, 8), top_n=16, grammar=compiler)


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory, vocab):
    arch = ModelArch.from_hf_config(tiny_config(vocab))
    # The head knows only the lower part of the vocabulary (bytes and short merges: letters, digits, punctuation).
    return str(make_head_dir(tmp_path_factory.mktemp("head"), arch, torch.arange(6000), scale=10.0))


@pytest.fixture(scope="module")
def eagle_target(vocab):
    gen = torch.Generator().manual_seed(5)
    return torch.randn(vocab, 64, generator=gen), torch.randn(vocab, 64, generator=gen)  # embedding, LM head


def new_eagle_drafter(eagle_dir, eagle_target, compiler):
    return make_eagle_drafter(eagle_dir, *eagle_target, num_blocks=256, block_size=8, top_n=16, grammar=compiler)


class Sequence:
    """One sequence as a verifier drives it: a prompt, committed output, and the delta each request carries."""

    def __init__(self, seq_id: str, prompt: list[int], params: SamplingParams, eagle: bool) -> None:
        self.seq_id, self.prompt, self.params, self.eagle = seq_id, prompt, params, eagle
        self.output: list[int] = []
        self.sent = 0  # committed tokens already sent
        self.finished = False

    @property
    def committed(self) -> list[int]:
        return self.prompt + self.output

    def request(self, k: int) -> DraftRequest:
        committed = self.committed
        features = None
        if self.eagle:  # the target's features: a fixed function of the position, as a target's would be
            gen = torch.Generator().manual_seed(len(committed) * 7919 + len(self.seq_id))
            features = torch.randn(len(committed) - 1, 64, generator=gen)
        req = DraftRequest(
            self.seq_id,
            len(committed),
            committed[self.sent :],
            k,
            self.params,
            features,
            0,
            draft_position=len(self.output),
        )
        self.sent = len(committed)
        return req

    def commit(self, draft: Draft, rng: random.Random, compiler: GrammarCompiler, vocab: int) -> None:
        """Accept a random prefix of the draft, then one token of the 'target': any token the format allows."""
        accepted = draft.token_ids[: rng.randrange(len(draft.token_ids) + 1)]
        if any(t in compiler.eos_token_ids for t in accepted):
            self.finished = True
            return
        constraint = self.params.structured_output
        if constraint is None:
            nxt = rng.randrange(3, vocab)
        else:
            matcher = compiler.matcher(constraint)
            matcher.consume(self.output + accepted)
            bitmask = compiler.new_bitmask(1)
            matcher.fill_masks([], bitmask)
            allowed = allowed_tokens(bitmask, vocab)[0].nonzero().flatten().tolist()
            if all(t in compiler.eos_token_ids for t in allowed):
                self.finished = True
                return
            nxt = rng.choice([t for t in allowed if t not in compiler.eos_token_ids])
        self.output += [*accepted, nxt]


def check_under_format(compiler: GrammarCompiler, seq: Sequence, output: list[int], draft: Draft, vocab: int) -> None:
    """Every drafted token is allowed after the committed output and the draft before it (an EOS only last),
    and a sampled draft's sparse distribution puts all its mass on allowed tokens."""
    constraint = seq.params.structured_output
    assert constraint is not None
    matcher = compiler.matcher(constraint)
    matcher.consume(output)
    ids = draft.token_ids
    assert matcher.num_valid(ids) == len(ids), (ids, output)
    if draft.probs is None:
        return
    bitmask = compiler.new_bitmask(len(ids) + 1)
    matcher.fill_masks(ids, bitmask)
    allowed = allowed_tokens(bitmask, vocab)  # [k + 1, vocab]
    for pos, token in enumerate(ids):
        support, probs = draft.probs.token_ids[pos], draft.probs.probs[pos]
        assert bool(allowed[pos, support[probs > 0]].all()), pos
        assert abs(float(probs.sum()) - 1.0) < 1e-5
        assert float(probs[support == token].sum()) > 0


def drive(drafter, twin, compiler, vocab, constraint, params, eagle, seed) -> int:
    """ROUNDS rounds of a constrained and an unconstrained sequence in one batch; `twin` (a fresh drafter) drafts
    the unconstrained one alone. Returns the number of constrained tokens drafted."""
    rng = random.Random(seed)
    prompt = [21350, 281, 20110, 42, 216]  # "Answer in JSON: "
    constrained = Sequence("c", prompt, replace(params, structured_output=constraint), eagle)
    free = Sequence("u", prompt[1:], params, eagle)
    alone = Sequence("u", prompt[1:], params, eagle)
    drafted = 0
    for _ in range(ROUNDS):
        if constrained.finished:
            break
        output = list(constrained.output)
        batch = [constrained.request(K), free.request(K)]
        draft, free_draft = drafter.propose(batch)
        (alone_draft,) = twin.propose([alone.request(K)])
        check_under_format(compiler, constrained, output, draft, vocab)
        drafted += len(draft.token_ids)
        assert free_draft.token_ids == alone_draft.token_ids and len(free_draft.token_ids) == K
        if free_draft.probs is not None:
            assert alone_draft.probs is not None
            # A batch of two rounds differently from one in the last bits (EAGLE's batched attention).
            assert torch.equal(free_draft.probs.token_ids, alone_draft.probs.token_ids)
            torch.testing.assert_close(free_draft.probs.probs, alone_draft.probs.probs, atol=1e-4, rtol=1e-4)
        constrained.commit(draft, rng, compiler, vocab)
        plan = random.Random(rng.random())  # the same commits for both copies of the unconstrained sequence
        state = plan.getstate()
        free.commit(free_draft, plan, compiler, vocab)
        plan.setstate(state)
        alone.commit(alone_draft, plan, compiler, vocab)
    return drafted


@pytest.fixture
def same_draft_streams(monkeypatch):
    """Unseeded sampling draws each sequence's drafter stream at random: fix it, so two drafters agree."""
    monkeypatch.setattr("proposer_service.paged_drafter.secrets.randbits", lambda bits: 12345)


@pytest.mark.parametrize("constraint", [SCHEMA, REGEX], ids=["json_schema", "regex"])
@pytest.mark.parametrize("params", list(PARAMS), ids=list(PARAMS))
@pytest.mark.parametrize("kind", ["draft-model", "eagle"])
def test_model_drafters_draft_only_allowed_tokens(
    kind, draft_model, eagle_dir, eagle_target, compiler, vocab, constraint, params, same_draft_streams
):
    new = {
        "draft-model": lambda: new_draft_model_drafter(draft_model, compiler),
        "eagle": lambda: new_eagle_drafter(eagle_dir, eagle_target, compiler),
    }[kind]
    drafted = drive(
        new(),
        new(),
        compiler,
        vocab,
        constraint,
        PARAMS[params],
        eagle=kind == "eagle",
        seed=len(params) + len(constraint.kind),
    )
    assert drafted >= ROUNDS


def test_greedy_draft_is_the_argmax_over_allowed_tokens(draft_model, compiler, vocab):
    """Masked before the choice, not truncated after it: d_1 is the model's best allowed token."""
    model, arch = draft_model
    prompt = [21350, 281, 20110, 42, 216]
    params = SamplingParams(structured_output=REGEX)
    (draft,) = new_draft_model_drafter(draft_model, compiler).propose([DraftRequest("c", 5, prompt, 3, params)])
    plain = new_draft_model_drafter(draft_model, compiler).propose([DraftRequest("c", 5, prompt, 1)])[0]
    twin = new_draft_model_drafter(draft_model, compiler)
    twin.top_n = vocab
    (probs_draft,) = twin.propose([DraftRequest("c", 5, prompt, 1, SamplingParams(temperature=1.0))])
    assert probs_draft.probs is not None
    dense = torch.zeros(vocab).index_put_((probs_draft.probs.token_ids[0],), probs_draft.probs.probs[0])
    bitmask = compiler.new_bitmask(1)
    compiler.matcher(REGEX).fill_masks([], bitmask)
    allowed = allowed_tokens(bitmask, vocab)[0]
    assert not allowed[plain.token_ids[0]]  # the unmasked choice is forbidden: masking changes the draft
    assert draft.token_ids[0] == int(dense.masked_fill(~allowed, -1.0).argmax())


def test_drafted_eos_ends_the_draft(draft_model, compiler, vocab):
    """Once the format is complete only an end-of-sequence is allowed: the draft is that token alone."""
    constraint = StructuredOutput("regex", "ab")
    drafter = new_draft_model_drafter(draft_model, compiler)
    prompt = [21350, 281]
    output = [81, 82]  # "a", "b"
    params = SamplingParams(structured_output=constraint)
    (draft,) = drafter.propose([DraftRequest("c", 4, prompt + output, K, params, draft_position=2)])
    assert len(draft.token_ids) == 1 and draft.token_ids[0] in compiler.eos_token_ids


def test_ngram_truncates_the_run_at_the_first_forbidden_token(compiler):
    one, two, three, a, eos = 33, 34, 35, 81, 2  # "1", "2", "3", "a", <|im_end|>
    prompt = [104, one, two, three, a, a, 216, one, two, eos, 104]
    digits = SamplingParams(structured_output=StructuredOutput("regex", "[0-9]+"))
    drafter = NgramDrafter(max_ngram=2, grammar=compiler)
    # Committed output "12": the last bigram (1, 2) last occurred at prompt positions 7-8, followed by <eos>, "x".
    requests = [
        DraftRequest("free", 13, prompt + [one, two], K, draft_position=2),
        DraftRequest("digits", 13, prompt + [one, two], K, digits, draft_position=2),
    ]
    free, constrained = drafter.propose(requests)
    assert free.token_ids == [eos, 104, one, two]
    assert constrained.token_ids == [eos]  # "12" is complete: an end may follow, nothing after it
    # Output "123": (2, 3) occurs at prompt positions 2-3, followed by "a", "a", " ".
    more = [
        DraftRequest("free", 14, [three], K, draft_position=3),
        DraftRequest("digits", 14, [three], K, digits, draft_position=3),
    ]
    free, constrained = drafter.propose(more)
    assert free.token_ids == [a, a, 216, one]
    assert constrained.token_ids == []
    letters = replace(digits, structured_output=StructuredOutput("regex", "[0-9]+a"))
    (constrained,) = drafter.propose([DraftRequest("digits", 14, [], K, letters, draft_position=3)])
    assert constrained.token_ids == [a]  # a changed format is followed from the same output


def test_suffix_keeps_the_part_of_its_draft_the_format_allows(compiler):
    one, two, three, a, eos = 33, 34, 35, 81, 2  # "1", "2", "3", "a", <|im_end|>
    prompt = [104, one, two, three, a, a, 216, one, two, eos, 104]
    digits = SamplingParams(structured_output=StructuredOutput("regex", "[0-9]+"))
    drafter = SuffixDrafter(grammar=compiler)
    # Committed output "12": "104 1 2" was followed by "3 a a ' '" once before.
    requests = [
        DraftRequest("free", 13, prompt + [one, two], K, draft_position=2),
        DraftRequest("digits", 13, prompt + [one, two], K, digits, draft_position=2),
    ]
    free, constrained = drafter.propose(requests)
    assert free.token_ids == [three, a, a, 216]
    assert constrained.token_ids == [three]  # "a" is not a digit


@pytest.mark.parametrize("kind", ["draft-model", "eagle", "ngram", "suffix"])
def test_a_format_that_cannot_be_followed_gives_an_empty_draft(
    kind, draft_model, eagle_dir, eagle_target, compiler, caplog
):
    drafter = {
        "draft-model": lambda: new_draft_model_drafter(draft_model, compiler),
        "eagle": lambda: new_eagle_drafter(eagle_dir, eagle_target, compiler),
        "ngram": lambda: NgramDrafter(grammar=compiler),
        "suffix": lambda: SuffixDrafter(grammar=compiler),
    }[kind]()
    prompt = [21350, 281, 20110, 42, 216, 104, 81, 216, 104]
    features = torch.randn(len(prompt) + 1, 64) if kind == "eagle" else None

    def request(seq_id, constraint, output, new=None):
        tokens = prompt + output
        return DraftRequest(
            seq_id,
            len(tokens),
            tokens if new is None else new,
            K,
            SamplingParams(structured_output=constraint),
            None if features is None else features[: len(tokens) - 1],
            0,
            draft_position=len(output),
        )

    with caplog.at_level(logging.WARNING, logger="specdec.proposer"):
        drafts = drafter.propose(
            [
                request("bad-regex", StructuredOutput("regex", "(unclosed"), []),
                request("bad-json", StructuredOutput("json_schema", "{not json"), []),
                request("off-format", StructuredOutput("regex", "[0-9]+"), [81]),  # output "a"
                request("fine", None, [104]),
            ]
        )
    assert [d.token_ids for d in drafts[:3]] == [[], [], []]
    assert not any(d.needs_resync for d in drafts)
    if kind not in ("ngram", "suffix"):  # the prompt lookups draft only what the text repeats
        assert len(drafts[3].token_ids) == K  # the rest of the batch is drafted
    assert "not compiled" in caplog.text and "does not match" in caplog.text
    # The output rewritten to one the format allows (a resend): drafting resumes.
    (draft,) = drafter.propose([request("off-format", StructuredOutput("regex", "[0-9]+"), [33], new=prompt + [33])])
    if kind not in ("ngram", "suffix"):
        assert draft.token_ids and matcher_allows(compiler, "[0-9]+", [33], draft.token_ids)


def matcher_allows(compiler: GrammarCompiler, regex: str, output: list[int], ids: list[int]) -> bool:
    matcher = compiler.matcher(StructuredOutput("regex", regex))
    matcher.consume(output)
    return matcher.num_valid(ids) == len(ids)


def test_without_a_compiler_constrained_sequences_get_no_draft_and_one_warning(draft_model, caplog):
    drafter = new_draft_model_drafter(draft_model, None)
    params = SamplingParams(structured_output=REGEX)
    prompt = [21350, 281, 20110, 42, 216]
    new = {"c": prompt, "u": prompt}
    with caplog.at_level(logging.WARNING, logger="specdec.proposer"):
        for n in range(3):
            c, u = drafter.propose(
                [DraftRequest("c", 5 + n, new["c"], K, params, draft_position=n), DraftRequest("u", 5 + n, new["u"], K)]
            )
            assert c.token_ids == [] and not c.needs_resync and len(u.token_ids) == K
            new = {"c": [104], "u": [104]}
    assert caplog.text.count("no tokenizer") == 1


@pytest.mark.parametrize("kind", ["draft-model", "eagle"])
def test_committed_tokens_rolled_back_rewind_the_format(kind, draft_model, eagle_dir, eagle_target, compiler):
    """Output "abc" then, committed tokens rolled back, "a1": drafts follow "a1" (letters), not "abc" (digits)."""
    drafter = (
        new_draft_model_drafter(draft_model, compiler)
        if kind == "draft-model"
        else new_eagle_drafter(eagle_dir, eagle_target, compiler)
    )
    a, b, c, one = 81, 82, 83, 33
    constraint = StructuredOutput("regex", "abc[0-9]{1,8}|a1[a-z]{1,8}")
    prompt = [21350, 281, 20110, 42, 216]
    features = torch.randn(len(prompt) + 3, 64) if kind == "eagle" else None
    params = SamplingParams(structured_output=constraint)

    def request(output, new):
        tokens = prompt + output
        feats = None if features is None else features[: len(tokens) - 1]
        return DraftRequest("c", len(tokens), new, K, params, feats, 0, draft_position=len(output))

    (draft,) = drafter.propose([request([a, b, c], prompt + [a, b, c])])
    assert draft.token_ids and matcher_allows(compiler, constraint.spec, [a, b, c], draft.token_ids)
    # "b", "c" replaced by "1": a delta that rewrites committed tokens (the draft model's history follows it;
    # the EAGLE drafter takes a rewrite only as a full resend, the only kind the engine sends).
    (draft,) = drafter.propose([request([a, one], [one] if kind == "draft-model" else prompt + [a, one])])
    assert draft.token_ids and matcher_allows(compiler, constraint.spec, [a, one], draft.token_ids)


def test_a_prompt_ingested_in_chunks_is_not_read_as_output(draft_model, compiler, caplog):
    """k = 0 chunks of a resumed request's prompt (draft_position counts its earlier output, the committed length
    only the chunk so far) are not matched against the format; the first drafting request starts the matcher."""
    drafter = new_draft_model_drafter(draft_model, compiler)
    prompt = [21350, 281, 20110, 42, 216, 104, 216, 104]
    earlier_output = [81, 82]  # "ab", generated before the request was resumed
    params = SamplingParams(structured_output=REGEX)
    tokens = prompt + earlier_output
    with caplog.at_level(logging.WARNING, logger="specdec.proposer"):
        for start, end in ((0, 4), (4, 8)):
            (draft,) = drafter.propose([DraftRequest("c", end, tokens[start:end], 0, params, draft_position=2)])
            assert draft.token_ids == []
        (draft,) = drafter.propose([DraftRequest("c", len(tokens), tokens[8:], K, params, draft_position=2)])
    assert caplog.text == ""
    assert draft.token_ids and matcher_allows(compiler, REGEX.spec, earlier_output, draft.token_ids)


def test_ngram_adds_what_the_format_forces_after_its_run(compiler, tokenizer):
    """No earlier occurrence to copy: the draft is the tokens the format forces (a JSON key with its quotes),
    exactly what a fresh matcher's mask allows one by one; after a copied value, the next key follows it."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    params = SamplingParams(structured_output=StructuredOutput("json_schema", json.dumps(schema)))
    prompt = list(tokenizer("Bob is 12.").input_ids)
    drafter = NgramDrafter(grammar=compiler)
    (draft,) = drafter.propose([DraftRequest("s", len(prompt), prompt, 8, params, draft_position=0)])
    assert tokenizer.decode(draft.token_ids) == '{"name":'
    matcher = compiler.matcher(params.structured_output)
    bitmask = compiler.new_bitmask(1)
    for token in draft.token_ids:  # each is the only token the mask allows
        matcher.fill_masks([], bitmask)
        assert allowed_tokens(bitmask, compiler.vocab_size)[0].nonzero().flatten().tolist() == [token]
        matcher.consume([token])
    output = list(tokenizer('{"name": "Bob"').input_ids)
    (draft,) = drafter.propose(
        [DraftRequest("s", len(prompt) + len(output), output, 8, params, draft_position=len(output))]
    )
    assert tokenizer.decode(draft.token_ids).startswith(', "age":')
