"""Incremental detokenization (real SmolLM2 tokenizer), stop-string matching and the output processor."""

from __future__ import annotations

import random

import pytest

from gateway.config import GatewayConfig
from gateway.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, StopStringMatcher
from gateway.prepare import RequestFields, RequestPreparer
from shared.model.loader import load_tokenizer
from shared.settings import default_target_model

MULTILINGUAL = "Hello 😀 世界! café naïve 你好🎉 Ünïcödé — ok 👩‍👩‍👧 done"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_target_model())


def stream(tokenizer, ids, prompt_ids=(), skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    deltas = [detok.add(t) for t in ids]
    return deltas, detok.flush()


def test_multibyte_characters_split_across_tokens_are_never_emitted_partially(tokenizer):
    ids = tokenizer.encode(MULTILINGUAL)
    # The test is only meaningful if some characters really span several tokens.
    assert any(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in ids)
    deltas, tail = stream(tokenizer, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert tail == ""
    assert "".join(deltas) == tokenizer.decode(ids) == MULTILINGUAL
    # An emoji made of several tokens appears whole, in the delta of the token that completes it.
    assert " 😀" in deltas
    assert any("🎉" in d for d in deltas)


def test_incomplete_character_at_the_end_is_flushed_as_replacement_char(tokenizer):
    ids = tokenizer.encode("ok 😀")
    emoji_start = next(i for i, t in enumerate(ids) if REPLACEMENT_CHAR in tokenizer.decode([t]))
    deltas, tail = stream(tokenizer, ids[: emoji_start + 1])
    assert "".join(deltas) == "ok"
    assert tail.endswith(REPLACEMENT_CHAR)


def test_special_tokens_are_left_out_of_the_text_unless_asked(tokenizer):
    eos = tokenizer.eos_token_id
    ids = [*tokenizer.encode("Hi there"), eos]
    deltas, tail = stream(tokenizer, ids)
    assert "".join(deltas) + tail == "Hi there"
    deltas, tail = stream(tokenizer, ids, skip_special_tokens=False)
    assert "".join(deltas) + tail == "Hi there" + tokenizer.decode([eos])


def test_prompt_context_does_not_leak_into_the_output(tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    ids = tokenizer.encode(" Paris, of course.")
    deltas, tail = stream(tokenizer, ids, prompt_ids=prompt)
    assert "".join(deltas) + tail == " Paris, of course."


def test_random_token_streams_concatenate_to_the_full_decode(tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(20):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        deltas, tail = stream(tokenizer, ids)
        full = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert "".join(deltas) + tail == full
        assert all(not d.endswith(REPLACEMENT_CHAR) for d in deltas)


# -- stop strings --------------------------------------------------------------------------------------


def feed_all(matcher, deltas):
    emitted, match = [], None
    for d in deltas:
        text, match = matcher.feed(d)
        emitted.append(text)
        if match:
            emitted.append(match.text)
            break
    return emitted, match


def test_stop_string_spanning_deltas_is_cut_before_it():
    matcher = StopStringMatcher(["END"])
    emitted, match = feed_all(matcher, ["The answer E", "N", "D and more"])
    assert match is not None and match.stop_string == "END"
    assert "".join(emitted) == "The answer "
    # "E" and "EN" were held back: never emitted as text that might be the start of the stop string.
    assert emitted[0] == "The answer "
    assert emitted[1] == ""


def test_held_back_text_is_released_when_it_stops_matching():
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("abc E") == ("abc ", None)
    assert matcher.feed("X") == ("EX", None)
    assert matcher.feed("EN") == ("", None)
    assert matcher.flush() == "EN"


def test_earliest_of_several_stop_strings_wins():
    matcher = StopStringMatcher(["world", "lo w", "xyz"])
    text, match = matcher.feed("hello world")
    assert text == ""
    assert match is not None and match.stop_string == "lo w" and match.text == "hel"


def test_stop_string_at_the_start_and_no_stop_strings():
    text, match = StopStringMatcher(["\n"]).feed("\nrest")
    assert match is not None and match.text == "" and text == ""
    assert StopStringMatcher([]).feed("anything END") == ("anything END", None)


def test_overlapping_prefixes_hold_back_the_longest_partial_match():
    matcher = StopStringMatcher(["abcd", "bcx"])
    assert matcher.feed("zzabc") == ("zz", None)  # "abc" could still become "abcd"
    text, match = matcher.feed("x")
    assert match is not None and match.stop_string == "bcx" and match.text == "a"


# -- output processor ------------------------------------------------------------------------------------


def test_output_processor_reports_tokens_up_to_the_stop_string_and_respects_max_tokens(tokenizer):
    frontend = RequestPreparer(tokenizer, GatewayConfig())
    ids = tokenizer.encode("one two three four five six")
    fields = RequestFields(prompt_token_ids=(1, 2, 3), stop=(" four",), max_tokens=100)
    out = frontend.output(frontend.prepare(fields))
    chunk = out.add(ids)
    assert chunk.stop_string == " four"
    assert chunk.text == "one two three"
    assert chunk.token_ids == ids[: len(chunk.token_ids)] and len(chunk.token_ids) < len(ids)
    assert out.finished

    out = frontend.output(frontend.prepare(RequestFields(prompt_token_ids=(1,), max_tokens=3)))
    chunk = out.add(ids)
    assert chunk.length_reached and chunk.token_ids == ids[:3]
    assert chunk.text + out.finish().text == tokenizer.decode(ids[:3])


class _Recording:
    """The tokenizer, recording the longest window of ids it is asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.longest = tokenizer, 0
        self.all_special_ids = tokenizer.all_special_ids

    def decode(self, ids, **kwargs):
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_a_long_run_of_skipped_special_tokens_keeps_the_window_short(tokenizer):
    """EOS after EOS (ignore_eos) adds no text: each token must cost the same, not re-decode the whole run."""
    ids = [*tokenizer.encode("Done."), *[tokenizer.eos_token_id] * 2000, *tokenizer.encode(" More")]
    recording = _Recording(tokenizer)
    deltas, tail = stream(recording, ids)
    assert "".join(deltas) + tail == "Done. More"
    assert recording.longest <= 16
    deltas, tail = stream(tokenizer, ids, skip_special_tokens=False)  # shown, they are text like any other
    assert "".join(deltas) + tail == tokenizer.decode(ids)


def test_real_replacement_characters_are_streamed_not_held_to_the_end(tokenizer):
    """U+FFFD is held back as a partial character only briefly: a run of real ones (a format may ask for them)
    streams as it comes, and the window stays short."""
    ids = tokenizer.encode(REPLACEMENT_CHAR * 500)
    recording = _Recording(tokenizer)
    deltas, tail = stream(recording, ids)
    assert "".join(deltas) + tail == REPLACEMENT_CHAR * 500
    assert sum(1 for d in deltas if d) > 50 and recording.longest <= 32
