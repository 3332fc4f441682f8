# The two commands of the README: `make demo` and `make test`. Both install what they need.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 1

.PHONY: demo demo-fault test lint system-deps bench native op-timer
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

# the native host-dispatch timer (a torch C++ extension, ~20 s once per torch version; see docs/ild.md)
op-timer: $(VENV)/.installed
	$(PY) -m flare_exporter.rank.cpp_recorder

demo: $(VENV)/.installed system-deps op-timer
	$(PY) -m flare_exporter.local.demo

demo-fault: $(VENV)/.installed system-deps op-timer
	$(PY) -m flare_exporter.local.demo --fault $(FAULT) --fault-rank $(FAULT_RANK)

test: $(VENV)/.installed system-deps op-timer
	$(PY) -m ruff check
	$(PY) -m mypy
	$(PY) -m pytest -q

bench: $(VENV)/.installed op-timer
	$(PY) benchmarks/overhead.py

# the optional native launch shim (docs/native.md): cuda_hooks/build/libflare_hooks.so, for flare-run --native
native:
	$(MAKE) -C cuda_hooks
