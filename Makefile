# The README's two commands: `make demo` runs the main job, `make test` the test suite
# (what CI runs: everything but the runs marked slow; `make test-all` adds those).
# Both set up a .venv first (skipped when it is already there).
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build on machines without a GPU; a GPU machine sets e.g. TORCH_SPEC=torch==2.13.0.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-all lint format clean

setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) launch/local.py experiments/tiny_grpo.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" --durations=15 $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q --durations=15 $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .

clean:
	rm -rf runs .pytest_cache
