"""Where two texts differ: the one run of characters an edit replaced, found by comparing blocks.

A file that was edited in one place is the same text before and after that place. Comparing whole
blocks of the two texts (C string comparisons, a few microseconds per 64 K characters) finds the
first and last characters that differ without a Python step per character, so knowing what an
edit of a 2.5 MB file changed costs about a millisecond.
"""

from __future__ import annotations

__all__ = ["changed_region"]

_BLOCK = 1 << 16
"""Characters compared by one call, before the search narrows down inside a block that differs."""


def changed_region(old: str, new: str) -> tuple[int, int, int]:
    """``(start, old_end, new_end)``: ``new`` is ``old`` with ``old[start:old_end]`` replaced by
    ``new[start:new_end]``, and that run is as short as the texts allow (what comes before it is
    the longest common prefix; what comes after it, the longest common suffix of the rest)."""
    start = _common_prefix(old, new, min(len(old), len(new)))
    limit = min(len(old), len(new)) - start
    tail = _common_suffix(old, new, limit)
    return start, len(old) - tail, len(new) - tail


def _common_prefix(a: str, b: str, limit: int) -> int:
    """The length of the longest common prefix of ``a`` and ``b``, at most ``limit``."""
    at = 0
    while at < limit:
        step = min(_BLOCK, limit - at)
        if a[at : at + step] == b[at : at + step]:
            at += step
            continue
        low, high = at, at + step  # a[:low] == b[:low]; a[low:high] != b[low:high]
        while high - low > 1:
            middle = (low + high) // 2
            if a[low:middle] == b[low:middle]:
                low = middle
            else:
                high = middle
        return low
    return limit


def _common_suffix(a: str, b: str, limit: int) -> int:
    """The length of the longest common suffix of ``a`` and ``b``, at most ``limit``."""
    la, lb = len(a), len(b)
    done = 0
    while done < limit:
        step = min(_BLOCK, limit - done)
        if a[la - done - step : la - done] == b[lb - done - step : lb - done]:
            done += step
            continue
        low, high = done, done + step  # the last ``low`` are equal; the last ``high`` are not
        while high - low > 1:
            middle = (low + high) // 2
            if a[la - middle : la - low] == b[lb - middle : lb - low]:
                low = middle
            else:
                high = middle
        return low
    return limit
