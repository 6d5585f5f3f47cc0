"""Registry API tokens: the file's format and errors, scope matching, decisions, and following the file."""

from __future__ import annotations

import fnmatch
import io
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from pilotfish.api.tokens import (
    MAX_TOKENS_FILE_BYTES,
    Access,
    Allowed,
    Denied,
    NewToken,
    TokenFile,
    TokenScope,
    TokenSet,
    authorize,
    hash_token,
    load_tokens,
    parse_tokens,
    token_command,
    warn_if_open,
)
from pilotfish.errors import ConfigError
from pilotfish.events import EventLog

WEB, READER, ADMIN = "tok-web-0123456789", "tok-reader-0123456789", "tok-admin-0123456789"


def document(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "reads": "scoped",
        "tokens": {
            "deploy-web": {"sha256": hash_token(WEB), "write": ["web", "web-*"]},
            "dashboard": {"sha256": hash_token(READER), "read": True},
            "ops": {"sha256": hash_token(ADMIN), "admin": True},
        },
    }
    doc.update(overrides)
    return doc


def problems_of(doc: Any) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as caught:
        parse_tokens(doc, "tokens.yaml")
    assert caught.value.source == "tokens.yaml"
    return [(p.where, p.message) for p in caught.value.problems]


# -- the file --------------------------------------------------------------------------------------


def test_a_valid_file_gives_each_named_token_its_scope() -> None:
    tokens = parse_tokens(document(), "tokens.yaml")
    assert not tokens.reads_open
    by_name = {t.name: t for t in tokens.tokens}
    assert by_name["deploy-web"].write == ("web", "web-*") and not by_name["deploy-web"].read
    assert by_name["dashboard"].read and by_name["dashboard"].write == ()
    assert by_name["ops"].admin and not by_name["ops"].read
    assert tokens.find(WEB) is by_name["deploy-web"]
    assert tokens.find(READER) is by_name["dashboard"]


def test_reads_default_to_scoped_and_may_be_open() -> None:
    doc = document()
    del doc["reads"]
    assert not parse_tokens(doc, "t").reads_open
    assert parse_tokens(document(reads="open"), "t").reads_open


def test_an_uppercase_digest_is_the_same_digest() -> None:
    tokens = parse_tokens({"tokens": {"a": {"sha256": hash_token(WEB).upper(), "write": ["web"]}}}, "t")
    assert tokens.find(WEB) is not None


@pytest.mark.parametrize(
    ("doc", "field", "words"),
    [
        ([], "", "mapping"),
        ({"tokens": {}, "read": "open"}, "read", "unknown setting"),
        ({"tokens": {}, "reads": "public"}, "reads", "neither 'open'"),
        ({"reads": "open"}, "tokens", "required"),
        ({"tokens": ["a"]}, "tokens", "mapping"),
        ({"tokens": {"a": "abc"}}, "tokens.a", "sha256"),
        ({"tokens": {"a": {"write": ["web"]}}}, "tokens.a.sha256", "64 hexadecimal"),
        ({"tokens": {"a": {"sha256": "secret-token"}}}, "tokens.a.sha256", "the token itself never goes in the file"),
        ({"tokens": {"a": {"sha256": hash_token("x") + "0"}}}, "tokens.a.sha256", "64 hexadecimal"),
        ({"tokens": {"a": {"sha256": hash_token("x"), "write": "web"}}}, "tokens.a.write", "a list"),
        (
            {"tokens": {"a": {"sha256": hash_token("x"), "write": ["web", "bad name"]}}},
            "tokens.a.write[1]",
            "'bad name'",
        ),
        ({"tokens": {"a": {"sha256": hash_token("x"), "write": [3]}}}, "tokens.a.write[0]", "not a service name"),
        ({"tokens": {"a": {"sha256": hash_token("x"), "read": "yes"}}}, "tokens.a.read", "true or false"),
        ({"tokens": {"a": {"sha256": hash_token("x"), "admin": 1}}}, "tokens.a.admin", "true or false"),
        ({"tokens": {"a": {"sha256": hash_token("x"), "writes": ["web"]}}}, "tokens.a.writes", "unknown field"),
        (
            {"tokens": {"a": {"sha256": hash_token("x")}, "b": {"sha256": hash_token("x")}}},
            "tokens.b.sha256",
            "same digest as tokens.a",
        ),
    ],
)
def test_each_mistake_names_its_field(doc: Any, field: str, words: str) -> None:
    found = problems_of(doc)
    assert any(where == field and words in message for where, message in found), found


