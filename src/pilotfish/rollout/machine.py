"""The rollout state machine: which proxies get the candidate, when the next wave starts, and when the
candidate is rolled back and held (docs/rollout.md).

Two snapshots matter. The *baseline* is the last one the whole fleet was promoted to; the
*candidate* is a newer one that passed validation and the guard. While a rollout runs, the
proxies of the current wave and of every earlier wave (:mod:`~pilotfish.rollout.waves`) are
served the candidate, every other proxy the baseline. The machine never sees a snapshot: a change
is an opaque *change id* (the content hash of the types that roll out, over every node group)
and the types that changed; the caller keeps the snapshots and asks :meth:`RolloutMachine.serves`
which one a proxy gets.

Inputs are method calls with the time (``now``, from the caller's clock: wall time if the state is
shared between replicas); each returns a :class:`Step`: the events that happened, in order, as
values the caller emits, and the connected proxies whose served change moved (their streams must be
woken). The machine does no I/O and keeps no clock.

Transitions (phase ``idle``: no candidate, every proxy on the baseline; ``acking``: the current wave
waits for ACKs; ``baking``: it bakes while its health is watched)::

    phase     input                                   next      events
    any       offer: no rollout type changed          same      (none: the change reaches baseline and candidate alike)
    any       offer: first change ever                idle      rollout_baseline_set
    any       offer: the baseline again               idle      rollout_superseded (if one ran)
    any       offer: a held candidate                 idle      rollout_superseded (if one ran), rollout_held
    any       offer: a new candidate                  acking    rollout_superseded (if one ran), rollout_started,
                                                                rollout_wave_started
    acking    every member ACKed (or timeout passes)  baking    rollout_wave_acked
    acking    the wave has no member                  acking+1  rollout_wave_passed, rollout_wave_started
    acking    ACK timeout: a member silent, or        idle      rollout_failed, rollout_rolled_back
              too many lost
    any run   a NACK of the candidate, from anyone    idle      rollout_failed, rollout_rolled_back
    baking    health fails (any time in the bake)     idle      rollout_failed, rollout_rolled_back
    baking    bake over, healthy, not paused          acking+1  rollout_wave_passed, rollout_wave_started
                                                      (idle)    (last wave: rollout_wave_passed, rollout_completed)
    baking    bake over, too little traffic           baking    rollout_paused (with too_little_traffic="pause")
    any run   promote                                 acking+1  rollout_promoted, rollout_wave_passed, ...
    any run   pause / resume                          same      rollout_paused / rollout_resumed
    any run   abort                                   idle      rollout_aborted, rollout_rolled_back

*Pause* stops only the start of the next wave: ACKs are still awaited, health still watched, and a
failing gate still rolls back (a paused rollout must not keep hurting its proxies). Resuming after
a pause for too little traffic starts the bake again, so the new window can gather requests. The
operator's pause outlives a superseded rollout: the newer candidate's first wave starts, and the
rollout stays paused there (an operator who paused wants nothing to spread until they resume).

*Failure* holds the candidate with its reason (``wave canary: edge-3 NACKed CDS: ...``): every proxy
that had it is served the baseline again, no proxy is sent it again (a proxy that connects later
gets the baseline), and offering it again changes nothing but a ``rollout_held`` event. Only a
different change starts a new rollout.

*Superseding.* A new change while a rollout runs (or while a candidate is held) starts a new rollout
from the baseline, the last fully promoted snapshot: never from the candidate in progress, which
proved nothing yet. The superseded candidate is not held (nothing failed); proxies of later waves
that had it go back to the baseline until their wave comes again.

*Endpoints.* Only changes to the rollout types (CDS, LDS, RDS and SDS by default, ``--rollout-types``)
roll out in waves; a change to the other types (EDS) is applied to the baseline and the candidate
alike (:attr:`Decision.BOTH`): endpoint churn must never wait behind a bake.

*Proxies and the ACK gate.* A proxy not connected when its wave starts is skipped (reported in
``rollout_wave_started``) and gets the candidate when it connects; if it connects while the wave
still waits for ACKs, it joins the gate. See :mod:`~pilotfish.rollout.gates` for lost proxies.

*State.* :meth:`RolloutMachine.to_dict` is a JSON-able, versioned dict of everything but the live
connections: baseline, candidate, wave, phase, timers, the ACK gate, the frozen reference, and
the held candidates with their reasons (at most ``max_held``, the newest kept). A replica restored
from it (:meth:`RolloutMachine.from_dict`) never serves a held candidate.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Protocol

from pilotfish.errors import shorten
from pilotfish.events import EVENTS as ALL_EVENTS
from pilotfish.events import EventSpec
from pilotfish.resources.types import CLUSTER, EXTENSION_CONFIG, LISTENER, ROUTE, RUNTIME, SECRET, TYPES
from pilotfish.rollout.gates import (
    AckGate,
    AckSettings,
    Counts,
    Gate,
    HealthResult,
    HealthSettings,
    judge_health,
    short_type,
)
from pilotfish.rollout.waves import WavePlan

__all__ = [
    "DEFAULT_TYPES",
    "EVENTS",
    "STATE_VERSION",
    "CommandRefused",
    "Decision",
    "Event",
    "Held",
    "LoadWindow",
    "Phase",
    "RolloutMachine",
    "RolloutSettings",
    "Step",
    "parse_rollout_types",
]

DEFAULT_TYPES: frozenset[str] = frozenset(
    {CLUSTER.url, EXTENSION_CONFIG.url, LISTENER.url, ROUTE.url, SECRET.url, RUNTIME.url}
)
"""The types that roll out in waves unless ``--rollout-types`` says otherwise: all but EDS (a runtime
flag flipped or a filter's config changed is a change like any other, and goes wave by wave too)."""
STATE_VERSION = 1
"""The version of :meth:`RolloutMachine.to_dict`'s format."""
_SHOWN = 10  # node ids listed in an event; the count says how many there were
_OPERATOR = "operator"  # RolloutMachine.paused when the operator paused

EVENTS: Mapping[str, EventSpec] = MappingProxyType(
    {kind: spec for kind, spec in ALL_EVENTS.items() if kind.startswith("rollout_")}
)
"""Every event the machine returns, with what it means and its fields (some only sometimes: the
health figures of ``rollout_wave_passed``): the rollout's part of the event log's contract."""


def parse_rollout_types(text: str) -> frozenset[str]:
    """``CDS,LDS`` or ``clusters,listeners`` (any mix, any case) -> type URLs; ValueError naming the flag."""
    names = {t.short.lower(): t.url for t in TYPES} | {t.key: t.url for t in TYPES}
    found: set[str] = set()
    for part in (p.strip().lower() for p in text.split(",")):
        if part not in names:
            known = ", ".join(t.short for t in TYPES)
            raise ValueError(
                f"--rollout-types {text!r}: {part!r} is not a type; use {known} (or clusters, "
                f"endpoints, extension_configs, listeners, routes, secrets, runtime), comma-separated"
            )
        found.add(names[part])
    return frozenset(found)


class Phase(enum.Enum):
    """Where a rollout is."""

    IDLE = "idle"
    """No candidate: every proxy is served the baseline."""
    ACKING = "acking"
    """The current wave was served the candidate and its ACKs are awaited."""
    BAKING = "baking"
    """The current wave ACKed; it bakes while its health is watched."""


class Decision(enum.Enum):
    """What :meth:`RolloutMachine.offer` decided about a change."""

    BOTH = "both"
    """No rollout type changed: apply the change to the baseline and the candidate alike."""
    INITIAL = "initial"
    """There was no baseline: this change is it, served to every proxy."""
    ROLL_OUT = "roll out"
    """The change is the new candidate; its first wave started."""
    UNCHANGED = "unchanged"
    """The change is the candidate already rolling out."""
    BASELINE = "baseline"
    """The change is the baseline: every proxy is served it (a rollout in progress was superseded)."""
    HELD = "held"
    """The change is a held candidate: it is not served; every proxy gets the baseline."""


@dataclass(frozen=True, slots=True)
class Event:
    """Something that happened; the caller emits it (``events.emit(e.kind, **e.fields)``)."""

    kind: str
    fields: Mapping[str, Any]
    """JSON-able values."""


@dataclass(frozen=True, slots=True)
class Step:
    """What one input did."""

    events: tuple[Event, ...] = ()
    wake: frozenset[str] = frozenset()
    """Connected proxies whose served change moved (baseline <-> candidate)."""
    decision: Decision | None = None
    """For :meth:`RolloutMachine.offer`: what it decided."""

    @property
    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]


