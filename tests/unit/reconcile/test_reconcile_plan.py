"""Plans (pilotfish.reconcile.plan, Reconciler.plan): the field-level diff of Envoy JSON and its
bounds, the diff of snapshots by type, and the reconciler's plan of a proposed state: refused,
held, unchanged or published, publishing nothing and changing nothing."""

from __future__ import annotations

from typing import Any

from envoy.extensions.transport_sockets.tls.v3 import secret_pb2

from cluster_snapshots import eds_document
from pilotfish.build.desired import DesiredState
from pilotfish.cache import DEFAULT_GROUP, NodeGroup, SnapshotCache
from pilotfish.reconcile import BuildOptions, GuardSettings, Reconciler
from pilotfish.reconcile.plan import (
    HOLD,
    MAX_FIELD_CHANGES,
    MAX_RESOURCES,
    MAX_VALUE_CHARS,
    NO_CHANGE,
    NOT_SERVED,
    PUBLISH,
    REDACTED,
    REFUSE,
    WAIT,
    Plan,
    diff_snapshots,
    diff_type,
    field_changes,
)
from pilotfish.resources import CLUSTER, SECRET
from pilotfish.resources.parse import parse_resource
from pilotfish.snapshot import Snapshot
from pilotfish.sources.file import parse_desired


def changes(old: Any, new: Any, **kwargs: Any) -> list[tuple[str, Any, Any]]:
    found, total = field_changes(old, new, **kwargs)
    assert total == len(found)
    return [(c.path, c.old, c.new) for c in found]


def test_a_changed_scalar_is_named_by_its_path_with_both_values() -> None:
    old = {"name": "a", "connect_timeout": "1s", "lb_policy": "ROUND_ROBIN"}
    new = {"name": "a", "connect_timeout": "2s", "lb_policy": "ROUND_ROBIN"}
    assert changes(old, new) == [("connect_timeout", "1s", "2s")]
    assert changes(old, old) == []


def test_fields_that_appear_or_go_have_none_on_the_other_side() -> None:
    old = {"a": {"b": 1, "gone": True}}
    new = {"a": {"b": 1, "came": [1]}, "top": "x"}
    assert changes(old, new) == [("a.gone", True, None), ("a.came", None, [1]), ("top", None, "x")]


def test_lists_are_compared_by_position_and_odd_keys_quoted() -> None:
    old = {"hosts": ["a", "b"], "filter_metadata": {"envoy.lb": {"zone": "x"}}}
    new = {"hosts": ["a", "c", "d"], "filter_metadata": {"envoy.lb": {"zone": "y"}}}
    assert changes(old, new) == [
        ("hosts[1]", "b", "c"),
        ("hosts[2]", None, "d"),
        ('filter_metadata["envoy.lb"].zone', "x", "y"),
    ]


def test_lists_of_named_items_are_matched_by_name_and_a_new_order_is_a_change() -> None:
    old = {"virtual_hosts": [{"name": "web", "domains": ["*"]}, {"name": "api", "domains": ["api"]}]}
    inserted = {"virtual_hosts": [{"name": "new", "domains": ["n"]}, *old["virtual_hosts"]]}
    # An item put first is one change, not a shift of every item after it.
    assert changes(old, inserted) == [("virtual_hosts[name=new]", None, {"name": "new", "domains": ["n"]})]
    edited = {"virtual_hosts": [{"name": "web", "domains": ["*"]}, {"name": "api", "domains": ["api", "x"]}]}
    assert changes(old, edited) == [("virtual_hosts[name=api].domains[1]", None, "x")]
    swapped = {"virtual_hosts": list(reversed(old["virtual_hosts"]))}
    assert changes(old, swapped) == [("virtual_hosts (order of names)", ["web", "api"], ["api", "web"])]


def test_at_most_the_first_changes_are_listed_with_the_total() -> None:
    old = {f"f{i}": i for i in range(MAX_FIELD_CHANGES + 10)}
    new = {key: value + 1 for key, value in old.items()}
    found, total = field_changes(old, new)
    assert total == MAX_FIELD_CHANGES + 10 and len(found) == MAX_FIELD_CHANGES
    assert found[0].path == "f0" and (found[0].old, found[0].new) == (0, 1)