def test_every_problem_is_reported_at_once() -> None:
    found = problems_of({"reads": 1, "tokens": {"a": {"sha256": "x", "read": "no"}, "b": {"write": [""]}}})
    assert {where for where, _ in found} == {
        "reads",
        "tokens.a.sha256",
        "tokens.a.read",
        "tokens.b.sha256",
        "tokens.b.write[0]",
    }


def test_load_reads_yaml_and_json(tmp_path: Path) -> None:
    as_json = tmp_path / "tokens.json"
    as_json.write_text(json.dumps(document(reads="open")))
    assert load_tokens(as_json).reads_open
    as_yaml = tmp_path / "tokens.yaml"
    as_yaml.write_text(f"reads: scoped\ntokens:\n  w:\n    sha256: {hash_token(WEB)}\n    write: [web]\n")
    assert load_tokens(as_yaml).find(WEB) is not None


@pytest.mark.parametrize(
    ("name", "content", "where", "words"),
    [
        ("t.yaml", b"tokens:\n  a: [\n", "line 3, column 1", "invalid YAML"),
        ("t.json", b'{"tokens": }', "line 1, column 12", "invalid JSON"),
        ("t.yaml", b"", "", "empty"),
        ("t.yaml", b"# nothing\n", "", "empty"),
        ("t.yaml", b"tokens: {}\n# \xff\n", "byte 13", "not UTF-8"),
        ("t.yaml", b"#" * (MAX_TOKENS_FILE_BYTES + 1), "", "larger than"),
    ],
)
def test_an_unreadable_file_names_the_file_and_where(
    tmp_path: Path, name: str, content: bytes, where: str, words: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError) as caught:
        load_tokens(path)
    assert caught.value.source == str(path)
    assert [(p.where, words in p.message) for p in caught.value.problems] == [(where, True)], caught.value


def test_a_missing_file_says_it_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_tokens(tmp_path / "nope.yaml")


# -- scopes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("patterns", "service", "covered"),
    [
        (("web",), "web", True),
        (("web",), "web2", False),
        (("web",), "xweb", False),
        (("web-*",), "web-1", True),
        (("web-*",), "web-", True),
        (("web-*",), "web", False),
        (("web-*",), "xweb-1", False),
        (("*",), "anything.at-all", True),
        (("a?c",), "abc", True),
        (("a?c",), "ac", False),
        (("a.c",), "abc", False),  # '.' is a literal dot, not "any character"
        (("a.c",), "a.c", True),
        (("*.prod",), "api.prod", True),
        (("*.prod",), "api.prod.x", False),
        ((), "web", False),
        (("api", "web-*"), "web-9", True),
    ],
)
def test_write_scopes_are_names_and_globs_over_the_whole_name(
    patterns: tuple[str, ...], service: str, covered: bool
) -> None:
    assert TokenScope("t", b"\0" * 32, write=patterns).may_write(service) is covered


NAME_CHARS = "ab.-_*?"


@given(
    patterns=st.lists(st.text(NAME_CHARS, min_size=1, max_size=6), max_size=3),
    service=st.text("ab.-_", min_size=1, max_size=8),
)
def test_scope_matching_agrees_with_fnmatch(patterns: list[str], service: str) -> None:
    expected = any(fnmatch.fnmatchcase(service, p) for p in patterns)
    assert TokenScope("t", b"\0" * 32, write=tuple(patterns)).may_write(service) is expected


# -- decisions -------------------------------------------------------------------------------------

SCOPED = parse_tokens(document(), "t")
OPEN_READS = parse_tokens(document(reads="open"), "t")


def decide(
    access: Access, header: str | None, service: str | None = "web", tokens: TokenSet = SCOPED
) -> Allowed | Denied:
    return authorize(tokens, access, service, header, request="PUT /v1/services/web")


