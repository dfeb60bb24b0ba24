"""gateway/auth.py without grpc: the key-file parser, reloads, bearer parsing, per-key limits on a fake clock."""

from __future__ import annotations

import hashlib
import logging
import os

import pytest

from gateway.auth import ApiKeyAuth, KeyFile, KeyFileError, key_digest, parse_key_file
from shared.errors import RateLimitedError, UnauthenticatedError

KEY_A = "sk-alpha-0123456789abcdef"
KEY_B = "sk-bravo-fedcba9876543210"


def bearer(key: str) -> list[str]:
    return [f"Bearer {key}"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- the parser -------------------------------------------------------------------------------------------


def test_parser_reads_keys_digests_names_options_and_skips_comments():
    text = f"""
# the production keys

{KEY_A} alice max_streams=2 tpm=500   # inline comment
  sha256:{hashlib.sha256(KEY_B.encode()).hexdigest().upper()}   bob
sk-unnamed
"""
    keys = parse_key_file(text)
    assert len(keys) == 3
    alice, bob = keys[key_digest(KEY_A)], keys[key_digest(KEY_B)]
    assert (alice.name, alice.max_streams, alice.tokens_per_minute) == ("alice", 2, 500)
    assert (bob.name, bob.max_streams, bob.tokens_per_minute) == ("bob", None, None)
    unnamed = keys[key_digest("sk-unnamed")]
    assert unnamed.name == "sha256:" + hashlib.sha256(b"sk-unnamed").hexdigest()[:8]
    assert parse_key_file("# nothing\n\n   \n") == {}


@pytest.mark.parametrize(
    "line, message",
    [
        ("sha256:abc alice", "line 3: sha256: must be followed by 64 hex digits"),
        (f"sha256:{'g' * 64}", "line 3: sha256: must be followed by 64 hex digits"),
        (f"{KEY_B} alice bob", "line 3: more than one name"),
        (f"{KEY_B} al!ce", "line 3: a name is 1 to 64 letters"),
        (f"{KEY_B} bob rpm=3", "line 3: unknown option 'rpm'"),
        (f"{KEY_B} bob tpm=-1", "line 3: tpm must be a whole number >= 0"),
        (f"{KEY_B} bob max_streams=many", "line 3: max_streams must be a whole number"),
        (f"{KEY_A} other", "line 3: the same key as on an earlier line"),
        (f"sha256:{hashlib.sha256(KEY_A.encode()).hexdigest()}", "line 3: the same key"),
        (f"{KEY_B} alice", "line 3: name 'alice' appears earlier with other limits"),
    ],
)
def test_bad_lines_name_the_file_and_line_but_never_the_key(line, message):
    text = f"# keys\n{KEY_A} alice tpm=10\n{line}\n"
    with pytest.raises(KeyFileError) as info:
        parse_key_file(text, "/etc/keys")
    assert str(info.value).startswith("/etc/keys line 3: ")
    assert message in str(info.value)
    assert KEY_A not in str(info.value) and KEY_B not in str(info.value)


def test_keys_sharing_a_name_with_the_same_limits_are_a_rotation():
    keys = parse_key_file(f"{KEY_A} app tpm=10\n{KEY_B} app tpm=10\n")
    assert {k.name for k in keys.values()} == {"app"}


# -- the file and its reloads -------------------------------------------------------------------------------


def write(path, text: str) -> None:
    # A different size each time, and a bumped mtime: a reload must not depend on the clock's resolution.
    path.write_text(text)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def test_key_file_reloads_on_change_keeps_the_last_good_keys_and_labels_revoked(tmp_path, caplog):
    path = tmp_path / "keys"
    write(path, f"{KEY_A} alice\n{KEY_B} bob\n")
    auth = ApiKeyAuth(KeyFile(str(path)))
    assert auth.identify(bearer(KEY_A)).name == "alice"
    write(path, f"{KEY_B} bob\n")  # alice revoked
    with pytest.raises(UnauthenticatedError) as info:
        auth.identify(bearer(KEY_A))
    assert info.value.reason == "revoked" and str(info.value) == "the API key is not valid"
    assert auth.identify(bearer(KEY_B)).name == "bob"
    with caplog.at_level(logging.ERROR, logger="gateway.auth"):
        write(path, f"{KEY_B} bob tpm=oops\n")  # a bad edit: the last good keys stay
        assert auth.identify(bearer(KEY_B)).name == "bob"
        assert auth.identify(bearer(KEY_B)).name == "bob"
        path.write_bytes(b"\xff\xfe not utf-8\n")
        assert auth.identify(bearer(KEY_B)).name == "bob"
        path.unlink()
        assert auth.identify(bearer(KEY_B)).name == "bob"
    errors = [r.getMessage() for r in caplog.records if "api_keys_reload_failed" in r.getMessage()]
    assert len(errors) == 3 and "line 1: tpm must be" in errors[0]  # once per change, not per request
    write(path, f"{KEY_A} alice\n")  # alice back, bob gone
    assert auth.identify(bearer(KEY_A)).name == "alice"
    with pytest.raises(UnauthenticatedError):
        auth.identify(bearer(KEY_B))
    assert KEY_A not in caplog.text and KEY_B not in caplog.text


def test_a_bad_or_missing_file_at_start_is_fatal(tmp_path):
    with pytest.raises(FileNotFoundError):
        KeyFile(str(tmp_path / "absent"))
    (tmp_path / "bad").write_text("sha256:00\n")
    with pytest.raises(KeyFileError, match="line 1"):
        KeyFile(str(tmp_path / "bad"))


# -- bearer parsing -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, reason",
    [
        ([], "missing"),
        ([KEY_A], "malformed"),
        ([f"Basic {KEY_A}"], "malformed"),
        (["Bearer "], "malformed"),
        ([f"Bearer {KEY_A} extra"], "malformed"),
        ([f"Bearer {KEY_A}", f"Bearer {KEY_A}"], "malformed"),
        (["Bearer sk-wrong"], "unknown"),
        ([f"Bearer {KEY_A}x"], "unknown"),
    ],
)
def test_requests_without_one_valid_bearer_key_are_refused_with_a_reason(tmp_path, values, reason):
    path = tmp_path / "keys"
    path.write_text(f"{KEY_A} alice\n")
    with pytest.raises(UnauthenticatedError) as info:
        ApiKeyAuth(KeyFile(str(path))).identify(values)
    assert info.value.reason == reason and KEY_A not in str(info.value)


