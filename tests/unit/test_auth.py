"""API keys files: hashed keys parsed strictly, bearer tokens identified, and a changed file
read again (a broken one keeps the last good keys)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from shoal_router.api.auth import KeyFile, bearer_token, hash_key, parse_keys
from shoal_router.core.ratelimit import ApiKey


def _line(name: str, key: str) -> str:
    return f"{name} {hashlib.sha256(key.encode()).hexdigest()}\n"


def test_parse_keys_and_identify(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(
        "# team keys\n" + _line("alice", "sk-alice") + "\n" + _line("bob", "sk-bob") + "  # trailing\n"
    )
    keys = KeyFile(path)
    assert keys.identify("Bearer sk-alice") == ApiKey("alice")
    assert keys.identify("bearer   sk-bob") == ApiKey("bob")
    assert keys.identify("Bearer sk-carol") is None
    assert keys.identify("Basic sk-alice") is None
    assert keys.identify(None) is None and keys.identify("Bearer ") is None
    assert hash_key("sk-alice") in parse_keys(path.read_text())


def test_a_key_line_may_carry_its_own_limits() -> None:
    text = "alice " + "1" * 64 + " rpm=60 tpm=10000\nbob " + "2" * 64 + " tpm=500\n"
    keys = parse_keys(text)
    assert keys["1" * 64] == ApiKey("alice", requests_per_minute=60, tokens_per_minute=10000)
    assert keys["2" * 64] == ApiKey("bob", tokens_per_minute=500)


def test_a_key_line_may_grant_priority_requests() -> None:
    text = "ops " + "1" * 64 + " priority=-10 rpm=5\nbatch " + "2" * 64 + " priority=3\nbob " + "3" * 64
    keys = parse_keys(text)
    assert keys["1" * 64] == ApiKey("ops", requests_per_minute=5, min_priority=-10)
    # A positive bound would take away even the default priority: it means no priority requests.
    assert keys["2" * 64].min_priority == 0
    assert keys["3" * 64].min_priority == 0


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("alice sk-plain-key\n", 1),
        ("# ok\nalice " + "A" * 64 + "\n", 2),
        ("alice\n", 1),
        ("a b " + "0" * 64, 1),
        ("alice " + "0" * 64 + " rpm=ten\n", 1),
        ("alice " + "0" * 64 + " qps=5\n", 1),
        ("alice " + "0" * 64 + " priority=high\n", 1),
    ],
)
def test_bad_lines_are_refused_by_number(text: str, line: int) -> None:
    with pytest.raises(ValueError, match=f"line {line}:"):
        parse_keys(text)


def test_a_changed_file_is_read_again_and_a_broken_one_keeps_the_last_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(_line("alice", "sk-old"))
    keys = KeyFile(path, recheck_s=0.0)
    assert keys.identify("Bearer sk-old") == ApiKey("alice")
    path.write_text(_line("alice", "sk-new") + _line("bob", "sk-bob"))
    os.utime(path, ns=(1, 1))  # a different stamp even within the clock's resolution
    assert keys.identify("Bearer sk-old") is None and keys.identify("Bearer sk-new") == ApiKey("alice")
    path.write_text("not a keys file\n")
    assert keys.identify("Bearer sk-bob") == ApiKey("bob")  # still the last good keys


def test_a_missing_file_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read API keys"):
        KeyFile(tmp_path / "absent")


def test_bearer_token() -> None:
    assert bearer_token("Bearer abc") == "abc" and bearer_token("BEARER  abc ") == "abc"
    assert bearer_token("Token abc") is None and bearer_token("") is None
