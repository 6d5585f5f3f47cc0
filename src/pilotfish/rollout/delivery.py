"""Serving a rollout: the baseline and the candidate in the cache, which of them each proxy's
watches are answered from, and the machine fed with what the proxies do (docs/rollout.md).

With ``serve --rollout``, the reconciler publishes each build to a :class:`Delivery` instead of
the cache (:meth:`Delivery.publish`, the :class:`~pilotfish.cache.SnapshotPublisher` Protocol).
The delivery offers the build to the :class:`~pilotfish.rollout.machine.RolloutMachine` and keeps
two snapshots per node group in the one :class:`~pilotfish.cache.SnapshotCache`:

- the **baseline** under the group's own name, which every proxy outside the started waves
  (and every REST poller, and the status page's config views) is served;
- the **candidate** under :func:`candidate_group` of it (``web@candidate``: ``@`` is in no group
  name), which the proxies of the started waves are served.

Only the rollout types (``--rollout-types``) differ between the two: the build's other types
(EDS by default) are served to both at once (:func:`spliced`), so an endpoint change never waits
behind a bake, and a cluster the baseline has and the candidate removed keeps its last
endpoints in the baseline.

The xDS streams ask :meth:`Delivery.route` which of the two answers a watch, each time they open
one; when the machine moves proxies between them (a wave starts, a rollback, a completion), the
delivery tells its followers (:meth:`follow`: the xDS server, which opens those proxies' watches
again). Before proxies move to a snapshot, its group in the cache takes in the history of the
one they come from (:meth:`~pilotfish.cache.SnapshotCache.adopt`), so make-before-break holds
across the move: a proxy whose routes still use a cluster the other snapshot lacks is sent a
bridge until it ACKs the new routes.

The delivery observes the proxies' status (:meth:`~pilotfish.status.SyncStatus.observe`):
streams opening and closing, responses sent, ACKs and NACKs, each mapped to the candidate by its
version (a NACK by the version it rejected, which the server knows from its nonce).

No I/O and no clock of its own: time comes from ``clock`` (wall time: the state may be shared by
replicas), and the composition root calls :meth:`tick` at :meth:`deadline` (and every few seconds
while a wave bakes).
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pilotfish.cache import DEFAULT_GROUP, NodeGroup, SnapshotCache
from pilotfish.errors import shorten
from pilotfish.events import EventLog
from pilotfish.resources.types import CLUSTER, ENDPOINT, TypeUrl
from pilotfish.rollout.gates import HealthResult, short_type
from pilotfish.rollout.load import LoadStore
from pilotfish.rollout.machine import CommandRefused, Decision, Phase, RolloutMachine, RolloutSettings, Step
from pilotfish.rollout.stored import Stored, encode, encode_snapshots
from pilotfish.snapshot import Snapshot, TypeSnapshot, with_kept
from pilotfish.status import NodeInfo, SyncStatus

__all__ = ["CANDIDATE", "HELD_SHOWN", "WAVE_BUCKETS", "Delivery", "RolloutStats", "candidate_group", "spliced"]

_log = logging.getLogger(__name__)

CANDIDATE = "@candidate"
"""What :func:`candidate_group` appends to a group's name."""

_WARN = frozenset({"rollout_failed", "rollout_rolled_back", "rollout_held", "rollout_aborted", "rollout_paused"})
_COMMANDS = frozenset({"rollout_promoted", "rollout_paused", "rollout_resumed", "rollout_aborted"})
HELD_SHOWN = 10
"""Held candidates :meth:`Delivery.status` lists (the newest; ``held_count`` says how many there are)."""


def candidate_group(group: str) -> NodeGroup:
    """The cache's name for ``group``'s candidate snapshot."""
    return NodeGroup(group + CANDIDATE)


