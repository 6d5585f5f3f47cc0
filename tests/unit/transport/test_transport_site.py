"""What ``serve`` says when a listener cannot bind (:mod:`pilotfish.transport.site`), with real
sockets: each listener named with its address and its flag, every taken one at once."""

from __future__ import annotations

import errno
import socket

import pytest

from pilotfish.transport.aio import ConnectionLimits
from pilotfish.transport.site import (
    ADMIN_API,
    REGISTRY_API,
    REST_XDS,
    XDS,
    HttpConnectionLimits,
    ListenError,
    check_addresses,
    naming_failures,
)


def test_every_taken_address_is_named_at_once_with_its_flag() -> None:
    with socket.create_server(("127.0.0.1", 0)) as one, socket.create_server(("127.0.0.1", 0)) as two:
        taken = [f"127.0.0.1:{sock.getsockname()[1]}" for sock in (one, two)]
        with pytest.raises(ListenError) as caught:
            check_addresses([(XDS, taken[0]), (REGISTRY_API, None), (REST_XDS, "127.0.0.1:0"), (ADMIN_API, taken[1])])
    assert str(caught.value).splitlines() == [
        f"xDS: {taken[0]} is in use (pass --xds HOST:PORT)",
        f"admin API: {taken[1]} is in use (pass --admin HOST:PORT, or --admin off)",
    ]
    assert caught.value.errno == errno.EADDRINUSE


def test_free_addresses_pass_and_are_let_go() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    check_addresses([(REGISTRY_API, f"127.0.0.1:{port}")])
    with socket.create_server(("127.0.0.1", port)):  # not held by the check
        pass


@pytest.mark.parametrize(
    ("cause", "says"),
    [
        (OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address"), "is not an address of this host"),
        (OSError(errno.EACCES, "Permission denied"), "may not be listened on by this user (ports below 1024 need"),
        (socket.gaierror(socket.EAI_NONAME, "Name or service not known"), "cannot be resolved (Name or service"),
        (OSError(errno.EMFILE, "Too many open files"), "cannot be listened on (too many open files)"),
    ],
)
def test_other_failures_say_why_and_which_flag(cause: OSError, says: str) -> None:
    with pytest.raises(ListenError) as caught, naming_failures(REST_XDS, "example.invalid:8080"):
        raise cause
    message = str(caught.value)
    assert message.startswith(f"REST xDS: example.invalid:8080 {says}"), message
    assert message.endswith("(pass --rest HOST:PORT, or leave out --rest)"), message


def test_the_http_caps_default_as_the_xds_ones() -> None:
    for descriptors in (1024, 1 << 20):
        assert HttpConnectionLimits().caps(descriptors) == ConnectionLimits().caps(descriptors)
    assert HttpConnectionLimits(max_connections=10).caps(1024) == (10, 5)
