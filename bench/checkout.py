"""Another commit of pilotfish, checked out beside this one, for a before/after run.

:func:`checkout` makes a detached ``git worktree`` of a commit in a temporary directory and
removes it afterwards (also when the benchmark fails). A benchmark runs that commit's server as
``python -m pilotfish serve`` with the checkout's ``src`` first on ``PYTHONPATH``
(:func:`pythonpath_env`), so both servers run from the same venv and differ only in their code.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from bench.procs import REPO

__all__ = ["checkout", "pythonpath_env"]


@contextlib.contextmanager
def checkout(commit: str) -> Iterator[Path]:
    """A detached git worktree of ``commit`` in a temporary directory, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="pilotfish-before-") as tmp:
        path = Path(tmp) / "checkout"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(path), commit], cwd=REPO, check=True,
                       capture_output=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO, check=False,
                           capture_output=True)
            subprocess.run(["git", "worktree", "prune"], cwd=REPO, check=False, capture_output=True)


def pythonpath_env(path: Path) -> dict[str, str]:
    """The environment that runs the checkout at ``path``: its ``src`` first on ``PYTHONPATH``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(path / "src"), str(REPO)])}
