# ddpkit: two commands on a fresh machine.
#   make run   - create .venv, install, run the main job on an embedded default
#   make test  - create .venv, install (and, as root, the infrastructure packages), run lint and the whole suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEBS := munge slurmctld slurmd slurm-client libpmix-dev openmpi-bin libopenmpi-dev mpich libmpich-dev \
        iproute2 etcd-server shellcheck procps chromium

.PHONY: run test lint unit bench venv infra-deps clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,plots,k8s,etcd,mpi]'
	touch $(STAMP)

venv: $(STAMP)

# Debian packages for the infrastructure tests (real MPI, Slurm, etcd, network namespaces) and the headless browser
# that opens ddpkit report's HTML page (chromium).
# Installed only when running as root; elsewhere those tests skip and say why.
infra-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=$$(for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	  if [ -n "$$missing" ]; then \
	    echo "installing Debian packages: $$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	  fi; \
	else echo "not root: infrastructure packages not installed; infra tests will skip"; fi

run: $(STAMP)
	$(VENV)/bin/ddpkit env -n 2 --connect
	$(VENV)/bin/ddpkit check -n 2
	mkdir -p .ddpkit-run
	$(VENV)/bin/ddpkit train -n 2 --epochs 5 --snapshot-path .ddpkit-run/snapshot.pt

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

test: $(STAMP) infra-deps lint
	$(PY) -m pytest -q -n 3 --dist loadgroup --durations=25 -m "not serial" tests
	$(PY) -m pytest -q -m serial tests

bench: $(STAMP)
	set -e; for b in benchmarks/bench_*.py; do n=$$(basename $$b .py); echo "== $$n"; $(PY) -m benchmarks.$$n; done
	$(PY) benchmarks/scale_model.py

clean:
	rm -rf $(VENV) .ddpkit-run .pytest_cache .mypy_cache .ruff_cache
