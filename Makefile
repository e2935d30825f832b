# Two entry points for a newcomer: `make demo` and `make test`. Both build .venv from nothing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_ARGS ?=

.PHONY: setup demo simulate test lint bench-quality bench-overlap bench-allreduce bench-nat clean \
	bench-wan bench-join bench-churn bench-byzantine

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Users with a GPU bring their own torch; otherwise take the pinned CPU build (an
	# unpinned torch would pull a multi-GB CUDA build).
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --no-compile torch==2.13.0
	# The hf extra (transformers, which brings no torch of its own): CI trains a local
	# Hugging Face model directory (tests/integration/test_multirank.py).
	$(PY) -m pip install -q --no-compile -e '.[dev,hf]'
	# pip's byte-compile, on every core instead of one. Like pip, it passes over the few
	# packaged files that are not Python 3, which make it exit 1.
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $(STAMP)

# A bootstrap peer and 3 training nodes on loopback, one process each (bounded: --steps).
demo: $(STAMP)
	$(VENV)/bin/dilonode swarm --nodes 3 --config configs/demo.toml $(DEMO_ARGS)

# The same algorithm with 4 virtual workers in one process, exact byte counts and a plot.
simulate: $(STAMP)
	$(VENV)/bin/dilonode simulate --config configs/demo.toml $(DEMO_ARGS)

# --durations lists the slowest tests: make test is kept under 20 minutes on 2 cores, in two
# xdist workers (tests/conftest.py says which tests run one at a time).
# .ci/system-deps installs chromium and iptables (some tests drive them) when run as root.
test: $(STAMP)
	bash .ci/system-deps
	$(VENV)/bin/ruff check dilonode tests benchmarks protocol deploy testbed
	$(PY) -m pytest -q -ra --durations=15 -n 2 --dist loadgroup tests

lint: $(STAMP)
	$(VENV)/bin/ruff check dilonode tests benchmarks protocol deploy testbed
	$(VENV)/bin/mypy --strict dilonode/algo dilonode/wire

# About 2.5 h on the 2-core box (docs/reports/2026-11-25-quality.md); --resume continues an interrupted run.
bench-quality: $(STAMP)
	OMP_NUM_THREADS=1 nice -n 10 $(PY) -m benchmarks.sim.quality --sweep 1.875e-4,3.75e-4,7.5e-4,1.5e-3,3e-3,6e-3 \
		--seeds 3 --jobs 2 --json runs/bench/quality.json --plot docs/img/quality.png --resume

bench-overlap: $(STAMP)
	$(PY) -m benchmarks.loopback.overlap --json runs/bench/overlap.json

bench-allreduce: $(STAMP)
	$(PY) -m benchmarks.loopback.allreduce --hivemind --json runs/bench/allreduce.json

bench-byzantine: $(STAMP)
	$(PY) -m benchmarks.sim.byzantine --steps 300 --sync-every 30 --json runs/bench/byzantine.json

# The WAN test bed (testbed/hosts.py) needs root: network namespaces, veth, tbf.
bench-wan: $(STAMP)
	$(PY) -m benchmarks.testbed.wan --rates 100,20 --json runs/bench/wan.json

bench-join: $(STAMP)
	$(PY) -m benchmarks.testbed.join --rates 100 --json runs/bench/join.json

bench-churn: $(STAMP)
	$(PY) -m benchmarks.testbed.churn --json runs/bench/churn.json

# NAT hosts on the test bed also need iptables-restore.
bench-nat: $(STAMP)
	$(PY) -m benchmarks.testbed.nat --json runs/bench/nat.json

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .hypothesis