class CommandRefused(ValueError):
    """An operator command that does not apply now (the message says why and what does)."""


class LoadWindow(Protocol):
    """Request counts per cluster over a window, by the proxies' waves
    (:class:`~pilotfish.rollout.load.LoadStore`)."""

    @property
    def retention(self) -> float:
        """Seconds of history it keeps."""

    def window(self, waves: Iterable[int], start: float, end: float | None = None) -> dict[str, Counts]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutSettings:
    """How a rollout proceeds (``serve --rollout`` and its companions)."""

    waves: WavePlan
    """The waves, in order (``--rollout``)."""
    types: frozenset[str] = DEFAULT_TYPES
    """Type URLs whose changes roll out in waves; changes to the others reach every proxy at once
    (``--rollout-types``)."""
    ack: AckSettings = field(default_factory=AckSettings)
    """The ACK timeout and how many lost proxies a wave forgives."""
    bake: float = 30.0
    """Seconds a wave bakes after it ACKed, while its health is watched."""
    health: HealthSettings | None = field(default_factory=HealthSettings)
    """When a wave's error ratio fails it; None: no load reports, a bake is only time."""
    too_little_traffic: Literal["pause", "pass"] = "pause"
    """A wave whose bake ends with too few requests to judge its health: ``pause`` the rollout (an
    operator promotes or aborts it) or let it ``pass`` on its ACKs."""
    max_held: int = 64
    """Held candidates remembered (the newest); an older one offered again would roll out again."""
    max_gone: int = 10_000
    """Disconnected proxies remembered, to report them as skipped when their wave starts."""

    def __post_init__(self) -> None:
        if not self.waves.waves:
            raise ValueError("--rollout: at least one wave")
        if not self.bake >= 0:
            raise ValueError(f"the bake time is at least 0 s, not {self.bake}")
        if not self.types:
            raise ValueError("--rollout-types: at least one type")
        if self.too_little_traffic not in ("pause", "pass"):
            raise ValueError(f"too_little_traffic is 'pause' or 'pass', not {self.too_little_traffic!r}")


