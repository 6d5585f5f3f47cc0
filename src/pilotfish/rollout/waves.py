"""Waves: which proxies get a candidate first (``serve --rollout WAVES``).

``WAVES`` is a comma-separated list, in order. A *named* wave is ``NAME=PATTERN`` (a node-id glob,
``*`` standing for any run of characters except ``/``, as in ``--authorize-node``) or
``NAME=group:GROUP`` (every proxy of a node group); a *share* wave is ``P%``. Named waves come
first; then the shares, strictly increasing, ending at ``100%``. Example::

    canary=edge-canary-*,5%,25%,100%

A proxy is in the first named wave that matches it. Every other proxy has a *position* in [0, 1):
the first 64 bits of the SHA-256 of its node id, as a fraction. It is in the first share wave
whose share is above its position. So the shares are cumulative shares of the proxies outside the
named waves (``5%`` is the first 5 %, ``25%`` the next 20 %), and:

- a proxy's wave depends on its node id (and group) alone, never on who else is connected or in
  which order they came: a reconnect never moves it, and every replica agrees;
- the same proxies go first in every rollout (an SRE can watch those);
- raising a share only moves proxies into earlier waves, never out of them, as positions are fixed
  and the boundaries only grow.

The hash is not secret: a proxy that picks its own node id can pick its wave. Node ids are
authenticated by ``--authorize-node`` where that matters; a wave is about blast radius, not trust.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from pilotfish.policy.authorize import glob_match

__all__ = ["FLAG", "MAX_WAVES", "Wave", "WavePlan", "parse_waves", "position"]

FLAG = "--rollout"
"""The flag the waves come from, named in every error."""
MAX_WAVES = 16
"""Waves a plan may have: each is at least one bake time long."""
_EXAMPLE = "e.g. 'canary=edge-canary-*,5%,25%,100%' or 'canary=group:canary,10%,100%'"
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def position(node_id: str) -> float:
    """A proxy's fixed place in [0, 1) among the proxies outside the named waves."""
    digest = hashlib.sha256(node_id.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@dataclass(frozen=True, slots=True, kw_only=True)
class Wave:
    """One wave of a rollout."""

    name: str
    """How events and reasons name it: the NAME of a named wave, ``5%`` for a share wave."""
    pattern: str = ""
    """A named wave's node-id glob ("" for a group or a share wave)."""
    group: str = ""
    """A named wave's node group ("" for a glob or a share wave)."""
    share: float = 0.0
    """A share wave's cumulative share of the proxies outside the named waves, in (0, 1]; 0 for a
    named wave."""

    @property
    def named(self) -> bool:
        return self.share == 0.0

    def __str__(self) -> str:
        if self.group:
            return f"{self.name}=group:{self.group}"
        return f"{self.name}={self.pattern}" if self.pattern else self.name


@dataclass(frozen=True, slots=True)
class WavePlan:
    """The waves of a rollout, in order; the last takes every proxy left."""

    waves: tuple[Wave, ...]

    def assign(self, node_id: str, group: str = "") -> int:
        """The index of ``node_id``'s wave (``group``: its node group)."""
        for index, wave in enumerate(self.waves):
            if wave.named:
                if (wave.group and wave.group == group) or (wave.pattern and glob_match(wave.pattern, node_id)):
                    return index
                continue
            place = position(node_id)
            for later in range(index, len(self.waves)):
                if place < self.waves[later].share:
                    return later
            break
        return len(self.waves) - 1  # (a position is below 1.0, the last share, so not reached)

    def __len__(self) -> int:
        return len(self.waves)

    def __str__(self) -> str:
        return ",".join(str(w) for w in self.waves)


def _share(text: str, whole: str) -> float:
    number = text[:-1].strip()
    try:
        value = float(number)
    except ValueError:
        raise ValueError(
            f"{FLAG} {whole!r}: {text!r} is not a share; write a percentage such as '5%' ({_EXAMPLE})"
        ) from None
    if not math.isfinite(value) or not 0 < value <= 100:
        raise ValueError(f"{FLAG} {whole!r}: {text!r}: a share is above 0% and at most 100%")
    return value / 100


def parse_waves(text: str) -> WavePlan:
    """``NAME=PATTERN``, ``NAME=group:GROUP`` and ``P%`` waves, comma-separated -> a plan;
    ValueError naming the flag, the part at fault and what to write instead."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise ValueError(f"{FLAG} {text!r}: an empty wave; list waves separated by commas ({_EXAMPLE})")
    if len(parts) > MAX_WAVES:
        raise ValueError(f"{FLAG} {text!r}: {len(parts)} waves, at most {MAX_WAVES}")
    waves: list[Wave] = []
    names: set[str] = set()
    for part in parts:
        if part.endswith("%"):
            share = _share(part, text)
            previous = [w.share for w in waves if not w.named]
            if previous and share <= previous[-1]:
                raise ValueError(
                    f"{FLAG} {text!r}: {part!r} follows {previous[-1] * 100:g}%; shares are cumulative "
                    "and must increase (e.g. '5%,25%,100%')"
                )
            wave = Wave(name=f"{share * 100:g}%", share=share)
        else:
            name, sep, rule = part.partition("=")
            name, rule = name.strip(), rule.strip()
            if not sep or not name or not rule:
                raise ValueError(
                    f"{FLAG} {text!r}: {part!r} is neither NAME=PATTERN, NAME=group:GROUP nor a "
                    f"share like '5%' ({_EXAMPLE})"
                )
            if not set(name) <= _NAME_CHARS:
                raise ValueError(f"{FLAG} {text!r}: the wave name {name!r} uses letters, digits, '-', '_' and '.' only")
            if any(not w.named for w in waves):
                raise ValueError(
                    f"{FLAG} {text!r}: the named wave {name!r} follows a share; named waves come first ({_EXAMPLE})"
                )
            if rule.startswith("group:"):
                group = rule.removeprefix("group:").strip()
                if not group or not set(group) <= _NAME_CHARS:
                    raise ValueError(
                        f"{FLAG} {text!r}: {part!r}: a group name (as in --node-group) uses letters, "
                        "digits, '-', '_' and '.'"
                    )
                wave = Wave(name=name, group=group)
            else:
                wave = Wave(name=name, pattern=rule)
        if wave.name in names:
            raise ValueError(f"{FLAG} {text!r}: two waves are called {wave.name!r}")
        names.add(wave.name)
        waves.append(wave)
    if waves[-1].named or waves[-1].share != 1.0:
        raise ValueError(
            f"{FLAG} {text!r}: the last wave must be '100%' (every proxy gets the change in the end); add ',100%'"
        )
    return WavePlan(tuple(waves))
