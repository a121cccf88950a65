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

# With no PYTEST_ARGS the suite runs as $(PARTS) pytest processes side by side, each over its
# share of the test files by measured time (tests/split.py balances them by tests/durations.json;
# `make durations` runs the suite and refreshes it). Three, not two, on two cores: a part keeps
# less than one core busy (its tests wait on processes, sockets and clocks; `make test` prints
# the CPU each run used against the cores' time), so a third fills what the two leave idle:
# 669 s of wall time, cores 78 % busy, on a 2-core EPYC; 782 s, 83 % busy, on a 2-vCPU AMX Xeon.
# The first part reports first, then each other's report (kept in $(PARTS_DIR)/N.log).
PARTS ?= 3
PARTS_DIR := $(VENV)/test-parts
OTHER_PARTS = $(shell seq 1 $$(( $(PARTS) - 1 )))

test: install-dev
ifeq ($(strip $(PYTEST_ARGS)),)
	@mkdir -p $(PARTS_DIR)
	@rm -f $(PARTS_DIR)/*.json $(PARTS_DIR)/*.log
	@for i in $$(seq 0 $$(( $(PARTS) - 1 ))); do \
		$(BIN)/python tests/split.py part $$i $(PARTS) > $(PARTS_DIR)/$$i.txt; done
	@echo "+ pytest -q in $(PARTS) parts side by side: $$(for i in $$(seq 0 $$(( $(PARTS) - 1 ))); do printf '%s ' $$(wc -l < $(PARTS_DIR)/$$i.txt); done)files (balanced by tests/durations.json)"
	@started=$$(date +%s); pids=""; \
	for i in $(OTHER_PARTS); do \
		$(BIN)/python -m pytest -q --record-durations=$(PARTS_DIR)/$$i.json \
			--record-cpu=$(PARTS_DIR)/$$i-cpu.json $$(cat $(PARTS_DIR)/$$i.txt) \
			> $(PARTS_DIR)/$$i.log 2>&1 & pids="$$pids $$!"; \
	done; \
	trap 'kill $$pids 2>/dev/null' INT TERM; \
	$(BIN)/python -m pytest -q --record-durations=$(PARTS_DIR)/0.json \
		--record-cpu=$(PARTS_DIR)/0-cpu.json $$(cat $(PARTS_DIR)/0.txt); statuses=$$?; \
	i=1; for pid in $$pids; do \
		wait $$pid; statuses="$$statuses $$?"; \
		echo "+ part $$i ($$(wc -l < $(PARTS_DIR)/$$i.txt) files):"; cat $(PARTS_DIR)/$$i.log; \
		i=$$(( i + 1 )); \
	done; \
	wall=$$(( $$(date +%s) - started )); \
	echo "+ exit status of each part: $$statuses; wall $$wall s"; \
	$(BIN)/python tests/split.py cpu $$wall $(PARTS_DIR)/*-cpu.json; \
	for status in $$statuses; do test $$status -eq 0 || exit 1; done
else
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
endif

# Runs the suite as `make test` does (whatever its outcome), then writes what each test file
# took into tests/durations.json: commit it so that CI's parts stay balanced.
durations: install-dev
	-@$(MAKE) --no-print-directory test PYTEST_ARGS=
	$(BIN)/python tests/split.py record $$(ls $(PARTS_DIR)/*.json | grep -v -- -cpu.json)

lint: install-dev
	$(BIN)/ruff check strata tests bench
	$(BIN)/mypy strata

bench: install
	$(BIN)/strata bench $(ARGS)

doctor: install
	$(BIN)/strata doctor

clean-stamp:
	rm -f $(SERVE_STAMP) $(DEV_STAMP)