@dataclass(frozen=True, slots=True)
class Held:
    """A candidate that failed: never served again."""

    reason: str
    at: float


@dataclass(slots=True)
class _Proxy:
    group: str
    wave: int
    streams: int = 1


def _node_list(nodes: Iterable[str]) -> list[str]:
    listed = sorted(nodes)
    return listed[:_SHOWN]


class RolloutMachine:
    """Rollouts of candidates over the waves of ``settings`` (see the module's docstring).

    ``loads``: where the health gate reads requests (None, or ``settings.health`` None: no health
    gate). ``state``: a dict from :meth:`to_dict` to start from."""

    def __init__(
        self, settings: RolloutSettings, *, loads: LoadWindow | None = None, state: Mapping[str, Any] | None = None
    ) -> None:
        self.settings = settings
        self._loads = loads
        self._connected: dict[str, _Proxy] = {}
        self._gone: OrderedDict[str, int] = OrderedDict()  # node id -> wave, oldest first
        self._clear()
        needed = settings.ack.timeout + settings.bake
        if loads is not None and settings.health is not None and loads.retention < needed:
            raise ValueError(
                f"the load store keeps {loads.retention:g} s of load reports, and a wave reads up to "
                f"its ACK timeout plus its bake time ({needed:g} s) of them: keep at least that much"
            )
        if state is not None:
            self._restore(state)

    def _clear(self) -> None:
        """No baseline, no candidate, nothing held (the live connections are kept)."""
        self.baseline: str | None = None
        self.candidate: str | None = None
        self.phase = Phase.IDLE
        self.wave = 0
        self.wave_started = 0.0
        self.bake_started = 0.0
        self.paused: str | None = None
        """Why the rollout is paused ("operator", or too little traffic's reason); None: it is not."""
        self._paused_for_traffic = False
        self.held: OrderedDict[str, Held] = OrderedDict()
        self._gate: AckGate | None = None
        self._before: dict[str, Counts] = {}
        self.last_health: HealthResult | None = None

    def adopt(self, state: Mapping[str, Any]) -> Step:
        """Take ``state`` (another replica's :meth:`to_dict`: the one that decides) as this machine's,
        keeping the live connections; the step says whose served change moved."""
        with _Recorder(self) as step:
            self._clear()
            self._restore(state)
        return step.done()

    # -- what a proxy gets -------------------------------------------------------------------------

    def wave_of(self, node_id: str, group: str = "") -> int:
        proxy = self._connected.get(node_id)
        return proxy.wave if proxy is not None else self.settings.waves.assign(node_id, group)

    def serves(self, node_id: str, group: str = "") -> str | None:
        """The change id ``node_id`` is to be served: the candidate if its wave has started, else the
        baseline (None before the first change)."""
        if self.candidate is not None and self.wave_of(node_id, group) <= self.wave:
            return self.candidate
        return self.baseline

    @property
    def running(self) -> bool:
        return self.candidate is not None

    @property
    def wave_name(self) -> str:
        return self.settings.waves.waves[self.wave].name

    # -- inputs --------------------------------------------------------------------------------------

    def offer(self, change_id: str, changed: Iterable[str], now: float) -> Step:
        """A new snapshot passed validation and the guard: ``change_id`` identifies the content of its
        rollout types, ``changed`` are the type URLs that differ from the previous offer."""
        with _Recorder(self) as step:
            rolled = set(changed) & self.settings.types
            decision = step.decision = self.would_offer(change_id, rolled)
            if decision is Decision.INITIAL:
                self.baseline = change_id
                step.event("rollout_baseline_set", baseline=change_id)
            elif decision in (Decision.BASELINE, Decision.HELD):
                self._supersede(step, change_id)
                if decision is Decision.HELD:
                    step.event("rollout_held", candidate=change_id, reason=self.held[change_id].reason)
            elif decision is Decision.ROLL_OUT:
                frozen = self.paused == _OPERATOR
                self._supersede(step, change_id)
                self.candidate = change_id
                step.event(
                    "rollout_started",
                    candidate=change_id,
                    baseline=self.baseline,
                    waves=[w.name for w in self.settings.waves.waves],
                    types=sorted(short_type(t) for t in rolled),
                )
                self._start_wave(step, 0, now)
                if frozen:  # the operator's pause outlives the rollout it was given in, as a freeze
                    self.paused = _OPERATOR
                    step.event(
                        "rollout_paused",
                        candidate=change_id,
                        wave=self.wave_name,
                        reason="still paused by the operator: the superseded rollout was",
                    )
                self._advance(step, now)
        return step.done()

    def would_offer(self, change_id: str, changed: Iterable[str]) -> Decision:
        """What :meth:`offer` would decide about this change now, changing nothing (``pilotfish plan``)."""
        if self.baseline is None:
            return Decision.INITIAL
        if not set(changed) & self.settings.types:
            return Decision.BOTH
        if change_id == self.candidate:
            return Decision.UNCHANGED
        if change_id == self.baseline:
            return Decision.BASELINE
        if change_id in self.held:
            return Decision.HELD
        return Decision.ROLL_OUT

    def wave_sizes(self) -> list[int]:
        """How many connected proxies each wave has, in order."""
        sizes = [0] * len(self.settings.waves)
        for proxy in self._connected.values():
            sizes[proxy.wave] += 1
        return sizes

    @property
    def paused_by_operator(self) -> bool:
        """The operator paused (a new rollout would stay paused at its first wave)."""
        return self.paused == _OPERATOR

    def connected(self, node_id: str, group: str, now: float) -> Step:
        """A stream of ``node_id`` (in node group ``group``) opened."""
        with _Recorder(self) as step:
            proxy = self._connected.get(node_id)
            wave = self.settings.waves.assign(node_id, group)
            if proxy is None:
                self._connected[node_id] = _Proxy(group, wave)
                self._gone.pop(node_id, None)
            else:
                proxy.streams += 1
                proxy.group, proxy.wave = group, wave
            if self.phase is Phase.ACKING and self._gate is not None and wave == self.wave:
                self._gate.join(node_id)
        return step.done()

    def disconnected(self, node_id: str, now: float) -> Step:
        """A stream of ``node_id`` closed."""
        with _Recorder(self) as step:
            proxy = self._connected.get(node_id)
            if proxy is not None:
                proxy.streams -= 1
                if proxy.streams <= 0:
                    del self._connected[node_id]
                    self._gone[node_id] = proxy.wave
                    while len(self._gone) > self.settings.max_gone:
                        self._gone.popitem(last=False)
                    if self._gate is not None:
                        self._gate.leave(node_id)
        return step.done()

    def sent(self, node_id: str, type_url: str, change_id: str, now: float) -> Step:
        """``node_id`` was sent ``type_url`` of ``change_id``."""
        with _Recorder(self) as step:
            if self._gate is not None and self.phase is Phase.ACKING and change_id == self.candidate:
                self._gate.sent(node_id, type_url)
        return step.done()

    def acked(self, node_id: str, type_url: str, change_id: str, now: float) -> Step:
        """``node_id`` ACKed ``type_url`` of ``change_id``. Report as an ACK too a reconnecting proxy's first
        request whose ``version_info`` is the candidate's: it accepted it on a stream that broke before
        its ACK arrived, and is sent nothing again (docs/architecture.md, behaviour 11)."""
        with _Recorder(self) as step:
            if self._gate is not None and self.phase is Phase.ACKING and change_id == self.candidate:
                self._gate.acked(node_id, type_url)
                self._advance(step, now)
        return step.done()

    def nacked(self, node_id: str, type_url: str, change_id: str, message: str, now: float) -> Step:
        """``node_id`` NACKed ``type_url`` of ``change_id`` with ``message``: a NACK of the candidate fails
        the rollout, whoever sent it. ``change_id`` is that of the response the NACK answers (by its
        nonce), not the NACK's ``version_info``, which is the last version the proxy accepted."""
        with _Recorder(self) as step:
            if self.running and change_id == self.candidate:
                text = " ".join(message.split())
                self._fail(step, f"{node_id} NACKed {short_type(type_url)}: {shorten(text, 300, tail=150)}", now)
        return step.done()

    def tick(self, now: float) -> Step:
        """Time passed: call at :meth:`deadline`, and while a wave bakes as load reports arrive."""
        with _Recorder(self) as step:
            self._advance(step, now)
        return step.done()

    def deadline(self) -> float | None:
        """When the next timer runs out (an ACK timeout, the end of a bake), or None."""
        if self.phase is Phase.ACKING and self._gate is not None:
            return self._gate.started + self.settings.ack.timeout
        if self.phase is Phase.BAKING and not self.paused:
            return self.bake_started + self.settings.bake
        return None

    # -- operator commands ---------------------------------------------------------------------------

    def _refuse_idle(self, command: str) -> None:
        if not self.running:
            held = f" (held: {next(reversed(self.held))})" if self.held else ""
            raise CommandRefused(f"{command}: no rollout in progress{held}; a new change starts one")

    def promote(self, now: float) -> Step:
        """Go to the next wave now (skipping what is left of the ACK wait and the bake), or complete the
        rollout from the last wave."""
        self._refuse_idle("promote")
        with _Recorder(self) as step:
            step.event("rollout_promoted", candidate=self.candidate, wave=self.wave_name, phase=self.phase.value)
            self.paused, self._paused_for_traffic = None, False
            self._pass_wave(step, now, how="promoted by the operator")
            self._advance(step, now)
        return step.done()

    def pause(self, now: float) -> Step:
        """Start no further wave until resumed (the gates keep watching and still roll back)."""
        self._refuse_idle("pause")
        if self.paused:
            raise CommandRefused(f"pause: the rollout is already paused ({self.paused}); resume it to go on")
        with _Recorder(self) as step:
            self.paused = _OPERATOR
            step.event("rollout_paused", candidate=self.candidate, wave=self.wave_name, reason="paused by the operator")
        return step.done()

    def resume(self, now: float) -> Step:
        """Go on after a pause (after one for too little traffic, the bake starts again)."""
        self._refuse_idle("resume")
        if not self.paused:
            raise CommandRefused("resume: the rollout is not paused")
        with _Recorder(self) as step:
            if self._paused_for_traffic:
                self.bake_started = now
            self.paused, self._paused_for_traffic = None, False
            step.event("rollout_resumed", candidate=self.candidate, wave=self.wave_name)
            self._advance(step, now)
        return step.done()

    def abort(self, now: float, reason: str = "") -> Step:
        """Back to the baseline: the candidate is rolled back and held."""
        self._refuse_idle("abort")
        with _Recorder(self) as step:
            why = "aborted by the operator" + (f": {shorten(reason, 200)}" if reason else "")
            step.event("rollout_aborted", candidate=self.candidate, wave=self.wave_name, reason=why)
            self._fail(step, why, now, event=False)
        return step.done()

    # -- transitions ---------------------------------------------------------------------------------

    def _supersede(self, step: _Recorder, by: str) -> None:
        if self.running:
            step.event(
                "rollout_superseded", candidate=self.candidate, by=by, wave=self.wave_name, baseline=self.baseline
            )
            self._stop()

    def _stop(self) -> None:
        self.candidate = None
        self.phase = Phase.IDLE
        self.wave, self.wave_started, self.bake_started = 0, 0.0, 0.0
        self.paused, self._paused_for_traffic = None, False
        self._gate = None
        self._before = {}

    def _start_wave(self, step: _Recorder, index: int, now: float) -> None:
        self.wave, self.wave_started, self.phase = index, now, Phase.ACKING
        members = [n for n, p in self._connected.items() if p.wave == index]
        skipped = [n for n, w in self._gone.items() if w == index]
        self._gate = AckGate(members, now, self.settings.ack)
        self._before = {}
        if self._health_on and self._loads is not None:
            on_baseline = range(index, len(self.settings.waves))
            self._before = self._loads.window(on_baseline, now - self.settings.bake, now)
        step.event(
            "rollout_wave_started",
            candidate=self.candidate,
            wave=self.wave_name,
            index=index,
            proxies=len(members),
            skipped=len(skipped),
            skipped_proxies=_node_list(skipped),
        )

    @property
    def _health_on(self) -> bool:
        return self.settings.health is not None and self._loads is not None

    def _advance(self, step: _Recorder, now: float) -> None:
        """Run the gates until nothing more happens at ``now``."""
        while self.running:
            if self.phase is Phase.ACKING:
                assert self._gate is not None
                if not len(self._gate):
                    self._pass_wave(step, now, how="no connected proxy in the wave")
                    continue
                if not self._gate.decided(now):
                    return  # (asked per ACK: judging walks every member)
                result = self._gate.judge(now)
                if result.verdict is Gate.FAIL:
                    self._fail(step, result.reason, now)
                    return
                if result.verdict is Gate.PENDING:
                    return
                self.phase, self.bake_started = Phase.BAKING, now
                step.event(
                    "rollout_wave_acked",
                    candidate=self.candidate,
                    wave=self.wave_name,
                    proxies=len(self._gate),
                    lost=len(result.lost),
                    lost_proxies=list(result.lost[:_SHOWN]),
                    not_sent=len(result.not_sent),
                    not_sent_proxies=list(result.not_sent[:_SHOWN]),
                )
                continue
            health = self._judge(now)
            if health is not None and health.verdict is Gate.FAIL:
                self._fail(step, health.reason, now)
                return
            if now < self.bake_started + self.settings.bake or self.paused:
                return
            if health is not None and health.verdict is Gate.NOT_ENOUGH and self.settings.too_little_traffic == "pause":
                self.paused, self._paused_for_traffic = health.reason, True
                step.event(
                    "rollout_paused",
                    candidate=self.candidate,
                    wave=self.wave_name,
                    reason=f"wave {self.wave_name}: {health.reason}; promote to go on, abort to roll back",
                )
                return
            self._pass_wave(
                step,
                now,
                how="healthy"
                if health is not None and health.verdict is Gate.PASS
                else (f"health not judged: {health.reason}" if health is not None else "baked"),
            )

    def _judge(self, now: float) -> HealthResult | None:
        if not self._health_on or self._gate is None:
            return None
        assert self.settings.health is not None and self._loads is not None
        wave = self._loads.window((self.wave,), self.bake_started, now)
        baseline = self._loads.window(range(self.wave + 1, len(self.settings.waves)), self.bake_started, now)
        self.last_health = judge_health(wave, baseline, self.settings.health, before=self._before)
        return self.last_health

    def _pass_wave(self, step: _Recorder, now: float, *, how: str) -> None:
        fields: dict[str, Any] = {"candidate": self.candidate, "wave": self.wave_name, "result": how}
        if self.last_health is not None and self.phase is Phase.BAKING:
            fields["error_ratio"] = round(self.last_health.wave.ratio, 6)
            fields["baseline_error_ratio"] = round(self.last_health.reference.ratio, 6)
            fields["requests"] = self.last_health.wave.completed
        step.event("rollout_wave_passed", **fields)
        self.last_health = None
        if self.wave + 1 < len(self.settings.waves):
            self._start_wave(step, self.wave + 1, now)
            return
        step.event("rollout_completed", candidate=self.candidate, previous=self.baseline)
        self.baseline = self.candidate
        self._stop()

    def _fail(self, step: _Recorder, reason: str, now: float, *, event: bool = True) -> None:
        assert self.candidate is not None
        full = f"wave {self.wave_name}: {reason}"
        if event:
            step.event("rollout_failed", candidate=self.candidate, wave=self.wave_name, reason=full)
        self.held[self.candidate] = Held(full, now)
        self.held.move_to_end(self.candidate)
        while len(self.held) > self.settings.max_held:
            self.held.popitem(last=False)
        had = [n for n, p in self._connected.items() if p.wave <= self.wave]
        step.event(
            "rollout_rolled_back", candidate=self.candidate, baseline=self.baseline, proxies=len(had), reason=full
        )
        self.last_health = None
        self._stop()

    # -- state ---------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The rollout's state as JSON-able values (live connections left out)."""
        return {
            "version": STATE_VERSION,
            "baseline": self.baseline,
            "candidate": self.candidate,
            "phase": self.phase.value,
            "wave": self.wave,
            "waves": [w.name for w in self.settings.waves.waves],
            "wave_started": self.wave_started,
            "bake_started": self.bake_started,
            "paused": self.paused,
            "paused_for_traffic": self._paused_for_traffic,
            "gate": None if self._gate is None else self._gate.to_dict(),
            "before": {c: v.to_list() for c, v in sorted(self._before.items())},
            "held": [{"candidate": c, "reason": h.reason, "at": h.at} for c, h in self.held.items()],
        }

    @classmethod
    def from_dict(
        cls, state: Mapping[str, Any], settings: RolloutSettings, *, loads: LoadWindow | None = None
    ) -> RolloutMachine:
        return cls(settings, loads=loads, state=state)

    def _restore(self, state: Mapping[str, Any]) -> None:
        where = "stored rollout state"
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            version = state.get("version") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(
                f"{where}: version {version!r}, this pilotfish reads version {STATE_VERSION}; "
                "delete the key to start from the next change as the baseline"
            )
        try:
            self.baseline = None if state["baseline"] is None else str(state["baseline"])
            for entry in state["held"]:
                self.held[str(entry["candidate"])] = Held(str(entry["reason"]), float(entry["at"]))
            candidate = state["candidate"]
            names = [w.name for w in self.settings.waves.waves]
            if candidate is None:
                return
            if list(state["waves"]) != names:
                # The waves changed (a restart with another --rollout): the wave index means something else.
                # The candidate is not held (nothing failed): it starts again from the first wave at the next offer.
                return
            self.candidate = str(candidate)
            self.phase = Phase(state["phase"])
            self.wave = int(state["wave"])
            if not 0 <= self.wave < len(names) or self.phase is Phase.IDLE:
                raise ValueError(f"wave {self.wave} in phase {self.phase.value}")
            self.wave_started = float(state["wave_started"])
            self.bake_started = float(state["bake_started"])
            self.paused = None if state["paused"] is None else str(state["paused"])
            self._paused_for_traffic = bool(state["paused_for_traffic"])
            gate = state["gate"]
            self._gate = None if gate is None else AckGate.from_dict(gate, self.settings.ack)
            self._before = {str(c): Counts.from_list(v) for c, v in dict(state["before"]).items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: {type(e).__name__}: {e}; it is not what this pilotfish wrote") from e

    def status(self) -> dict[str, Any]:
        """For the admin API: where the rollout is, who it waits for, what is held."""
        waiting: list[str] = []
        if self.phase is Phase.ACKING and self._gate is not None:
            waiting = list(self._gate.judge(self.wave_started).waiting)
        return {
            "phase": self.phase.value,
            "baseline": self.baseline,
            "candidate": self.candidate,
            "wave": self.wave_name if self.running else None,
            "paused": self.paused,
            "deadline": self.deadline(),
            "waiting": len(waiting),
            "waiting_proxies": waiting[:_SHOWN],
            "held": [{"candidate": c, "reason": h.reason, "at": h.at} for c, h in reversed(self.held.items())],
        }


@dataclass
class _Recorder:
    """Collects a step's events, and which connected proxies' served change moved across it."""

    machine: RolloutMachine
    events: list[Event] = field(default_factory=list)
    decision: Decision | None = None
    _before: tuple[str | None, str | None, int] = (None, None, 0)
    _wake: frozenset[str] = frozenset()

    def _key(self) -> tuple[str | None, str | None, int]:
        m = self.machine
        return m.baseline, m.candidate, m.wave

    def __enter__(self) -> _Recorder:
        self._before = self._key()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._key() == self._before:
            return
        baseline, candidate, wave = self._before
        m = self.machine
        wake = set()
        for node, proxy in m._connected.items():
            was = candidate if candidate is not None and proxy.wave <= wave else baseline
            if m.serves(node) != was:
                wake.add(node)
        self._wake = frozenset(wake)

    def event(self, kind: str, **fields: Any) -> None:
        self.events.append(Event(kind, fields))

    def done(self) -> Step:
        return Step(tuple(self.events), self._wake, self.decision)
