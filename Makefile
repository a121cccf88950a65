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

.PHONY: install install-dev serve test durations lint bench doctor clean-stamp

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
# work, each over half the test files by measured time (tests/split.py balances them by
# tests/durations.json; `make durations` runs the suite and refreshes it). The first part
# reports first, then the second's report (kept in $(VENV)/test-part-1.log) follows, then the
# CPU the run used against the cores' time (--record-cpu: whether it was bound by CPU or waits).
PARTS_DIR := $(VENV)/test-parts

test: install-dev
ifeq ($(strip $(PYTEST_ARGS)),)
	@mkdir -p $(PARTS_DIR)
	@$(BIN)/python tests/split.py part 0 2 > $(PARTS_DIR)/0.txt
	@$(BIN)/python tests/split.py part 1 2 > $(PARTS_DIR)/1.txt
	@echo "+ pytest -q: $$(wc -l < $(PARTS_DIR)/0.txt) files beside $$(wc -l < $(PARTS_DIR)/1.txt) (balanced by tests/durations.json)"
	@started=$$(date +%s); \
	$(BIN)/python -m pytest -q --record-durations=$(PARTS_DIR)/1.json \
		--record-cpu=$(PARTS_DIR)/1-cpu.json $$(cat $(PARTS_DIR)/1.txt) \
		> $(PARTS_DIR)/1.log 2>&1 & second=$$!; \
	trap 'kill $$second 2>/dev/null' INT TERM; \
	$(BIN)/python -m pytest -q --record-durations=$(PARTS_DIR)/0.json \
		--record-cpu=$(PARTS_DIR)/0-cpu.json $$(cat $(PARTS_DIR)/0.txt); first=$$?; \
	wait $$second; second_status=$$?; \
	echo "+ the second part ($$(wc -l < $(PARTS_DIR)/1.txt) files):"; cat $(PARTS_DIR)/1.log; \
	wall=$$(( $$(date +%s) - started )); \
	echo "+ exit status: first part $$first, second part $$second_status; wall $$wall s"; \
	$(BIN)/python tests/split.py cpu $$wall $(PARTS_DIR)/0-cpu.json $(PARTS_DIR)/1-cpu.json; \
	test $$first -eq 0 && test $$second_status -eq 0
else
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
endif

# Runs the suite as `make test` does (whatever its outcome), then writes what each test file
# took into tests/durations.json: commit it so that CI's two parts stay balanced.
durations: install-dev
	-@$(MAKE) --no-print-directory test PYTEST_ARGS=
	$(BIN)/python tests/split.py record $(PARTS_DIR)/0.json $(PARTS_DIR)/1.json

lint: install-dev
	$(BIN)/ruff check strata tests bench
	$(BIN)/mypy strata

bench: install
	$(BIN)/strata bench $(ARGS)

doctor: install
	$(BIN)/strata doctor

clean-stamp:
	rm -f $(SERVE_STAMP) $(DEV_STAMP)