def spliced(base: Snapshot, latest: Snapshot, types: frozenset[str]) -> Snapshot:
    """``base``'s rollout ``types`` with every other type of ``latest``. When EDS is not a rollout
    type, the clusters of ``base`` that ``latest`` has no endpoints for keep ``base``'s."""
    merged: dict[Any, TypeSnapshot] = {}
    for url, current in latest.types.items():
        merged[url] = base.types.get(url, current) if url in types else current
    endpoints = merged.get(ENDPOINT.url)
    clusters = merged.get(CLUSTER.url)
    old = base.types.get(ENDPOINT.url)
    if ENDPOINT.url not in types and endpoints is not None and clusters is not None and old is not None:
        missing = {
            name: old.resources[name]
            for name in clusters.resources.keys() - endpoints.resources.keys()
            if name in old.resources
        }
        if missing:
            merged[ENDPOINT.url] = with_kept(endpoints, missing)
    return Snapshot(types=merged, explicit_version=base.explicit_version, subsets=latest.subsets)


WAVE_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
"""Upper bounds (seconds) of the wave-duration histogram's buckets."""


@dataclass(slots=True)
class RolloutStats:
    """What ``/metrics`` shows of the rollouts so far."""

    outcomes: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("completed", "rolled_back", "superseded"), 0)
    )
    """Rollouts that ended, by how: completed, rolled back (a failed gate or an abort), superseded."""
    held_offers: int = 0
    """Times a held candidate was offered again (and not served)."""
    wave_counts: list[int] = field(default_factory=lambda: [0] * (len(WAVE_BUCKETS) + 1))
    """Waves that passed, by duration (from their start to their pass), per :data:`WAVE_BUCKETS` (and +Inf)."""
    wave_seconds: float = 0.0
    """The sum of their durations."""

    def wave_passed(self, seconds: float) -> None:
        self.wave_counts[bisect.bisect_left(WAVE_BUCKETS, seconds)] += 1
        self.wave_seconds += seconds


MAX_NACKS = 100
"""NACKs of one candidate a replica reports to the one that decides (one fails the rollout)."""
MAX_NACK_MESSAGE = 1_000
"""Characters of each reported NACK message."""
MAX_REFUSED_REPLICAS = 64
"""Replicas whose refused load exports are remembered (each is warned about once per reason)."""

_OUTCOMES = {"rollout_completed": "completed", "rollout_rolled_back": "rolled_back", "rollout_superseded": "superseded"}


