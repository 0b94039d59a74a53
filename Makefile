# `make test` and `make demo` work on a machine that has only Python: each creates .venv,
# installs torch's CPU wheel (pinned), installs the project, then runs.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-extended lint format demo check-specs replay bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "torch==$(TORCH_VERSION)"
	$(BIN)/pip install --quiet -e ".[dev,hf]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The search tests start their own PostgreSQL server and headless Chromium; the script installs
# them with apt-get when missing (and returns at once when they are there).
# `extended` tests (pyproject.toml) are cases beside a representative that `make test` runs:
# they would take the suite past its 12 minutes on 2 cores; `make test-extended` runs them.
test: lint
	bash scripts/ensure-test-services.sh
	$(BIN)/python -m pytest -m "not extended"

test-extended: $(STAMP)
	bash scripts/ensure-test-services.sh
	$(BIN)/python -m pytest -m extended

# The main job: the quickstart study, its report, the best spec (its time: README.md).
demo: $(STAMP)
	$(BIN)/miras search studies/quickstart.yaml --workers 2
	$(BIN)/miras report studies/quickstart.yaml -o runs/quickstart-report
	$(BIN)/miras export studies/quickstart.yaml --best -o runs/quickstart-best.yaml

# Derive and check every shipped spec.
check-specs: $(STAMP)
	@for spec in specs/*.yaml specs/examples/*.yaml; do \
		echo "== $$spec"; \
		$(BIN)/miras derive $$spec || exit 1; \
		$(BIN)/miras check $$spec || exit 1; \
	done

# Replay the compiler on every shipped spec and diff its outputs against tests/golden/
# (`.venv/bin/python scripts/replay.py --update` rewrites them after a reviewed change).
replay: $(STAMP)
	$(BIN)/python scripts/replay.py

bench: $(STAMP)
	$(BIN)/python benchmarks/compile_time.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