@pytest.mark.parametrize(
    ("access", "header", "service", "expected"),
    [
        (Access.OPEN, None, None, 200),
        (Access.WRITE, f"Bearer {WEB}", "web", 200),
        (Access.WRITE, f"bearer {WEB}", "web-7", 200),  # the scheme is case-insensitive (RFC 7235)
        (Access.WRITE, f"  Bearer   {WEB}  ", "web", 200),
        (Access.WRITE, f"Bearer {WEB}", "api", 403),
        (Access.WRITE, f"Bearer {READER}", "web", 403),
        (Access.WRITE, f"Bearer {ADMIN}", "web", 403),  # admin is not write
        (Access.WRITE, None, "web", 401),
        (Access.WRITE, "", "web", 401),
        (Access.WRITE, "Bearer", "web", 401),
        (Access.WRITE, "Bearer ", "web", 401),
        (Access.WRITE, WEB, "web", 401),  # no scheme
        (Access.WRITE, f"Basic {WEB}", "web", 401),
        (Access.WRITE, f"Bearer {WEB}x", "web", 401),
        (Access.WRITE, f"Bearer {WEB[:-1]}", "web", 401),
        (Access.WRITE, f"Bearer {WEB.upper()}", "web", 401),  # the token is case-sensitive
        (Access.WRITE, f"Bearer {hash_token(WEB)}", "web", 401),  # the digest is not the token
        (Access.READ, None, None, 401),
        (Access.READ, f"Bearer {READER}", None, 200),
        (Access.READ, f"Bearer {WEB}", None, 403),
        (Access.READ, f"Bearer {ADMIN}", None, 200),  # an operator's token reads what it changes
        (Access.ADMIN, f"Bearer {ADMIN}", None, 200),
        (Access.ADMIN, f"Bearer {READER}", None, 403),
        (Access.ADMIN, None, None, 401),
    ],
)
def test_decisions(access: Access, header: str | None, service: str | None, expected: int) -> None:
    decision = decide(access, header, service)
    assert (200 if isinstance(decision, Allowed) else decision.status) == expected, decision
    if isinstance(decision, Denied):
        assert decision.challenge.startswith("Bearer ")
        assert "PUT /v1/services/web" in decision.message


def test_open_reads_need_no_token_and_writes_still_do() -> None:
    assert decide(Access.READ, None, None, OPEN_READS) == Allowed(None)
    assert decide(Access.READ, "Bearer garbage", None, OPEN_READS) == Allowed(None)
    assert isinstance(decide(Access.WRITE, None, "web", OPEN_READS), Denied)
    assert isinstance(decide(Access.ADMIN, f"Bearer {READER}", None, OPEN_READS), Denied)


def test_a_403_names_the_token_and_its_scope_but_never_the_token_itself() -> None:
    decision = decide(Access.WRITE, f"Bearer {WEB}", "api")
    assert isinstance(decision, Denied) and decision.status == 403 and decision.token == "deploy-web"
    assert "'deploy-web' may not write service 'api'" in decision.message
    assert "web, web-*" in decision.message
    assert 'error="insufficient_scope"' in decision.challenge
    assert WEB not in decision.message


def test_a_401_says_what_to_send() -> None:
    missing = decide(Access.WRITE, None)
    assert isinstance(missing, Denied) and "Authorization: Bearer <token>" in missing.message
    unknown = decide(Access.WRITE, "Bearer nope")
    assert isinstance(unknown, Denied) and 'error="invalid_token"' in unknown.challenge


# -- following the file ----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.time = 100.0

    def __call__(self) -> float:
        return self.time


def write(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc))


def test_the_file_is_looked_at_once_a_second_and_changes_apply(tmp_path: Path) -> None:
    path, clock = tmp_path / "tokens.json", Clock()
    write(path, document())
    tokens = TokenFile(path, clock=clock)
    assert tokens.current().find(WEB) is not None
    revoked = document()
    del revoked["tokens"]["deploy-web"]
    write(path, revoked)
    assert tokens.current().find(WEB) is not None  # not looked at yet: within the second
    clock.time += 1.0
    assert tokens.current().find(WEB) is None
    assert tokens.current().find(READER) is not None


