# Two commands for a fresh machine (README): `make demo` and `make test`.
# Both create or update .venv first; the install step re-runs only when its inputs change.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SGLANG := sglang==0.5.23

.PHONY: demo test test-fast lint venv lock clean

venv: $(STAMP)

$(STAMP): pyproject.toml testbed/pyproject.toml requirements/lock.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# grafana-client pulls urllib3-future, whose wheel would replace urllib3 for every program in
	@# the venv; built from source with URLLIB3_NO_OVERRIDE=1 it installs beside it instead.
	URLLIB3_NO_OVERRIDE=1 $(BIN)/pip install --quiet --disable-pip-version-check \
		--no-binary urllib3-future -r requirements/lock.txt
	@# SGLang's own requirements include GPU-only packages that cannot be imported on a CPU machine;
	@# lock.txt carries the subset SGLang needs at import time, so SGLang itself goes in without deps.
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps $(SGLANG)
	@# hs_tracer and its CPU testbed (a distribution of its own, see testbed/pyproject.toml).
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e . -e testbed
	@touch $@

demo: $(STAMP)
	$(BIN)/hs-tracer demo

test: $(STAMP)
	@# A real Prometheus server (and promtool) from Debian's package; the tests start their own.
	tests/infra/prometheus.sh
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

# The edit-test loop: every test except those that start real SGLang engines (marked `engine`).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not engine"

lint: $(STAMP)
	$(BIN)/ruff check .

# Re-resolve the pinned set from requirements/runtime.in (needs network access to PyPI).
lock:
	rm -rf /tmp/hs-tracer-lock && $(PYTHON) -m venv /tmp/hs-tracer-lock
	URLLIB3_NO_OVERRIDE=1 /tmp/hs-tracer-lock/bin/pip install --quiet --no-binary urllib3-future \
		-r requirements/runtime.in
	{ head -2 requirements/lock.txt; /tmp/hs-tracer-lock/bin/pip freeze; } > requirements/lock.txt.new
	mv requirements/lock.txt.new requirements/lock.txt

clean:
	rm -rf $(VENV) .cache