def test_long_values_are_summarized_and_marked_clipped() -> None:
    big = {f"key{i}": "v" * 20 for i in range(40)}
    (added,), _ = field_changes({}, {"listener": big})
    assert added.clipped and added.old is None
    assert added.new.startswith("(an object of 40 fields, ") and "characters of JSON" in added.new
    (long,), _ = field_changes({"s": "a"}, {"s": "x" * 1000})
    assert long.clipped and len(long.new) == MAX_VALUE_CHARS and long.new.endswith("...") and long.old == "a"
    (short,), _ = field_changes({"s": "a"}, {"s": "b"})
    assert not short.clipped and "clipped" not in short.to_json()


def test_secret_values_are_never_shown() -> None:
    (changed, came), _ = field_changes({"key": "old-private"}, {"key": "new-private", "more": "x"}, redact=True)
    assert (changed.path, changed.old, changed.new) == ("key", REDACTED, REDACTED)
    assert (came.path, came.old, came.new) == ("more", None, REDACTED)


def cluster(name: str, timeout: str = "1s") -> Any:
    message, problems = parse_resource(
        CLUSTER,
        {"name": name, "type": "EDS", "connect_timeout": timeout, "eds_cluster_config": {"eds_config": {"ads": {}}}},
        "",
    )
    assert message is not None, problems
    return message


def test_types_diff_by_name_with_the_lists_bounded_and_counted() -> None:
    old = Snapshot.build({CLUSTER: [cluster("same"), cluster("edited"), cluster("gone")]})
    new = Snapshot.build({CLUSTER: [cluster("same"), cluster("edited", "3s"), cluster("new")]})
    diffs = diff_snapshots(old, new)
    assert list(diffs) == ["CDS"]  # the other types are empty in both
    cds = diffs["CDS"]
    assert (cds.added, cds.removed, [c.name for c in cds.changed]) == (("new",), ("gone",), ["edited"])
    (edited,) = cds.changed
    assert [(c.path, c.old, c.new) for c in edited.changes] == [("connect_timeout", "1s", "3s")]
    assert diff_snapshots(old, old) == {}
    first = diff_snapshots(None, old)["CDS"]
    assert first.added == ("edited", "gone", "same") and first.counts == {"added": 3, "removed": 0, "changed": 0}

    many = Snapshot.build({CLUSTER: [cluster(f"c{i:03}") for i in range(MAX_RESOURCES + 25)]})
    bounded = diff_type(CLUSTER, old.get(CLUSTER.url), many.get(CLUSTER.url))
    assert bounded is not None
    assert len(bounded.added) == MAX_RESOURCES and bounded.counts["added"] == MAX_RESOURCES + 25
    shown = bounded.to_json()
    assert shown["left_out"] == {"added": 25, "removed": 0, "changed": 0}
    assert shown["removed"] == ["edited", "gone", "same"]


def test_a_secret_diff_names_its_fields_but_shows_no_key() -> None:
    def secret(key: str) -> secret_pb2.Secret:
        made = secret_pb2.Secret(name="cert")
        made.tls_certificate.private_key.inline_string = key
        return made

    before = Snapshot.build({SECRET: [secret("-----BEGIN old")]})
    after = Snapshot.build({SECRET: [secret("-----BEGIN new")]})
    (change,) = diff_snapshots(before, after)["SDS"].changed
    assert [(c.path, c.old, c.new) for c in change.changes] == [
        ("tls_certificate.private_key.inline_string", REDACTED, REDACTED)
    ]
    assert "BEGIN" not in str(diff_snapshots(before, after)["SDS"].to_json())


# -- Reconciler.plan --------------------------------------------------------------------------------


def document(clusters: dict[str, str], *, version: str | None = None, port: int = 9001) -> bytes:
    """EDS clusters (name -> connect timeout), each with one endpoint on ``port``, as YAML."""
    import yaml

    doc = eds_document(clusters, port=port)
    if version is not None:
        doc["version"] = version
    return yaml.safe_dump(doc).encode()


def state(clusters: dict[str, str], **kwargs: Any) -> DesiredState:
    return parse_desired(document(clusters, **kwargs), "proposed.yaml")


def served(clusters: dict[str, str], **kwargs: Any) -> Reconciler:
    reconciler = Reconciler(SnapshotCache(), build=BuildOptions(labels={"file": "snapshot.yaml"}))
    reconciler.update("file", state(clusters, **kwargs))
    reconciler.build_now()
    return reconciler


def test_a_plan_publishes_nothing_and_changes_nothing() -> None:
    reconciler = served({"a": "1s"})
    published, stats = reconciler.cache.snapshot(), (reconciler.stats.builds, reconciler.stats.published)
    plan = reconciler.plan("file", state({"a": "2s", "b": "1s"}), label="new.yaml")
    assert plan.verdict == PUBLISH and plan.sources == "new.yaml"
    assert list(plan.changed) == [DEFAULT_GROUP]
    cds = plan.groups[DEFAULT_GROUP].types["CDS"]
    assert cds.added == ("b",) and [c.name for c in cds.changed] == ["a"]
    assert reconciler.cache.snapshot() is published
    assert (reconciler.stats.builds, reconciler.stats.published) == stats
    assert reconciler.build_now() is None  # the file's state is still the one served


