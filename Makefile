# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install serve chat test test-fast lint docs bench image clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: a loose `torch` requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml $(wildcard pdserve/kernels/*.cpp pdserve/kernels/*.h) | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0 triton==3.6.0
	$(PIP) install -q -e '.[test]'
	@# The CPU decode kernel, built once here (~30-75 s) so that no engine waits for it; without a
	@# C++ compiler the engine uses the torch path (kernels/cpu_native.py).
	$(PY) -c "from pdserve.kernels import cpu_native; cpu_native.build()" || echo "CPU decode kernel not built: the torch path serves"
	touch $(STAMP)

install: $(STAMP)

# Fetch the default model (once, cached), start router + 1 prefill + 1 decode node on
# http://127.0.0.1:8000, ask it one demo question, and keep serving until Ctrl-C.
serve: $(STAMP)
	$(VENV)/bin/pdserve serve --model smollm2 --demo $(ARGS)

# Offline chat with the default model, no server.
chat: $(STAMP)
	$(VENV)/bin/pdserve chat --model smollm2 $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# ruff, and import-linter's contracts in pyproject.toml (the layers point one way).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# The documentation site (mkdocs.yml, pages under docs/) into build/site; --strict fails on any
# warning: a broken link, a page left out of the nav.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir build/site

bench: $(STAMP)
	$(PY) -m benchmarks.offline

# The compose stack's images (pdserve:cpu, pdserve-prometheus), built offline from a wheelhouse:
# see docker/build.sh. Needs a Docker engine; BASE_IMAGE=... picks the base.
image: $(STAMP)
	PYTHON=$(PY) bash docker/build.sh

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
