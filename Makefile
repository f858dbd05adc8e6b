# LongStraw: `make demo` runs the main job, `make test` runs the tests. Each sets itself up from nothing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-slow lint demo bench clean

install: $(STAMP)

# torch first (the CPU wheel on disk here; the normal PyPI build elsewhere), then the package with its dev extra.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q

test-slow: install
	$(BIN)/python -m pytest -q -m slow

lint: install
	$(BIN)/ruff check src tests

# The main job on its built-in default: the side-by-side memory/time comparison of the four plans.
demo: install
	$(BIN)/longstraw bench memory --demo

bench: install
	$(BIN)/longstraw bench memory

clean:
	rm -rf $(VENV) build src/*.egg-info