def test_the_same_state_is_no_change() -> None:
    reconciler = served({"a": "1s"})
    plan = reconciler.plan("file", state({"a": "1s"}))
    assert plan.verdict == NO_CHANGE and not plan.changed
    assert plan.to_json()["groups"]["default"]["changed"] is False


def test_an_invalid_state_gives_every_problem_and_nothing_else() -> None:
    reconciler = served({"a": "1s"})
    broken = DesiredState(resources={CLUSTER: (cluster("a", "-1s"), cluster("b", "-2s"))})
    plan = reconciler.plan("file", broken)
    assert plan.verdict == REFUSE and not plan.groups and plan.guard is None
    assert len(plan.problems) >= 2 and {p.where.split(" ")[0] for p in plan.problems} >= {"clusters[0]", "clusters[1]"}
    shown = plan.to_json()
    assert shown["published"] is False and len(shown["problems"]) == len(plan.problems)


def test_a_changed_content_under_the_same_version_is_refused_as_the_build_would() -> None:
    reconciler = served({"a": "1s"}, version="v1")
    plan = reconciler.plan("file", state({"a": "2s"}, version="v1"))
    assert plan.verdict == REFUSE and [p.where for p in plan.problems] == ["version"]
    assert reconciler.plan("file", state({"a": "2s"}, version="v2")).verdict == PUBLISH


def test_the_guard_would_hold_a_plan_that_removes_too_much() -> None:
    reconciler = served({f"c{i}": "1s" for i in range(12)})
    plan = reconciler.plan("file", state({"c0": "1s"}))
    assert plan.verdict == HOLD and plan.guard is not None
    assert any("removes 11 of 12 clusters" in reason for reason in plan.guard.reasons)
    assert reconciler.held is None  # nothing was held for real
    shown = plan.to_json()["guard"]
    assert shown["hold"] is True and shown["counts"]["clusters"] == {"before": 12, "after": 1, "removed": 11}
    off = Reconciler(SnapshotCache(), guard=GuardSettings(enabled=False))
    off.update("file", state({f"c{i}": "1s" for i in range(12)}))
    off.build_now()
    assert off.plan("file", state({"c0": "1s"})).verdict == PUBLISH


def test_without_a_file_source_the_proposal_is_added_as_one() -> None:
    reconciler = Reconciler(SnapshotCache())
    reconciler.update("registry", DesiredState())
    reconciler.build_now()
    plan = reconciler.plan("file", state({"a": "1s"}))
    assert plan.verdict == PUBLISH and plan.groups[DEFAULT_GROUP].types["CDS"].added == ("a",)
    assert plan.sources == "file + registry"


def test_a_source_still_awaited_means_nothing_is_published_yet() -> None:
    reconciler = Reconciler(SnapshotCache(), expect=["file", "etcd"])
    plan = reconciler.plan("file", state({"a": "1s"}))
    assert plan.verdict == WAIT and plan.waiting_for == ("etcd",)
    assert plan.groups[DEFAULT_GROUP].before is None


def test_node_groups_each_get_their_plan_and_share_a_diff() -> None:
    from pilotfish.build.desired import View

    groups = {DEFAULT_GROUP: View(), NodeGroup("canary"): View()}
    reconciler = Reconciler(SnapshotCache(), build=BuildOptions(groups=groups))
    reconciler.update("file", state({"a": "1s"}))
    reconciler.build_now()
    plan = reconciler.plan("file", state({"a": "2s"}))
    assert set(plan.changed) == set(groups)
    assert plan.groups[DEFAULT_GROUP].types is plan.groups[NodeGroup("canary")].types
    assert plan.to_json(proxies={"canary": 3})["groups"]["canary"]["proxies"] == 3


def test_a_held_candidate_makes_the_verdict_not_served() -> None:
    plan = served({"a": "1s"}).plan("file", state({"a": "2s"}))
    assert plan.to_json(rollout={"decision": "held", "held": "wave canary: NACK"})["verdict"] == NOT_SERVED
    assert plan.to_json(rollout={"decision": "roll out"})["verdict"] == PUBLISH
    assert Plan(sources="x").verdict == NO_CHANGE
