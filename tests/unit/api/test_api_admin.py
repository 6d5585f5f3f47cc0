"""The admin API's exposure warning (pilotfish.api.admin): off loopback it answers anyone."""

from __future__ import annotations

import pytest


def test_an_admin_api_off_loopback_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    from pilotfish.api.admin import warn_if_exposed

    assert not warn_if_exposed("127.0.0.1") and not warn_if_exposed("[::1]") and not warn_if_exposed("localhost")
    assert not caplog.records
    assert warn_if_exposed("0.0.0.0")
    assert "answers anyone who can reach it" in caplog.text
