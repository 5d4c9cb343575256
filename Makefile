# Two entry points on a fresh machine: `make demo` and `make test`. Each bootstraps .venv itself.
# TORCH_SPEC: on machines without a GPU keep a CPU build of torch (the default here resolves to
# the CPU wheel already on disk); set it to what your platform needs otherwise.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: demo test lint bench-core clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,dev,metrics]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/tiered-kv demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check tiered_kv tests bench
	$(VENV)/bin/ruff format --check tiered_kv tests bench
	$(VENV)/bin/mypy

bench-core: $(VENV)/.installed
	$(PY) bench/core.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache
