# Strata developer commands. `make serve` and `make test` work on a fresh clone: both install
# first. `make serve` installs what serving needs (`pip install -e .`); `make test` and
# `make lint` the dev extra too (test tools, Ray). Each install is skipped while its stamp is
# newer than pyproject.toml; the dev install also satisfies `make serve`.
#   PIP_ARGS   extra pip flags, e.g. --extra-index-url https://download.pytorch.org/whl/cpu
#   ARGS       extra flags for `strata serve` / `strata bench`
#   PYTEST_ARGS  extra pytest flags for `make test`, e.g. "-x tests/test_cli.py" or --collect-only

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SERVE_STAMP := $(VENV)/.strata-installed-serve
DEV_STAMP := $(VENV)/.strata-installed-dev
PIP_INSTALL = $(BIN)/python -m pip install --disable-pip-version-check -q
PIP_ARGS ?=
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install install-dev serve test lint bench doctor clean-stamp

install: $(SERVE_STAMP)

install-dev: $(DEV_STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(SERVE_STAMP): pyproject.toml | $(BIN)/python
	$(PIP_INSTALL) -e . $(PIP_ARGS)
	@touch $@

$(DEV_STAMP): pyproject.toml | $(BIN)/python
	$(PIP_INSTALL) -e '.[dev]' $(PIP_ARGS)
	@touch $@ $(SERVE_STAMP)

serve: install
	$(BIN)/strata serve $(ARGS)

# With no PYTEST_ARGS the suite runs as two pytest processes side by side, so that both cores
# work: the fleet tests (whole clusters of processes: tests/cluster, tests/chaos) and the rest.
# The rest reports first, then the fleets' report (kept in $(VENV)/fleet-tests.log) follows.
FLEET_TESTS := tests/cluster tests/chaos

test: install-dev
ifeq ($(strip $(PYTEST_ARGS)),)
	@echo "+ pytest -q $(FLEET_TESTS)   (beside the rest; its report follows the rest's)"
	@$(BIN)/python -m pytest -q $(FLEET_TESTS) > $(VENV)/fleet-tests.log 2>&1 & fleets=$$!; \
	trap 'kill $$fleets 2>/dev/null' INT TERM; \
	echo "+ pytest -q $(addprefix --ignore=,$(FLEET_TESTS))"; \
	$(BIN)/python -m pytest -q $(addprefix --ignore=,$(FLEET_TESTS)); rest=$$?; \
	wait $$fleets; fleet=$$?; \
	echo "+ the fleet tests ($(FLEET_TESTS)):"; cat $(VENV)/fleet-tests.log; \
	echo "+ exit status: rest $$rest, fleet tests $$fleet"; \
	test $$rest -eq 0 && test $$fleet -eq 0
else
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
endif

lint: install-dev
	$(BIN)/ruff check strata tests
	$(BIN)/mypy strata

bench: install
	$(BIN)/strata bench $(ARGS)

doctor: install
	$(BIN)/strata doctor

clean-stamp:
	rm -f $(SERVE_STAMP) $(DEV_STAMP)