class Delivery:
    """A rollout served from ``cache`` (see the module's docstring)."""

    def __init__(
        self,
        cache: SnapshotCache,
        settings: RolloutSettings,
        *,
        status: SyncStatus,
        events: EventLog,
        loads: LoadStore | None = None,
        clock: Callable[[], float] = time.time,
        restored: Stored | None = None,
        deciding: Callable[[], bool] | None = None,
    ) -> None:
        self.machine = RolloutMachine(settings, loads=loads, state=None if restored is None else restored.machine)
        self._cache = cache
        self._status = status
        self._events = events
        self._clock = clock
        self._loads = loads
        self._load_refused: dict[str, str] = {}
        self._types = settings.types
        self._followers: list[Callable[[frozenset[str]], None]] = []
        self._on_change: list[Callable[[], None]] = []
        self._latest: dict[NodeGroup, Snapshot] = {}
        """What the reconciler published last, per group: the sources' state as built."""
        self._latest_change: str | None = None
        self._by_change: dict[str, dict[NodeGroup, Snapshot]] = {}
        """The snapshots of the baseline and of the candidate, as built, by change id."""
        self._spliced: dict[NodeGroup, tuple[Snapshot, Snapshot, Snapshot]] = {}
        """Per group, the last (baseline as built, latest, baseline served) made by :func:`spliced`."""
        self._nodes: dict[str, NodeGroup] = {}
        """Connected proxies (gRPC streams) and their groups."""
        self._on_candidate: set[str] = set()
        """Proxies whose watches were last opened on the candidate."""
        self._deciding = deciding
        """Whether this replica decides the rollout now (None: always; on etcd, the elected one)."""
        self._seen: dict[str, tuple[set[str], set[str]]] = {}
        """Proxies here, per node id: the candidate's types sent to them, and those they ACKed."""
        self._nacks: list[tuple[str, str, str]] = []
        """NACKs of the candidate here (node id, type URL, message): the first :data:`MAX_NACKS`."""
        self._seen_of: str | None = None
        """The candidate :attr:`_seen` and :attr:`_nacks` are about."""
        self._followed = deciding is None
        """A replica that does not decide serves nothing until it has the deciding one's state."""
        self.observed = 0
        """Counts what was seen here (a replica that does not decide reports it when it moved)."""
        self._remote: dict[str, dict[str, str]] = {}
        """Per other replica: the proxies it reported connected, and their groups (deciding only)."""
        self.stats = RolloutStats()
        self._wave_since = 0.0
        self.changes = 0
        """Counts the steps that changed what :meth:`stored` says (the state file is written when it moved)."""
        if restored is not None and self.machine.baseline is not None:
            self._by_change[self.machine.baseline] = dict(restored.baseline)
        status.observe(self)

    def stored(self) -> dict[str, Any]:
        """What is kept across a restart (:func:`pilotfish.rollout.stored.encode`)."""
        baseline = self._by_change.get(self.machine.baseline or "", {})
        return encode(self.machine.to_dict(), baseline)

    # -- the reconciler's side (SnapshotPublisher) --------------------------------------------------

    def snapshot(self, group: NodeGroup = DEFAULT_GROUP) -> Snapshot | None:
        """What the reconciler published last for ``group`` (it compares its next build with it)."""
        return self._latest.get(group)

    def publish(self, snapshots: Mapping[NodeGroup, Snapshot]) -> int:
        """Offer a build (the groups that changed) to the machine and serve what it decides;
        returns how many watches were answered."""
        changed = self._changed_types(snapshots)
        self._latest.update(snapshots)
        self._latest_change = _change_id(self._latest, self._types)
        if not self.deciding:  # the deciding replica offers it (its own build of the same sources)
            return self._apply(Step(), everyone=True) if self._followed else 0
        step = self.machine.offer(self._latest_change, changed, self._clock())
        self._emit(step)
        answered = self._apply(step, everyone=True)
        if step.decision is Decision.HELD:
            _log.warning("the change %s is held: every proxy keeps the baseline", self._latest_change)
        return answered

    def _changed_types(self, snapshots: Mapping[NodeGroup, Snapshot]) -> set[str]:
        """The type URLs whose content ``snapshots`` change from what was published last."""
        changed: set[str] = set()
        for group, snapshot in snapshots.items():
            old = self._latest.get(group)
            for url, current in snapshot.types.items():
                was = old.types.get(url) if old is not None else None
                if was is None or was.content_hash != current.content_hash:
                    changed.add(url)
        return changed

    def would_offer(self, snapshots: Mapping[NodeGroup, Snapshot]) -> dict[str, Any]:
        """What publishing ``snapshots`` (the groups a build changed) would make the rollout do,
        changing nothing (``pilotfish plan``), JSON-able: the machine's ``decision``, the change id,
        the rollout ``types`` it changes; rolling out: each wave with its connected proxies, and the
        candidate it would supersede; held: why that candidate was held."""
        machine = self.machine
        changed = self._changed_types(snapshots)
        change = _change_id({**self._latest, **snapshots}, self._types)
        decision = machine.would_offer(change, changed)
        out: dict[str, Any] = {
            "decision": decision.value,
            "change": change,
            "types": sorted(short_type(url) for url in changed & self._types),
            "baseline": machine.baseline,
            "supersedes": machine.candidate
            if decision in (Decision.ROLL_OUT, Decision.BASELINE, Decision.HELD)
            else None,
        }
        if decision is Decision.ROLL_OUT:
            waves = machine.settings.waves.waves
            out["waves"] = [
                {"name": wave.name, "proxies": size} for wave, size in zip(waves, machine.wave_sizes(), strict=True)
            ]
            out["paused"] = machine.paused_by_operator  # the first wave would start, and stay paused
        if decision is Decision.HELD:
            out["held"] = machine.held[change].reason
        return out

    # -- the streams' side --------------------------------------------------------------------------

    def route(self, node_id: str, group: NodeGroup) -> NodeGroup:
        """The cache group whose snapshot answers ``node_id``'s watches now."""
        machine = self.machine
        candidate = machine.candidate
        if candidate is not None and candidate in self._by_change and machine.serves(node_id, group) == candidate:
            self._on_candidate.add(node_id)
            return candidate_group(group)
        if self._on_candidate:
            self._on_candidate.discard(node_id)
        return group

    def on_change(self, changed: Callable[[], None]) -> None:
        """Call ``changed()`` whenever :attr:`changes` moves (the etcd store writes at once)."""
        self._on_change.append(changed)

    def follow(self, on_moved: Callable[[frozenset[str]], None]) -> None:
        """Call ``on_moved(node ids)`` when proxies must open their watches again (:meth:`route`
        answers otherwise for them)."""
        self._followers.append(on_moved)

    # -- what the proxies do (the status's observer) ------------------------------------------------

    def stream_opened(self, node_id: str, info: NodeInfo) -> None:
        if info.protocol == "rest":
            return  # a poller is served the baseline (REST xDS reads the group's snapshot)
        group = NodeGroup(info.group)
        self._nodes[node_id] = group
        self._step(self.machine.connected(node_id, group, self._clock()))

    def stream_closed(self, node_id: str, streams_left: int) -> None:
        if node_id not in self._nodes:
            return
        if streams_left == 0:
            del self._nodes[node_id]
            self._on_candidate.discard(node_id)
        self._step(self.machine.disconnected(node_id, self._clock()))

    def _of_candidate(self, node_id: str, type_url: str, version: str | None) -> str | None:
        """The candidate's change id if ``version`` is its ``type_url`` for ``node_id``'s group."""
        candidate = self.machine.candidate
        if candidate is None or version is None or type_url not in self._types:
            return None
        group = self._nodes.get(node_id)
        snapshot = self._by_change.get(candidate, {}).get(group) if group is not None else None
        if snapshot is None or snapshot.version(type_url) != version:
            return None
        return candidate

    def sent(self, node_id: str, type_url: str, version: str) -> None:
        change = self._of_candidate(node_id, type_url, version)
        if change is not None:
            self._seen_here(change, node_id)[0].add(type_url)
            if self.deciding:
                self._step(self.machine.sent(node_id, type_url, change, self._clock()))

    def acked(self, node_id: str, type_url: str, version: str) -> None:
        change = self._of_candidate(node_id, type_url, version)
        if change is not None:
            self._seen_here(change, node_id)[1].add(type_url)
            if self.deciding:
                self._step(self.machine.acked(node_id, type_url, change, self._clock()))

    def nacked(self, node_id: str, type_url: str, version: str | None, error: str) -> None:
        change = self._of_candidate(node_id, type_url, version)
        if change is not None:
            self._seen_here(change, node_id)
            if len(self._nacks) < MAX_NACKS:
                self._nacks.append((node_id, type_url, shorten(error, MAX_NACK_MESSAGE)))
            if self.deciding:
                self._step(self.machine.nacked(node_id, type_url, change, error, self._clock()))

    def _seen_here(self, change: str, node_id: str) -> tuple[set[str], set[str]]:
        if self._seen_of != change:
            self._seen_of, self._seen, self._nacks = change, {}, []
        self.observed += 1
        seen = self._seen.get(node_id)
        if seen is None:
            seen = self._seen[node_id] = (set(), set())
        return seen

    # -- replicas (on etcd): one decides, every one serves ------------------------------------------

    @property
    def deciding(self) -> bool:
        return self._deciding is None or self._deciding()

    def report(self) -> dict[str, Any]:
        """What this replica saw of its proxies, for the one that decides (JSON-able): the
        proxies connected here with their groups, and for the candidate the types sent to each,
        those ACKed, and the NACKs."""
        seen = self._seen if self._seen_of == self.machine.candidate else {}
        proxies = {}
        for node, group in self._nodes.items():
            sent, acked = seen.get(node, ((), ()))
            proxies[node] = [group, sorted(sent), sorted(acked)]
        nacks = self._nacks if self._seen_of == self.machine.candidate else []
        return {"at": self._clock(), "candidate": self.machine.candidate, "proxies": proxies, "nacks": nacks}

    def load_report(self) -> dict[str, Any] | None:
        """The load reports this replica received lately, for the one that decides (JSON-able;
        None without health gates): a bake and two buckets of them, what a replica that starts to
        decide needs for the next wave's comparison (the one deciding keeps what it took before)."""
        if self._loads is None:
            return None
        bucket = self._loads.settings.bucket
        return self._loads.export(self._clock() - self.machine.settings.bake - 2 * bucket)

    def absorb(self, replica: str, report: Mapping[str, Any] | None) -> None:
        """Take another replica's :meth:`report` (None: it is gone, or its report too old): its
        proxies count in the gates as this replica's own do, and so does the load its proxies
        reported to it (``load``: its :meth:`load_report`; kept when the replica is gone, as the
        requests were made)."""
        machine, now = self.machine, self._clock()
        load = None if report is None else report.get("load")
        if load is not None and self._loads is not None:
            try:
                self._loads.merge(replica, load)
            except (ValueError, TypeError, AttributeError) as exc:
                if self._load_refused.get(replica) != str(exc):  # (said once per replica and reason)
                    if len(self._load_refused) >= MAX_REFUSED_REPLICAS:
                        self._load_refused.clear()
                    self._load_refused[replica] = str(exc)
                    _log.warning("the load reported by replica %s is not counted: %s", replica, exc)
        before = self._remote.get(replica, {})
        proxies: Mapping[str, Any] = {} if report is None else report.get("proxies", {})
        for node in before.keys() - proxies.keys():
            self._step(machine.disconnected(node, now))
        current: dict[str, str] = {}
        about = None if report is None else report.get("candidate")
        for node, (group, sent, acked) in proxies.items():
            current[node] = str(group)
            if node not in before:
                self._step(machine.connected(node, str(group), now))
            if about is not None and about == machine.candidate:
                for type_url in sent:
                    self._step(machine.sent(node, type_url, about, now))
                for type_url in acked:
                    self._step(machine.acked(node, type_url, about, now))
        if about is not None and report is not None:
            for node, type_url, message in report.get("nacks", ()):
                if about == machine.candidate:
                    self._step(machine.nacked(node, type_url, about, message, now))
        if current:
            self._remote[replica] = current
        else:
            self._remote.pop(replica, None)

    def adopt(self, machine_state: Mapping[str, Any], baseline: Mapping[NodeGroup, Snapshot] | None = None) -> None:
        """Serve by the deciding replica's state (a replica that does not decide): its machine's
        :meth:`~pilotfish.rollout.machine.RolloutMachine.to_dict`, and the baseline's snapshots
        when this replica has not got them (it started after the baseline was set)."""
        step = self.machine.adopt(machine_state)
        if baseline is not None and self.machine.baseline is not None:
            self._by_change.setdefault(self.machine.baseline, dict(baseline))
        self._followed = True
        self._apply(step, everyone=True)

    def take_over(self) -> None:
        """This replica now decides: offer what its sources say (the rollout goes on where the
        state it adopted left it: the candidate goes on, a held one stays held)."""
        self._followed = True
        if self._latest_change is not None:
            step = self.machine.offer(self._latest_change, self._types, self._clock())
            self._emit(step)
            self._apply(step, everyone=True)
        machine, now = self.machine, self._clock()
        candidate = machine.candidate
        if candidate is not None and self._seen_of == candidate:  # what its own proxies did meanwhile
            for node, (sent, acked) in list(self._seen.items()):
                for type_url in sorted(sent):
                    self._step(machine.sent(node, type_url, candidate, now))
                for type_url in sorted(acked):
                    self._step(machine.acked(node, type_url, candidate, now))
            for node, type_url, message in list(self._nacks):
                self._step(machine.nacked(node, type_url, candidate, message, now))

    @property
    def baseline_change(self) -> str | None:
        """The baseline's change id, if this replica has its snapshots."""
        baseline = self.machine.baseline
        return baseline if baseline is not None and baseline in self._by_change else None

    def baseline_document(self) -> dict[str, Any]:
        """The baseline's snapshots as :func:`~pilotfish.rollout.stored.encode` writes them."""
        return encode_snapshots(self._by_change.get(self.machine.baseline or "", {}))

    # -- time and the operator ----------------------------------------------------------------------

    def tick(self) -> None:
        """Time passed: run the timers and the health gate (if this replica decides)."""
        if self.deciding:
            self._step(self.machine.tick(self._clock()))

    def deadline(self) -> float | None:
        """When :meth:`tick` is next due (the clock's time), or None."""
        return self.machine.deadline()

    @property
    def baking(self) -> bool:
        return self.machine.running and self.machine.phase is Phase.BAKING

    # The operator's commands: each raises CommandRefused when it does not apply now. ``by``: who
    # gave it (``admin API (token ops)``), added to the command's event.

    def promote(self, *, by: str = "") -> None:
        self._only_deciding("promote")
        self._step(self.machine.promote(self._clock()), by=by)

    def pause(self, *, by: str = "") -> None:
        self._only_deciding("pause")
        self._step(self.machine.pause(self._clock()), by=by)

    def resume(self, *, by: str = "") -> None:
        self._only_deciding("resume")
        self._step(self.machine.resume(self._clock()), by=by)

    def abort(self, reason: str = "", *, by: str = "") -> None:
        self._only_deciding("abort")
        self._step(self.machine.abort(self._clock(), reason), by=by)

    def _only_deciding(self, command: str) -> None:
        if not self.deciding:
            raise CommandRefused(
                f"{command}: this replica does not decide the rollout; give the command to the elected "
                "replica's admin API (its /healthz names the leader)"
            )

    def status(self) -> dict[str, Any]:
        """For the admin API: the machine's status (the newest :data:`HELD_SHOWN` held candidates),
        how many proxies are on the candidate, the timers, and the last health figures of the bake."""
        machine, settings = self.machine, self.machine.settings
        out = machine.status()
        running = machine.running
        baking = running and machine.phase is Phase.BAKING
        out["now"] = self._clock()
        out["wave_index"] = machine.wave if running else None
        out["wave_started"] = machine.wave_started if running else None
        out["bake_ends"] = machine.bake_started + settings.bake if baking else None
        out["health"] = _health_json(machine.last_health) if baking else None
        out["latest"] = self._latest_change  # the sources' latest change; held: it was rolled back
        latest_held = machine.held.get(self._latest_change or "")
        out["latest_held"] = None if latest_held is None else latest_held.reason
        out["held_count"] = len(machine.held)
        out["held"] = out["held"][:HELD_SHOWN]
        out["deciding"] = self.deciding  # (on etcd only the elected replica does)
        out["proxies"] = len(self._nodes)
        out["proxies_elsewhere"] = sum(len(nodes) for nodes in self._remote.values())  # (reported to it)
        out["on_candidate"] = len(self._on_candidate)
        out["waves"] = [w.name for w in settings.waves.waves]
        out["types"] = sorted(short_type(type_url) for type_url in self._types)
        out["bake"] = settings.bake
        out["ack_timeout"] = settings.ack.timeout
        return out

    # -- serving what the machine decided ---------------------------------------------------------

    def _step(self, step: Step, *, by: str = "") -> None:
        self._emit(step, by=by)
        if step.events or step.wake:
            self._apply(step)

    def _emit(self, step: Step, *, by: str = "") -> None:
        for n, event in enumerate(step.events):
            self._count(event.kind)
            fields = event.fields
            if by and n == 0 and event.kind in _COMMANDS:  # the command's own event comes first
                fields = {**fields, "by": by}
            self._events.emit(event.kind, **fields)
            if event.kind in _WARN:
                _log.warning("%s: %s", event.kind, event.fields.get("reason") or event.fields.get("candidate"))
            elif event.kind != "rollout_wave_acked":
                _log.info("%s: %s", event.kind, dict(event.fields))

    def _count(self, kind: str) -> None:
        stats = self.stats
        if kind in _OUTCOMES:
            stats.outcomes[_OUTCOMES[kind]] += 1
        elif kind == "rollout_held":
            stats.held_offers += 1
        elif kind == "rollout_wave_started":
            self._wave_since = self._clock()
        elif kind == "rollout_wave_passed":
            stats.wave_passed(max(0.0, self._clock() - self._wave_since))

    def _apply(self, step: Step, *, everyone: bool = False) -> int:
        """Make the cache serve what the machine says, then move the proxies that must move
        (``everyone``: look at every connected proxy, not only at those the step names and those
        on the candidate: the candidate's snapshots may have just arrived)."""
        self.changes += 1
        for changed in self._on_change:
            changed()
        machine = self.machine
        live = {c for c in (machine.baseline, machine.candidate) if c is not None}
        self._by_change = {c: s for c, s in self._by_change.items() if c in live}
        if self._latest_change in live:
            assert self._latest_change is not None
            self._by_change[self._latest_change] = dict(self._latest)
        baseline = self._by_change.get(machine.baseline or "", {})
        candidate = self._by_change.get(machine.candidate or "") if machine.candidate is not None else None
        answered = 0
        moving = self._moving(step, everyone=everyone)
        for group, latest in self._latest.items():
            base = baseline.get(group)
            served = latest if base is None or base is latest else self._splice(group, base, latest)
            if candidate is not None:
                wanted = candidate.get(group)
                if wanted is not None:
                    cand = candidate_group(group)
                    fresh = self._cache.snapshot(cand) is None or step.decision is Decision.ROLL_OUT
                    if fresh:  # proxies come from the baseline: bridge their clusters
                        self._cache.adopt(into=cand, source=group)
                    answered += self._set(cand, latest if wanted is latest else self._splice(cand, wanted, latest))
            elif moving:  # proxies come back from the candidate: bridge their clusters
                self._cache.adopt(into=group, source=candidate_group(group))
            answered += self._set(group, served)
        self._published_versions()
        if moving:
            for follower in self._followers:
                follower(moving)
        return answered

    def _moving(self, step: Step, *, everyone: bool = False) -> frozenset[str]:
        """Proxies whose watches are on the other snapshot than the one that serves them now."""
        machine = self.machine
        moving = set(step.wake)
        candidate = machine.candidate if machine.candidate in self._by_change else None
        for node in self._nodes if everyone else self._on_candidate:
            on_it = candidate is not None and machine.serves(node, self._nodes[node]) == candidate
            if on_it != (node in self._on_candidate):
                moving.add(node)
        return frozenset(n for n in moving if n in self._nodes)

    def _splice(self, group: NodeGroup, base: Snapshot, latest: Snapshot) -> Snapshot:
        memo = self._spliced.get(group)
        if memo is not None and memo[0] is base and memo[1] is latest:
            return memo[2]
        made = spliced(base, latest, self._types)
        self._spliced[group] = (base, latest, made)
        return made

    def _set(self, group: NodeGroup, snapshot: Snapshot) -> int:
        if self._cache.snapshot(group) is snapshot:
            return 0
        return self._cache.set_snapshot(snapshot, group)

    def _published_versions(self) -> None:
        """Tell the status what each group's proxies are to have when the rollout is over: the
        candidate while one runs (``pilotfish wait`` waits for it to reach everyone), else the
        baseline (after a rollback: what every proxy is served)."""
        machine = self.machine
        target = self._by_change.get(machine.candidate or machine.baseline or "", {})
        for group in self._latest:
            snapshot = self._cache.snapshot(candidate_group(group) if machine.candidate else group)
            if snapshot is None or group not in target:
                continue
            current = self._status.groups.get(group)
            versions: dict[str, str] = {url: ts.version for url, ts in snapshot.types.items()}
            if current is None or {url: v for url, (v, _) in current.types.items()} != versions:
                self._status.published(group, label=snapshot.label(), versions=versions)


def _change_id(latest: Mapping[NodeGroup, Snapshot], types: frozenset[str]) -> str:
    """The content hash of the rollout ``types`` over every group of ``latest``."""
    digest = hashlib.sha256()
    for group in sorted(latest):
        for url in sorted(types):
            current = latest[group].types.get(TypeUrl(url))
            digest.update(f"{group}\0{url}\0{current.content_hash if current else ''}\n".encode())
    return digest.hexdigest()[:16]


def _health_json(health: HealthResult | None) -> dict[str, Any] | None:
    """The health gate's last verdict in the bake: the wave's requests and error ratio, and its
    reference's (the baseline's)."""
    if health is None:
        return None
    wave, reference = health.wave, health.reference
    return {
        "verdict": health.verdict.value,
        "reason": health.reason,
        "requests": wave.completed,
        "errors": wave.errors,
        "error_ratio": round(wave.ratio, 6),
        "baseline_requests": reference.completed,
        "baseline_error_ratio": round(reference.ratio, 6),
    }
