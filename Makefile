# Two commands for a fresh Linux machine: `make run` (dashboard) and `make test` (whole suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8501
export OMP_NUM_THREADS ?= 1
# This host sets PYTHONDONTWRITEBYTECODE: every test worker, rank and CLI process would compile the repository's own
# modules anew (pytest's collection alone took 15 s per worker instead of 9.6 s). The clone's __pycache__ is ignored.
export PYTHONDONTWRITEBYTECODE :=

.PHONY: run test test-fast lint worker browser clean postgres slurm gpu-check gpu-wheels

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# uv installs the same pinned set as pip in ~45 s where pip takes ~100 s (this host, a fresh venv, warm caches). It is
# given pip's own find-links and constraint (the local CPU torch wheel). It compiles bytecode as pip does: this machine
# sets PYTHONDONTWRITEBYTECODE, so every process would otherwise compile torch anew (pass 2 took 1.5x as long).
# Where uv cannot be had or fails, pip installs.
UV := $(VENV)/bin/uv
PIP_CONFIG = $(shell $(PYTHON) -m pip config list 2>/dev/null | sed -n "s/^global.$(1)='\(.*\)'$$/\1/p")
UV_ARGS = $(foreach l,$(call PIP_CONFIG,find-links),--find-links $(l)) \
  $(foreach c,$(call PIP_CONFIG,constraint),--constraint $(c))
install = ($(UV) pip install -q --compile-bytecode --python $(PY) $(UV_ARGS) $(1) || $(PY) -m pip install -q $(1))

$(VENV)/.installed: requirements.txt | $(VENV)/bin/python
	$(PY) -m pip install -q uv==0.13.9 || echo "warning: uv unavailable; pip installs instead"
	$(call install,-r requirements.txt)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed $(VENV)/.installed-frameworks requirements-test.txt
	$(call install,-r requirements-test.txt)
	touch $@

# DeepSpeed (CPU build, no ops compiled) and JAX (CPU): issue 14. No build isolation: DeepSpeed's setup.py must see
# the pinned CPU torch, never pull its own.
$(VENV)/.installed-frameworks: $(VENV)/.installed requirements-frameworks.txt
	export DS_BUILD_OPS=0; $(call install,--no-build-isolation -r requirements-frameworks.txt)
	touch $@

run: $(VENV)/.installed $(VENV)/.installed-frameworks
	$(PY) -m dashboard.serve --host '$(HOST)' --port '$(PORT)'  # refuses a non-loopback HOST without auth (README)

worker: $(VENV)/.installed $(VENV)/.installed-frameworks
	$(PY) -m backend worker

# Headless Chromium for the real-browser test comes from Debian; playwright cannot download its own here.
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	      || echo "warning: could not install chromium; the browser test will be skipped"; \
	  else echo "warning: /usr/bin/chromium missing and apt-get unavailable; the browser test will be skipped"; fi; \
	fi

# A real PostgreSQL server for the store tests (started by the tests themselves in a temp dir; see tests/helpers/pg_server.py).
postgres:
	@if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null) \
	      || echo "warning: could not install postgresql; the PostgreSQL store tests will be skipped"; \
	  else echo "warning: postgresql missing and apt-get unavailable; the PostgreSQL store tests will be skipped"; fi; \
	fi

# A real SLURM cluster (slurmctld + 2 slurmd on 127.0.0.1) for tests/e2e/test_slurm.py, started by the tests themselves.
slurm:
	@if ! command -v slurmctld >/dev/null 2>&1 || ! command -v slurmd >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm >/dev/null) \
	      || echo "warning: could not install slurm-wlm; the SLURM tests will be skipped"; \
	  else echo "warning: slurm-wlm missing and apt-get unavailable; the SLURM tests will be skipped"; fi; \
	fi

# One pytest-xdist run of the whole suite on 2 workers, in the order tests/helpers/schedule.py gives: the tests that
# need a process of their own or real components (ranks, workers, browser, PostgreSQL, SLURM) a file at a time (an
# xdist group per file: a file's tests, and its module fixtures such as the SLURM cluster, stay on one worker, in
# order), those that wait on real components first; the fast unit tests last, test by test, filling both workers to
# the end. The tests' rank programs run on the farm (tests/helpers/farm.py: one torchrun launch per world size, in a
# thread of one worker, from the start, overlapping the other tests).
test: $(VENV)/.installed-test browser postgres slurm
	@rc=0; $(PY) -m ruff check . || rc=$$?; \
	  $(PY) -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder --durations=25 || rc=$$?; exit $$rc

# ruff.toml's rules (line length 120; pycodestyle, pyflakes, isort, bugbear, pyupgrade); `make test` runs it first.
lint: $(VENV)/.installed-test
	$(PY) -m ruff check .

# The unit tests (one process, pure Python; tests/conftest.py says how a test's kind is found) of under half a
# second: not those marked slow, serial or heavy, which `make test` runs.
test-fast: $(VENV)/.installed-test
	$(PY) -m pytest -q -n 2 -m "unit and not slow and not serial and not heavy"

# The GPU check (issue 22 A; benchmarks/gpu_check.py): device cuda when this machine has one, else the CPU kit
# (gloo, tiny model). Output in GPU_CHECK_OUT (report.json, summary.md, profile.json, kit.log).
GPU_CHECK_OUT ?= test-artifacts/gpu-check
GPU_CHECK_DEVICE ?= $(shell $(PY) -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')" 2>/dev/null || echo cpu)
GPU_CHECK_BUDGET_S ?= 330
gpu-check: $(VENV)/.installed
	$(PY) benchmarks/gpu_check.py --device $(GPU_CHECK_DEVICE) --out $(GPU_CHECK_OUT) --budget-s $(GPU_CHECK_BUDGET_S)

# Wheels the device machine lacks (requirements-gpu.txt), for Python 3.12 on manylinux x86_64; the folder is ignored
# by git, so the device command must carry it. Prints the size of the tree + wheels (64 MiB travel at most).
GPU_WHEELS := .gpu-wheels
gpu-wheels: $(VENV)/.installed
	rm -rf $(GPU_WHEELS)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_17_x86_64 -d $(GPU_WHEELS) -r requirements-gpu.txt
	@echo "wheels: $$(du -sb $(GPU_WHEELS) | cut -f1) bytes; tree (tracked + untracked, not ignored): \
	$$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- | tail -1 | cut -f1) bytes; limit 67108864"

clean:
	rm -rf $(VENV) .pytest_cache test-artifacts
