"""The README and docs/ as a user meets them: every `pilotfish` command in the README's code blocks
names a real subcommand and real flags, and every relative link points at a file (and heading)
that exists."""

from __future__ import annotations

import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

_FENCE = re.compile(r"^```([a-z]*)\n(.*?)^```", re.S | re.M)
_COMMAND = re.compile(r"(?:^|[\s(|;&/])pilotfish ((?:[a-z][a-z-]*)(?: .*)?)$")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} (.+)$", re.M)


def readme_commands() -> list[tuple[str, list[str]]]:
    """(subcommand, flags) of every `pilotfish ...` line in the README's shell code blocks."""
    found = []
    for language, block in _FENCE.findall(README.read_text()):
        if language not in ("sh", "bash", "console"):
            continue
        for line in block.splitlines():
            match = _COMMAND.search(line.split("#", 1)[0].rstrip())
            if match:
                words = match[1].split()
                found.append((words[0], [w.split("=", 1)[0] for w in words[1:] if w.startswith("--")]))
    return found


@cache
def help_text(subcommand: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pilotfish", subcommand, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "src")},
    )
    assert done.returncode == 0, f"`pilotfish {subcommand} --help` failed:\n{done.stderr}"
    return done.stdout


def test_the_readme_shows_pilotfish_commands() -> None:
    assert {name for name, _ in readme_commands()} >= {"serve", "status", "wait"}


@pytest.mark.parametrize(
    ("subcommand", "flags"), readme_commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else v
)
def test_every_readme_command_names_a_subcommand_and_flags_it_takes(subcommand: str, flags: list[str]) -> None:
    text = help_text(subcommand)
    missing = [flag for flag in flags if not re.search(rf"{re.escape(flag)}\b", text)]
    assert not missing, f"`pilotfish {subcommand}` takes no {missing}; its --help:\n{text}"


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    return {slug(h) for h in _HEADING.findall(text)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_points_at_something_that_exists(page: Path) -> None:
    broken = []
    for target in _LINK.findall(_FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file})")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no heading #{anchor} in {file.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"
