"""The gates a wave passes before the next one starts: every proxy ACKed (:class:`AckGate`), then its
error ratio stayed close to the baseline's while it baked (:func:`judge_health`).

**The ACK gate.** Its members are the proxies of the wave that are connected when the wave starts,
and those of the wave that connect while it waits. A member has *proven* the candidate once it
was sent at least one type of it and ACKed the candidate on every type it was sent. The gate
passes as soon as every member has (a wave with no member passes at once). NACKs do not pass
through here: the machine fails the rollout on the first NACK of the candidate from anyone.

At the ACK timeout (``timeout`` after the wave started) what is still open is decided:

- a connected member that was sent the candidate and has not ACKed it all fails the wave (it is
  stuck, or slow enough that no one should wait for it);
- a connected member that was sent nothing of the candidate passes (a change to routes it does not
  use leaves nothing to prove), reported as *not sent*;
- a member that disconnected without proving the candidate is *lost*: dropped from the gate and
  reported. A proxy restarting for unrelated reasons must not hold up, or fail, a rollout of
  hundreds; but a candidate that crashes Envoy makes every proxy that gets it disconnect, so the
  wave fails when more than ``max_lost`` of its members were lost (with the default 10 %, a lone
  canary that is lost fails its wave).

Until the timeout a disconnected member is waited for: Envoy reconnects within seconds after a
restart, is sent the candidate again and ACKs it.

**The health gate.** While the wave bakes, its proxies' requests (from LRS, :mod:`~pilotfish.rollout.load`)
are compared with the baseline proxies' over the same window, overall and per cluster. The error
ratio is ``errors / (successful + errors)``. A side decides nothing below ``min_requests`` completed
requests. Each ratio of the wave is compared with a *reference*:

- the baseline proxies over the same window, when they completed at least ``min_requests``;
  otherwise (the last wave leaves no baseline proxy; or the baseline is idle) the proxies that were
  on the baseline in the window of the same length *before* the wave started, which the machine
  froze then;
- per cluster: the reference's own figure for that cluster when it has ``min_requests`` of it;
  otherwise the reference's overall ratio. A cluster the baseline does not use (new in the
  candidate) is judged too, never skipped.

A ratio fails when it exceeds its reference by more than ``max_increase`` (absolute: 0.01 is one
percentage point) and, if ``max_factor`` is set, is also more than ``max_factor`` times it. The
absolute margin is what Flagger and Argo Rollouts analyses express (a success-rate threshold);
comparing with the baseline of the same window, as Spinnaker's canary analysis does, takes out what
the candidate did not cause (a backend failing for everybody). The optional factor keeps a tiny
ratio doubling (0.01 % to 0.02 %) from counting when the margin is set low.

The verdict: *fail* as soon as any judged ratio fails (the wave's proxies stop getting hurt as soon
as the evidence is there); *pass* once the overall ratio was judged and nothing failed; otherwise
*not enough traffic*, which the machine decides on at the end of the bake.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pilotfish.resources.types import type_by_url

__all__ = [
    "AckGate",
    "AckResult",
    "AckSettings",
    "Counts",
    "Finding",
    "Gate",
    "HealthResult",
    "HealthSettings",
    "judge_health",
    "short_type",
]


def short_type(type_url: str) -> str:
    """``CDS`` for the cluster type URL, and so on; the message name for a type pilotfish does not serve."""
    known = type_by_url(type_url)
    return known.short if known is not None else type_url.rsplit(".", 1)[-1]


class Gate(enum.Enum):
    """A gate's verdict."""

    PENDING = "pending"
    PASS = "pass"
    FAIL = "fail"
    NOT_ENOUGH = "not enough traffic"


# -- the ACK gate ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class AckSettings:
    """How long a wave waits for ACKs, and how many lost proxies it forgives."""

    timeout: float = 30.0
    """Seconds from the start of a wave within which its members must ACK the candidate."""
    max_lost: float = 0.1
    """The share of a wave's members that may disconnect without ACKing before the wave fails."""

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"the ACK timeout must be above 0 s, not {self.timeout}")
        if not 0 <= self.max_lost < 1:
            raise ValueError(f"the share of lost proxies a wave forgives is in [0, 1), not {self.max_lost}")


@dataclass(slots=True)
class _Member:
    connected: bool
    sent: set[str] = field(default_factory=set)
    acked: set[str] = field(default_factory=set)

    @property
    def proven(self) -> bool:
        return bool(self.sent) and self.sent <= self.acked


