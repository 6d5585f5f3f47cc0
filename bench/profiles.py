"""Where the server's time goes: summaries of py-spy's raw (collapsed stack) output.

py-spy ``record --format raw`` writes one line per distinct stack: ``frame;frame;...;leaf COUNT``,
each frame ``function (file:line)``. :func:`summarize` folds line numbers away and reports, per
function, its *own* share of samples (it was the leaf) and its *inclusive* share (it was anywhere
on the stack, counted once per sample), as percentages of all samples.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

__all__ = ["summarize", "summary_table"]

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]*)(?::\d+)?\)$")


def _name(frame: str) -> str:
    match = _FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    path = match["file"]
    for marker in ("site-packages/", "src/", "lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{match['func']} ({path})"


def summarize(raw: Path) -> tuple[int, Counter[str], Counter[str]]:
    """(samples, own samples per function, inclusive samples per function)."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [
            _name(f) for f in stack.split(";") if f and not f.startswith("process ") and not f.startswith("thread ")
        ]
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        for name in set(frames):
            inclusive[name] += count
    return total, own, inclusive


def summary_table(raw: Path, limit: int = 15) -> str:
    """Markdown: top functions by own time, then by inclusive time."""
    total, own, inclusive = summarize(raw)
    if not total:
        return f"(no samples in {raw})"
    lines = [f"{total} samples", "", "| own % | function |", "|---|---|"]
    lines += [f"| {100 * n / total:.1f} | `{name}` |" for name, n in own.most_common(limit)]
    lines += ["", "| inclusive % | function |", "|---|---|"]
    lines += [f"| {100 * n / total:.1f} | `{name}` |" for name, n in inclusive.most_common(limit + 10)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary_table(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 15))