def test_a_bad_file_keeps_the_last_good_tokens_and_is_reported_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, clock, log = tmp_path / "tokens.json", Clock(), tmp_path / "events.jsonl"
    write(path, document())
    events = EventLog(log)
    tokens = TokenFile(path, clock=clock, events=events)
    write(path, document(reads="sometimes"))
    for _ in range(3):
        clock.time += 1.0
        assert tokens.current().find(WEB) is not None and not tokens.current().reads_open
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, caplog.text
    assert str(path) in errors[0].getMessage() and "reads: 'sometimes'" in errors[0].getMessage()
    assert "keeps the last good tokens" in errors[0].getMessage()
    events.close()
    recorded = [json.loads(x) for x in log.read_text().splitlines()]
    assert [e["event"] for e in recorded] == ["registry_tokens_error"]
    assert recorded[0]["file"] == str(path) and "reads" in recorded[0]["reason"]
    # Fixed: the new version is used, and the error is over.
    write(path, document(reads="open"))
    clock.time += 1.0
    assert tokens.current().reads_open and tokens.problem is None


def test_a_deleted_file_keeps_the_last_good_tokens(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path, clock = tmp_path / "tokens.json", Clock()
    write(path, document())
    tokens = TokenFile(path, clock=clock)
    path.unlink()
    clock.time += 1.0
    assert tokens.current().find(WEB) is not None
    assert "cannot read" in caplog.text and str(path) in caplog.text


def test_a_rewrite_that_keeps_inode_mtime_and_size_is_still_seen(tmp_path: Path) -> None:
    path, clock = tmp_path / "tokens.json", Clock()
    write(path, document())
    stat = path.stat()
    tokens = TokenFile(path, clock=clock)
    other = "tok-webX-0123456789"  # the same length: the file keeps its size
    changed = document()
    changed["tokens"]["deploy-web"]["sha256"] = hash_token(other)
    write(path, changed)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as if written within one timestamp tick
    assert path.stat().st_size == stat.st_size and path.stat().st_ino == stat.st_ino
    clock.time += 1.0
    assert tokens.current().find(other) is not None and tokens.current().find(WEB) is None


def test_a_bad_file_at_start_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text("tokens:\n  a:\n    sha256: abc\n")
    with pytest.raises(ConfigError, match=r"tokens\.a\.sha256"):
        TokenFile(path)


# -- the open API's warning, and the token command --------------------------------------------------


@pytest.mark.parametrize(
    ("host", "warns"),
    [
        ("127.0.0.1", False),
        ("::1", False),
        ("[::1]", False),
        ("localhost", False),
        ("127.0.0.2", False),
        ("0.0.0.0", True),
        ("", True),
        ("::", True),
        ("10.1.2.3", True),
        ("example.com", True),
    ],
)
def test_an_open_registry_warns_unless_on_loopback(host: str, warns: bool, caplog: pytest.LogCaptureFixture) -> None:
    assert warn_if_open(host) is warns
    assert ("accepts writes from anyone" in caplog.text) is warns


def test_token_new_prints_yaml_only_on_stdout_with_the_token_and_its_named_scoped_entry() -> None:
    out, err = io.StringIO(), io.StringIO()
    new = NewToken(name="deploy-web", write=("web", "web-*"), read=True)
    assert token_command("new", io.StringIO(), out, new=new, stderr=err) == 0
    printed = yaml.safe_load(out.getvalue())
    token = printed["token"]
    assert len(token) >= 40 and token not in err.getvalue()
    assert printed["tokens"] == {"deploy-web": {"sha256": hash_token(token), "write": ["web", "web-*"], "read": True}}
    scope = parse_tokens({"tokens": printed["tokens"]}, "t").find(token)
    assert scope is not None and scope.may_write("web-2") and not scope.may_write("api") and scope.read
    assert "tokens file" in err.getvalue()
    with pytest.raises(ConfigError, match="token"):  # stdout as a whole is not a tokens file: the secret stays out
        parse_tokens(printed, "t")


def test_token_hash_reads_one_line_without_its_ending() -> None:
    out = io.StringIO()
    assert token_command("hash", io.StringIO("abc\n"), out) == 0
    assert out.getvalue() == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad\n"  # sha256sum of "abc"
    assert token_command("hash", io.StringIO(""), io.StringIO()) == 2