def test_bearer_scheme_is_case_insensitive_and_the_sha256_form_matches_the_key(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"sha256:{hashlib.sha256(KEY_A.encode()).hexdigest()} alice\n")
    auth = ApiKeyAuth(KeyFile(str(path)))
    assert auth.identify([f"bearer {KEY_A}"]).name == "alice"
    assert auth.identify([f"Bearer  {KEY_A} "]).name == "alice"


# -- limits -------------------------------------------------------------------------------------------------------


def make_auth(tmp_path, text: str, **limits) -> tuple[ApiKeyAuth, Clock]:
    path = tmp_path / "keys"
    path.write_text(text)
    clock = Clock()
    return ApiKeyAuth(KeyFile(str(path)), clock=clock, **limits), clock


def test_concurrent_streams_per_name_with_a_retry_hint_and_release(tmp_path):
    auth, _ = make_auth(tmp_path, f"{KEY_A} app\n{KEY_B} app\nsk-other other max_streams=0\n", max_streams=2)
    first, second = auth.admit(bearer(KEY_A)), auth.admit(bearer(KEY_B))  # one name: one budget
    with pytest.raises(RateLimitedError) as info:
        auth.admit(bearer(KEY_A))
    err = info.value
    assert (err.client, err.limit, err.retry_after_s) == ("app", "streams", 1)
    assert "limit is 2; retry after 1 s" in str(err)
    assert auth.admit(bearer("sk-other"), limits=True).name == "other"  # its own override: unlimited
    assert auth.admit(bearer(KEY_A), limits=False).name == "app"  # GetStats: no slot taken
    with first:
        pass
    first.release()  # idempotent
    with auth.admit(bearer(KEY_A)), pytest.raises(RateLimitedError):
        auth.admit(bearer(KEY_B))
    second.release()


def two_keys_whose_shown_digests_collide() -> tuple[str, str]:
    """A birthday search over 32 bits: about 80,000 hashes."""
    seen: dict[str, str] = {}
    for i in range(1 << 20):
        key = f"sk-{i}"
        shown = hashlib.sha256(key.encode()).hexdigest()[:8]
        if shown in seen:
            return seen[shown], key
        seen[shown] = key
    raise AssertionError("no collision in 2^20 keys")


def test_unnamed_keys_whose_shown_digits_collide_are_still_two_clients(tmp_path):
    first_key, second_key = two_keys_whose_shown_digests_collide()
    auth, _ = make_auth(tmp_path, f"{first_key} max_streams=1\n{second_key} max_streams=1\n")
    first, second = auth.admit(bearer(first_key)), auth.admit(bearer(second_key))  # a slot each
    assert first.name == second.name  # what logs show: the same 8 digits
    assert first.tenant != second.tenant  # cached prompts kept apart
    with pytest.raises(RateLimitedError):
        auth.admit(bearer(first_key))
    first.release()
    second.release()
    # Other limits for each: two clients, not one name given two sets of limits.
    make_auth(tmp_path, f"{first_key} max_streams=1\n{second_key} max_streams=3\n")
    named = make_auth(tmp_path, f"{first_key} app\n{second_key} app\n")[0]
    assert named.admit(bearer(first_key)).tenant == named.admit(bearer(second_key)).tenant == "app"


def test_tokens_per_minute_sliding_window(tmp_path):
    auth, clock = make_auth(tmp_path, f"{KEY_A} app\n{KEY_B} small tpm=5\n", tokens_per_minute=100)
    with auth.admit(bearer(KEY_A)) as grant:
        grant.charge(30)  # prompt
        clock.now += 10
        grant.charge(80)  # generated: the request may overshoot, the next one waits
    with pytest.raises(RateLimitedError) as info:
        auth.admit(bearer(KEY_A))
    err = info.value
    assert err.limit == "tokens_per_minute" and err.retry_after_s == 50  # now 1010: the 30 leave the window at 1060
    assert "used 110 tokens (prompt and generated) in the last minute, its limit is 100 per minute" in str(err)
    clock.now = 1059.5
    with pytest.raises(RateLimitedError) as info:
        auth.admit(bearer(KEY_A))
    assert info.value.retry_after_s == 1
    clock.now = 1060.0  # 80 left in the window: admitted
    auth.admit(bearer(KEY_A)).release()
    with auth.admit(bearer(KEY_B)) as grant:  # the per-key override
        grant.charge(5)
    with pytest.raises(RateLimitedError):
        auth.admit(bearer(KEY_B))
    clock.now += 60
    auth.admit(bearer(KEY_B)).release()


def test_the_readme_example_file_parses():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "gateway" / "README.md").read_text()
    example = readme.split("The file, one key a line")[1].split("```")[1]
    keys = {k.name: k for k in parse_key_file(example).values()}
    assert keys["web-app"].max_streams == 8 and keys["web-app"].tokens_per_minute == 200000
    assert keys["batch"].digest == key_digest("sk-batch-2b7e151628aed2a6") and keys["batch"].tokens_per_minute == 0
    assert len(keys) == 3
