"""Another commit of pilotfish, checked out beside this one, for a before/after run.

:func:`checkout` makes a detached ``git worktree`` of a commit in a temporary directory and
removes it afterwards (also when the benchmark fails). A benchmark runs that commit's server as
``python -m pilotfish serve`` with the checkout's ``src`` first on ``PYTHONPATH``
(:func:`pythonpath_env`), so both servers run from the same venv and differ only in their code.
The server is started with the options this checkout's benchmarks pass: a commit that lacks one
of them cannot be compared this way (its numbers stand in BENCHMARKS.md as measured then).

An in-process benchmark (one that imports pilotfish, such as bench/bench_build.py) runs in a
child process with ``own_bench``: the checkout's own ``bench`` package beside its ``src`` (and the
checkout as the working directory), so the benchmark's imports match the code it measures, where
this checkout's benchmark may import modules the other commit has elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from bench.procs import REPO

__all__ = ["checkout", "pythonpath_env", "revision"]


@contextlib.contextmanager
def checkout(commit: str) -> Iterator[Path]:
    """A detached git worktree of ``commit`` in a temporary directory, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="pilotfish-before-") as tmp:
        path = Path(tmp) / "checkout"
        subprocess.run(
            ["git", "worktree", "add", "--detach", "--quiet", str(path), commit],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        try:
            yield path
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(path)], cwd=REPO, check=False, capture_output=True
            )
            subprocess.run(["git", "worktree", "prune"], cwd=REPO, check=False, capture_output=True)


def pythonpath_env(path: Path, *, own_bench: bool = False) -> dict[str, str]:
    """The environment that runs the checkout at ``path``: its ``src`` first on ``PYTHONPATH``, then
    this checkout's ``bench`` (``own_bench``: the checkout's own; run the child in ``path`` then,
    since ``python -m`` puts the working directory first on ``sys.path``)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(path / "src"), str(path if own_bench else REPO)])}


def revision(path: Path) -> tuple[str, bool]:
    """The checkout at ``path``: its HEAD's short hash, and whether its ``src`` has uncommitted
    changes (what the numbers measured). OSError or CalledProcessError outside a git checkout."""
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=path, capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "src"], cwd=path, capture_output=True, text=True, check=True
    ).stdout.strip()
    return head, bool(dirty)