@dataclass(frozen=True, slots=True)
class AckResult:
    """The ACK gate's verdict, and who it left out."""

    verdict: Gate
    reason: str = ""
    """Why it failed ("edge-3 did not ACK CDS within 30 s")."""
    lost: tuple[str, ...] = ()
    """Members that disconnected without proving the candidate (decided at the timeout)."""
    not_sent: tuple[str, ...] = ()
    """Connected members that were sent nothing of the candidate (decided at the timeout)."""
    waiting: tuple[str, ...] = ()
    """Members still open (while pending)."""


class AckGate:
    """The ACK gate of one wave (see the module's docstring)."""

    def __init__(self, members: Iterable[str], started: float, settings: AckSettings) -> None:
        self.settings = settings
        self.started = started
        self._members = {node: _Member(connected=True) for node in members}
        self._unproven = set(self._members)
        """Members that have not proven the candidate yet (kept as ACKs come: one ACK costs O(1))."""

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def decided(self, now: float) -> bool:
        """Whether :meth:`judge` would say anything but PENDING at ``now`` (cheap: asked per ACK)."""
        return not self._unproven or now >= self.started + self.settings.timeout

    def _update(self, node_id: str, member: _Member) -> None:
        if member.proven:
            self._unproven.discard(node_id)
        else:
            self._unproven.add(node_id)

    def join(self, node_id: str) -> None:
        """A proxy of the wave connected (again) while the gate waits."""
        member = self._members.setdefault(node_id, _Member(connected=True))
        member.connected = True
        self._update(node_id, member)

    def leave(self, node_id: str) -> None:
        member = self._members.get(node_id)
        if member is not None:
            member.connected = False

    def sent(self, node_id: str, type_url: str) -> None:
        """``node_id`` was sent the candidate's ``type_url``."""
        member = self._members.get(node_id)
        if member is not None:
            member.sent.add(type_url)
            self._update(node_id, member)

    def acked(self, node_id: str, type_url: str) -> None:
        """``node_id`` ACKed the candidate's ``type_url`` (an ACK of a type not recorded as sent counts as
        sent and ACKed: the proxy has it)."""
        member = self._members.get(node_id)
        if member is not None:
            member.sent.add(type_url)
            member.acked.add(type_url)
            self._update(node_id, member)

    def judge(self, now: float) -> AckResult:
        open_ = sorted(self._unproven)
        if not open_:
            return AckResult(Gate.PASS)
        if now < self.started + self.settings.timeout:
            return AckResult(Gate.PENDING, waiting=tuple(open_))
        silent = [n for n in open_ if self._members[n].connected and self._members[n].sent]
        if silent:
            member = self._members[silent[0]]
            types = ", ".join(sorted(short_type(t) for t in member.sent - member.acked))
            more = f" (and {len(silent) - 1} more)" if len(silent) > 1 else ""
            return AckResult(Gate.FAIL, f"{silent[0]} did not ACK {types} within {self.settings.timeout:g} s{more}")
        lost = tuple(n for n in open_ if not self._members[n].connected)
        not_sent = tuple(n for n in open_ if self._members[n].connected)
        if lost and len(lost) > self.settings.max_lost * len(self._members):
            shown = ", ".join(lost[:3]) + (", ..." if len(lost) > 3 else "")
            return AckResult(
                Gate.FAIL,
                f"{len(lost)} of {len(self._members)} proxies disconnected before ACKing "
                f"({shown}); at most {self.settings.max_lost:.0%} may",
                lost=lost,
                not_sent=not_sent,
            )
        return AckResult(Gate.PASS, lost=lost, not_sent=not_sent)

    def to_dict(self) -> dict[str, Any]:
        return {
            "started": self.started,
            "members": {
                n: {"connected": m.connected, "sent": sorted(m.sent), "acked": sorted(m.acked)}
                for n, m in sorted(self._members.items())
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], settings: AckSettings) -> AckGate:
        gate = cls((), float(data["started"]), settings)
        for node, member in dict(data["members"]).items():
            gate._members[str(node)] = _Member(
                connected=bool(member["connected"]), sent=set(member["sent"]), acked=set(member["acked"])
            )
            gate._update(str(node), gate._members[str(node)])
        return gate


# -- the health gate -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Counts:
    """Requests over a window."""

    successful: int = 0
    errors: int = 0
    issued: int = 0
    dropped: int = 0

    @property
    def completed(self) -> int:
        return self.successful + self.errors

    @property
    def ratio(self) -> float:
        """The error ratio, errors over completed requests (0 with none)."""
        return self.errors / self.completed if self.completed else 0.0

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            self.successful + other.successful,
            self.errors + other.errors,
            self.issued + other.issued,
            self.dropped + other.dropped,
        )

    def to_list(self) -> list[int]:
        return [self.successful, self.errors, self.issued, self.dropped]

    @classmethod
    def from_list(cls, values: Iterable[int]) -> Counts:
        successful, errors, issued, dropped = (int(v) for v in values)
        return cls(successful, errors, issued, dropped)


