"""``serve``'s process setup (pilotfish.app.serve): the open-file limit raised to the hard limit."""

from __future__ import annotations

import resource

from pilotfish.app.serve import raise_descriptor_limit


def test_serve_raises_its_open_file_limit_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:  # make room to raise it (the hard limit stays)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    limit = raise_descriptor_limit()
    now_soft, now_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert now_hard == hard and now_soft == limit
    assert now_soft == (hard if hard != resource.RLIM_INFINITY else 1 << 20)
