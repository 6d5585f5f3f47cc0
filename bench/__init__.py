"""pilotfish benchmarks: a fleet simulator and the benchmarks (see bench/README.md).

Run from the repository root with the project's venv, e.g. ``.venv/bin/python -m bench.fanout --proxies 100``
or ``make bench`` for the full set (writes BENCHMARKS.md).
"""
