# Strata developer commands. `make serve` and `make test` work on a fresh clone: both install
# first. Installing is skipped while the stamp is newer than pyproject.toml.
#   PIP_ARGS   extra pip flags, e.g. --extra-index-url https://download.pytorch.org/whl/cpu
#   ARGS       extra flags for `strata serve` / `strata bench`

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.strata-installed
PIP_ARGS ?=
ARGS ?=

.PHONY: install serve test lint bench clean-stamp

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || { echo "creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	$(BIN)/python -m pip install --disable-pip-version-check -q -e '.[dev]' $(PIP_ARGS)
	@touch $(STAMP)

serve: install
	$(BIN)/strata serve $(ARGS)

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check strata tests
	$(BIN)/mypy strata

bench: install
	$(BIN)/strata bench $(ARGS)

clean-stamp:
	rm -f $(STAMP)
