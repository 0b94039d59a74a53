# `make test` and `make demo` work on a machine that has only Python: each creates .venv,
# installs torch's CPU wheel (pinned), installs the project, then runs.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test lint format demo bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "torch==$(TORCH_VERSION)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: lint
	$(BIN)/python -m pytest

# Until the search lands, the demo derives and checks every shipped spec.
demo: $(STAMP)
	@for spec in specs/*.yaml specs/examples/*.yaml; do \
		echo "== $$spec"; \
		$(BIN)/miras derive $$spec || exit 1; \
		$(BIN)/miras check $$spec || exit 1; \
	done

bench: $(STAMP)
	$(BIN)/python benchmarks/compile_time.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
