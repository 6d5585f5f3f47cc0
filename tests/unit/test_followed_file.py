"""A settings file followed as it changes (pilotfish.followed_file): reading it names the file and
where in it a problem is; while a version is bad the last good value stays in force; a fixed or
changed file applies; the file is looked at at most once per ``every`` seconds.

The kind of file here is a list of port numbers, as a subclass says (the registry tokens, SDS grants
and admin tokens files are the real ones, each with its own tests)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from pilotfish.errors import ConfigError, Problem
from pilotfish.events import EventLog, RecentEvents
from pilotfish.followed_file import FollowedFile, read_document


class Ports(FollowedFile[tuple[int, ...]]):
    what = "ports file"
    event = "grants"  # an event of the contract: grants_loaded and grants_error
    empty = "list the ports"

    def parse(self, document: Any, source: str) -> tuple[int, ...]:
        if not isinstance(document, list) or not all(isinstance(p, int) for p in document):
            raise ConfigError(source, [Problem("ports", "expected a list of port numbers")])
        return tuple(document)

    def summary(self, value: tuple[int, ...]) -> dict[str, object]:
        return {"grants": len(value)}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def write(path: Path, text: str | bytes) -> None:
    """Replace the file (a new inode, as editors and config management write)."""
    temp = path.with_suffix(".tmp")
    temp.write_bytes(text.encode() if isinstance(text, str) else text)
    os.replace(temp, path)


def events(log: EventLog) -> list[str]:
    assert log.recent is not None
    return [json.loads(line)["event"] for _, line in log.recent.since(0)]


@pytest.mark.parametrize(
    ("name", "content", "where", "says"),
    [
        ("a.yaml", b"", "", "the file is empty; list the ports"),
        ("a.yaml", b"ports: [1, 2\n", "line 2, column 1", "invalid YAML"),
        ("a.json", b'{"ports": [1,]}', "line 1, column 14", "invalid JSON"),
        ("a.yaml", b"ports: \xff\n", "byte 7", "not UTF-8: save the file as UTF-8"),
        ("a.yaml", b"x" * 2000, "", "larger than 1000 bytes"),
    ],
)
def test_a_file_that_cannot_be_read_is_an_error_naming_the_file_and_where(
    tmp_path: Path, name: str, content: bytes, where: str, says: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError) as caught:
        read_document(path, max_bytes=1000, empty="list the ports")
    [problem] = caught.value.problems
    assert caught.value.source == str(path) and problem.where == where and says in problem.message, problem
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match="cannot read: No such file"):
        read_document(missing, empty="list the ports")


def test_a_bad_file_at_start_is_an_error_there_is_no_last_good_value(tmp_path: Path) -> None:
    path = tmp_path / "ports.yaml"
    write(path, "ports: 8080\n")
    with pytest.raises(ConfigError, match=r"ports: expected a list of port numbers"):
        Ports(path)


def test_a_bad_version_keeps_the_last_good_value_and_a_fixed_one_applies(tmp_path: Path) -> None:
    path = tmp_path / "ports.yaml"
    write(path, "[8080]\n")
    log = EventLog(recent=RecentEvents())
    followed = Ports(path, events=log, every=1.0, clock=(clock := Clock()))
    applied: list[tuple[int, ...]] = []
    followed.on_change = applied.append
    assert followed.current() == (8080,) and followed.problem is None

    write(path, "ports: oops\n")
    assert followed.current() == (8080,)  # not looked at yet: less than a second went by
    clock.now += 1
    assert followed.current() == (8080,)  # looked at: bad, so the last good value stays in force
    assert followed.problem is not None and followed.problem.source == str(path)
    assert events(log) == ["grants_error"]

    write(path, "[8080, 9090]\n")
    clock.now += 1
    assert followed.current() == (8080, 9090) and followed.problem is None
    assert applied == [(8080, 9090)]
    assert events(log) == ["grants_error", "grants_loaded"]

    write(path, "[8080, 9090]\n")  # rewritten, the same value: nothing to apply
    assert followed.refresh() is False and applied == [(8080, 9090)]
