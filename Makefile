# The two commands of the README: `make demo` and `make test`. Both install what they need.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 1

.PHONY: demo demo-fault test test-fast lint system-deps bench cpp-recorder shim
FAULT ?= stuck
FAULT_RANK ?= 2

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU wheel first, so that the package's torch range installs nothing more
	$(PY) -m pip install -q torch==2.13.0 numpy
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

system-deps:
	scripts/install-system-deps.sh

# flare's C++ recorder, a torch extension (collectives, steps, host dispatch timing, the text format):
# built once per torch version, about a minute; see docs/design.md
cpp-recorder: $(VENV)/.installed
	$(PY) -m flare_exporter.rank.cpp_recorder

demo: $(VENV)/.installed system-deps cpp-recorder
	$(PY) -m flare_exporter.local.demo

demo-fault: $(VENV)/.installed system-deps cpp-recorder
	$(PY) -m flare_exporter.local.demo --fault $(FAULT) --fault-rank $(FAULT_RANK)

lint: $(VENV)/.installed
	$(PY) -m ruff check
	$(PY) -m ruff format --check
	$(PY) -m mypy

test: $(VENV)/.installed system-deps cpp-recorder lint
	$(PY) -m pytest -q

# the unit tests: no multi-rank job, no Prometheus, no rank process; under a minute
test-fast: $(VENV)/.installed cpp-recorder
	$(PY) -m pytest -q -m "not multirank and not prometheus and not process"

bench: $(VENV)/.installed cpp-recorder
	$(PY) benchmarks/overhead.py

# the optional launch shim (docs/shim.md): cuda_hooks/build/libflare_hooks.so, for flare-run --shim
shim:
	$(MAKE) -C cuda_hooks
