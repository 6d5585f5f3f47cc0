"""Policy checks: node authorization (``--authorize-node``, with captures) and SDS grants, in-process.

What a peer can make pilotfish do, and what an edit of the grants file costs:

- **refusing a hostile node id**: :meth:`~pilotfish.policy.authorize.NodeAuthorizer.refusal` of
  node ids of ``--length`` characters shaped to make a backtracking matcher blow up (many ``*``
  before a text that is missing; 100,000 ``/``), for a capture rule and a plain one; the
  identity is long too. The best of ``--repeat`` runs (what the matcher costs, not the machine's
  noise), in microseconds. A regular expression of the same patterns does not finish.
- **grants per proxy**: :meth:`~pilotfish.policy.grants.SecretGrants.for_proxy` for ``--proxies``
  proxies under ``--grants`` identity grants, on fresh grants each run: what serving under new
  grants costs every open SDS stream at once (an edit of the grants file,
  :meth:`~pilotfish.xds.server.XdsPolicy.set_grants`). With as many identities as proxies, and
  with the proxies sharing 100 identities (the replicas of a service account).

``python -m bench.bench_policy`` prints the tables (a few seconds).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Sequence

from pilotfish.policy.authorize import NodeAuthorizer, parse_rule
from pilotfish.policy.grants import SecretGrants, parse_grant

from .report import print_table

AUTHORIZE_COLUMNS = ("rule", "node id", "identity chars", "node id chars", "best of runs")
GRANTS_COLUMNS = ("proxies", "identity grants", "distinct identities", "all proxies", "per proxy")


def _best(run: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def run_authorize(length: int, repeat: int) -> list[Sequence[object]]:
    rules = {
        "capture": "spiffe://mesh/ns/{ns}/sa/{sa}={sa}*a*a*a*a*a*a*a*a*c*{ns}",
        "plain": "spiffe://mesh/ns/*/sa/*=*a*a*a*a*a*a*a*a*c*",
    }
    half = length // 2
    identity = "spiffe://mesh/ns/" + "a" * half + "/sa/" + "a" * half
    nodes = {"'a' x N (no 'c')": "a" * length, "'/' x N": "/" * length}
    rows: list[Sequence[object]] = []
    for name, rule in rules.items():
        authorizer = NodeAuthorizer([parse_rule(rule)])
        for shape, node in nodes.items():
            if authorizer.refusal(identity, node) is None:
                raise AssertionError(f"the {name} rule let a hostile node id through: the table would time nothing")
            seconds = _best(functools.partial(authorizer.refusal, identity, node), repeat)
            rows.append((name, shape, f"{len(identity):,}", f"{len(node):,}", f"{seconds * 1e6:.0f} us"))
    return rows


def run_grants(proxies: int, grants: int, repeat: int) -> list[Sequence[object]]:
    rows: list[Sequence[object]] = []
    for identities in (proxies, 100):

        def regrant(identities: int = identities) -> None:
            fresh = SecretGrants(
                parse_grant(f"svc-{i}-cert=identity:spiffe://mesh/ns/*/sa/svc-{i}") for i in range(grants)
            )
            for i in range(proxies):
                fresh.for_proxy(identity=f"spiffe://mesh/ns/prod/sa/svc-{i % identities}", node_id=f"proxy-{i}")

        seconds = _best(regrant, repeat)
        rows.append(
            (f"{proxies:,}", grants, f"{identities:,}", f"{seconds * 1e3:.0f} ms", f"{seconds / proxies * 1e6:.1f} us")
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_policy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=100_000, help="characters of the hostile node id")
    parser.add_argument("--proxies", type=int, default=10_000, help="open SDS streams to work grants out for")
    parser.add_argument("--grants", type=int, default=100, help="identity grants")
    parser.add_argument("--repeat", type=int, default=5, help="runs per row (the best is shown)")
    args = parser.parse_args(argv)
    print_table(AUTHORIZE_COLUMNS, run_authorize(args.length, args.repeat))
    print()
    print_table(GRANTS_COLUMNS, run_grants(args.proxies, args.grants, args.repeat))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
