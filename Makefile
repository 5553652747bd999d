# Two commands for a fresh machine: `make demo` runs the whole pipeline on the embedded default,
# `make test` runs the test suite. Both create .venv and install what is missing, from requirements.lock: every
# package at an exact version with its sha256, so a new upstream release changes nothing until `make lock-upgrade`
# moves the lock (docs/install.md). `make test-latest` tries the newest releases pyproject's ranges allow.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
LOCK   := requirements.lock
# Re-install when the lock or the project's own metadata (entry points, package data) changes.
STAMP  := $(VENV)/.installed-$(shell cat $(LOCK) pyproject.toml | sha256sum | cut -c1-12)
# uv trusts the system's certificate store, as pip does: behind a proxy that re-signs TLS (companies, CI) the
# proxy's CA is there, and uv's built-in roots would refuse PyPI.
export UV_SYSTEM_CERTS := 1
# The lock's own command line: universal (any OS and CPU, Python 3.11 on), hashes for every file.
COMPILE = $(BIN)/uv pip compile --quiet --universal --generate-hashes --custom-compile-command "make lock"
# $(call install,VENV,LOCKFILE): exactly the lock in VENV (what else is there goes), then the project, editable,
# built by the lock's setuptools.
install = $(BIN)/uv pip sync --quiet --python $(1)/bin/python --require-hashes $(2) && \
    $(BIN)/uv pip install --quiet --python $(1)/bin/python --no-deps --no-build-isolation -e .
# Debian packages the stand-in Jetson tests need (real sshd per device, namespaces; BusyBox, whose bare sh and
# applets show the device-side script asks for nothing beyond POSIX); they skip, saying so, without.
JETSON_PKGS := openssh-server openssh-client util-linux iproute2 procps busybox
# Headless Chromium and its driver, for the test that opens the report in Prefect's UI (tests/flows/test_report_ui.py).
BROWSER_PKGS := chromium chromium-driver
# Real photographs (Tux Paint's stamps: animals, fruit, flowers cut out of photos) for the tests that train on a
# photo folder (tests/photos.py builds it at test time).
PHOTO_PKGS := tuxpaint-stamps-default
# strace: the durability test reads the order of fsync and rename a stage makes.
TRACE_PKGS := strace
SYSTEM_PKGS := $(JETSON_PKGS) $(BROWSER_PKGS) $(PHOTO_PKGS) $(TRACE_PKGS)
# The oldest device Python and torch (JetPack 6: Python 3.10, torch 2.5), which the stand-in devices of
# tests/train/cluster/test_oldest_torch.py run. About 2 minutes and 5.4 GB (PyPI's torch wheels bring CUDA's
# libraries).
OLDEST := .venv-oldest
PY310  ?= $(firstword $(wildcard /root/.pyenv/versions/3.10.*/bin/python3.10) $(shell command -v python3.10))

.PHONY: demo test test-all test-oldest test-latest lint docs lock lock-upgrade fresh-check system-deps clean

# uv comes from the lock too: pip installs its one hashed entry (awk cuts it out), then uv installs the rest.
$(BIN)/uv:
	@$(PYTHON) -c 'import ensurepip' 2>/dev/null || $(MAKE) --no-print-directory system-deps SYSTEM_PKGS=python3-venv
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	awk '/^uv==/ {keep = 1; print; next} /^[^ ]/ {keep = 0} keep' $(LOCK) \
	    | $(BIN)/python -m pip install --quiet --require-hashes --no-deps -r /dev/stdin

$(STAMP): $(LOCK) pyproject.toml | $(BIN)/uv
	$(call install,$(VENV),$(LOCK))
	@rm -f $(VENV)/.installed-* && touch $@

demo: $(STAMP)
	$(BIN)/pipeline run --config configs/quickstart.toml

test: $(STAMP) system-deps
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/vermin -q --target=3.6- --no-tips --violations pipeline/fleet/devicecheck.py  # runs on any device Python
	$(BIN)/vermin -q --target=3.10- --no-tips --violations --eval-annotations $$($(BIN)/python -m tests.device_side)
	$(BIN)/mkdocs build --strict
	$(BIN)/pytest -m "not slow"
	$(MAKE) test-oldest

test-all: $(STAMP) system-deps $(OLDEST)/.installed
	$(BIN)/pytest

# Cluster training on devices with the oldest supported Python and torch (slow: stand-ins train the quickstart).
test-oldest: $(STAMP) system-deps $(OLDEST)/.installed
	$(BIN)/pytest tests/train/cluster/test_oldest_torch.py

$(OLDEST)/.installed: tests/requirements-oldest.lock | $(BIN)/uv
	@test -n "$(PY310)" || { echo "make: no Python 3.10 found for $(OLDEST); set PY310=/path/to/python3.10" >&2; exit 2; }
	rm -rf $(OLDEST) && $(PY310) -m venv $(OLDEST)
	$(BIN)/uv pip sync --quiet --python $(OLDEST)/bin/python --require-hashes $<
	@touch $@

# Refresh the locks after editing pyproject.toml or tests/requirements-oldest.txt: versions already locked stay.
lock: | $(BIN)/uv
	$(COMPILE) --python-version 3.11 --extra dev pyproject.toml -o $(LOCK)
	$(COMPILE) --python-version 3.10 tests/requirements-oldest.txt -o tests/requirements-oldest.lock

# Move the application lock to the newest releases pyproject allows (after `make test-latest` passes).
lock-upgrade: | $(BIN)/uv
	$(COMPILE) --python-version 3.11 --extra dev pyproject.toml -o $(LOCK) --upgrade

# The quick suite against the newest releases pyproject allows, in .venv-latest; first, what differs from the lock.
LATEST := .venv-latest
test-latest: system-deps | $(BIN)/uv
	@test -x $(LATEST)/bin/python || $(PYTHON) -m venv $(LATEST)
	$(COMPILE) --python-version 3.11 --extra dev pyproject.toml --upgrade -o $(LATEST)/requirements.txt
	$(BIN)/python .ci/lockdiff.py $(LOCK) $(LATEST)/requirements.txt
	$(call install,$(LATEST),$(LATEST)/requirements.txt)
	$(LATEST)/bin/ruff check .
	$(LATEST)/bin/pytest -m "not slow"

# The README's two commands in a fresh clone of HEAD, as a new user runs them: empty HOME, no pip or uv cache.
fresh-check:
	bash .ci/fresh-check

# The docs site into artifacts/site/ (open artifacts/site/index.html); strict: a broken link, a missing anchor, a page
# left out of the nav or an unknown generated block fails it (docs/install.md, "The docs site").
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/lint-imports

system-deps:
	@missing=$$(for p in $(SYSTEM_PKGS); do \
	    dpkg-query -W -f='$${db:Status-Abbrev}' $$p 2>/dev/null | grep -q '^ii' || echo $$p; done); \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	else echo "tests needing them will skip: missing $$missing (apt-get install $$missing, as root)"; fi

clean:
	rm -rf artifacts/runs artifacts/devices artifacts/site .pytest_cache