def _sum(counts: Iterable[Counts]) -> Counts:
    total = Counts()
    for c in counts:
        total += c
    return total


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthSettings:
    """When a wave's error ratio is worse enough than the baseline's to fail it."""

    max_increase: float = 0.01
    """The absolute margin over the reference's ratio (0.01: one percentage point)."""
    max_factor: float | None = None
    """Also required to fail, when set: the ratio is more than this many times the reference's."""
    min_requests: int = 100
    """Completed requests a side needs, overall or for a cluster, before its ratio decides anything."""

    def __post_init__(self) -> None:
        if not 0 <= self.max_increase < 1:
            raise ValueError(
                f"the error-ratio margin is in [0, 1) (0.01 is one percentage point), not {self.max_increase}"
            )
        if self.max_factor is not None and not self.max_factor >= 1:
            raise ValueError(f"the error-ratio factor is at least 1, not {self.max_factor}")
        if self.min_requests < 1:
            raise ValueError(f"the minimum request count is at least 1, not {self.min_requests}")


@dataclass(frozen=True, slots=True)
class Finding:
    """One ratio judged: the wave's overall ("" cluster) or one cluster's."""

    cluster: str
    wave: Counts
    reference: Counts
    against: str
    """What the reference is: ``baseline``, ``baseline on cluster web``, ``baseline before the wave``..."""
    failed: bool


def _percent(ratio: float) -> str:
    return f"{ratio * 100:.1f} %"


@dataclass(frozen=True, slots=True)
class HealthResult:
    """The health gate's verdict over one window."""

    verdict: Gate
    reason: str
    """Why it failed, or why it could not judge; "" when it passed."""
    findings: tuple[Finding, ...] = ()
    wave: Counts = Counts()
    reference: Counts = Counts()


def _exceeds(wave: float, reference: float, settings: HealthSettings) -> bool:
    if wave - reference <= settings.max_increase:
        return False
    return settings.max_factor is None or wave > reference * settings.max_factor


def judge_health(
    wave: Mapping[str, Counts],
    baseline: Mapping[str, Counts],
    settings: HealthSettings,
    *,
    before: Mapping[str, Counts] | None = None,
) -> HealthResult:
    """Judge the wave's requests per cluster against the baseline's of the same window (``before``:
    the baseline's in the window before the wave, the reference when the baseline has too few)."""
    enough = settings.min_requests
    wave_total = _sum(wave.values())
    reference, label = baseline, "baseline"
    if _sum(baseline.values()).completed < enough and before is not None and _sum(before.values()).completed >= enough:
        reference, label = before, "baseline before the wave"
    reference_total = _sum(reference.values())
    if reference_total.completed < enough:
        return HealthResult(
            Gate.NOT_ENOUGH,
            f"the baseline completed {reference_total.completed} requests, at least "
            f"{enough} are needed to compare with",
            wave=wave_total,
            reference=reference_total,
        )
    findings = []
    if wave_total.completed >= enough:
        findings.append(
            Finding("", wave_total, reference_total, label, _exceeds(wave_total.ratio, reference_total.ratio, settings))
        )
    for cluster in sorted(wave):
        counts = wave[cluster]
        if counts.completed < enough:
            continue
        own = reference.get(cluster)
        if own is not None and own.completed >= enough:
            findings.append(
                Finding(
                    cluster, counts, own, f"{label} on cluster {cluster}", _exceeds(counts.ratio, own.ratio, settings)
                )
            )
        else:
            findings.append(
                Finding(
                    cluster,
                    counts,
                    reference_total,
                    f"{label} overall",
                    _exceeds(counts.ratio, reference_total.ratio, settings),
                )
            )
    failed = [f for f in findings if f.failed]
    if failed:
        worst = max(failed, key=lambda f: (f.wave.ratio - f.reference.ratio, bool(f.cluster)))  # a tie: the cluster
        where = f" on cluster {worst.cluster}" if worst.cluster else " overall"
        against = worst.against.removesuffix(f" on cluster {worst.cluster}") if worst.cluster else worst.against
        return HealthResult(
            Gate.FAIL,
            f"error ratio {_percent(worst.wave.ratio)} vs {_percent(worst.reference.ratio)} {against}{where}",
            tuple(findings),
            wave_total,
            reference_total,
        )
    if wave_total.completed < enough:
        return HealthResult(
            Gate.NOT_ENOUGH,
            f"the wave completed {wave_total.completed} requests, at least {enough} are needed to judge",
            tuple(findings),
            wave_total,
            reference_total,
        )
    return HealthResult(Gate.PASS, "", tuple(findings), wave_total, reference_total)
