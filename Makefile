# The README's two commands. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel on local disk; an unpinned torch would download a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ninfer-kv demo --out out/demo

# the suite on JOBS processes (pytest-xdist): CI has two cores; JOBS=0 runs it in one process
JOBS ?= 2

test: $(STAMP)
	$(BIN)/ruff check ninfer_kv tests benchmarks examples
	$(BIN)/python -m pytest -n $(JOBS)

lint: $(STAMP)
	$(BIN)/ruff check ninfer_kv tests benchmarks examples

clean:
	rm -rf $(VENV) build *.egg-info
