"""A real Envoy bootstrapped with ``pilotfish bootstrap --lrs`` reports its load to ``pilotfish serve``."""

from __future__ import annotations

import pytest

from .processes import unlabelled_metrics, wait_until
from .testbed import Testbed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


def lrs_metrics(testbed: Testbed) -> dict[str, float]:
    return unlabelled_metrics(testbed.control_plane.admin, "pilotfish_lrs")


def test_an_envoy_reports_its_load_on_the_xds_port_every_interval(testbed: Testbed) -> None:
    testbed.control_plane.options = ("--lrs-interval-ms", "300")
    envoy = testbed.start(envoy_options={"bootstrap_options": ("--lrs",)})
    for _ in range(20):
        assert testbed.request("/")[0] == 200
    wait_until(
        lambda: lrs_metrics(testbed).get("pilotfish_lrs_reports", 0) >= 2,
        timeout=20,
        what="Envoy's load reports (two of them) to be counted",
        details=lambda: f"{lrs_metrics(testbed)}\n{envoy.log_tail()}",
    )
    counts = lrs_metrics(testbed)
    assert counts["pilotfish_lrs_streams"] == 1  # one stream, for the one Envoy
    assert counts["pilotfish_lrs_reports_dropped"] == 0  # Envoy keeps to the interval it was given
