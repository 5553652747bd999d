# Two commands for a fresh machine: `make demo` runs the whole pipeline on the embedded default,
# `make test` runs the test suite. Both create .venv and install what is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-12)
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
# tests/train/test_oldest_torch.py run. About 2 minutes and 5.4 GB (PyPI's torch wheels bring CUDA's libraries).
OLDEST := .venv-oldest
PY310  ?= $(firstword $(wildcard /root/.pyenv/versions/3.10.*/bin/python3.10) $(shell command -v python3.10))

.PHONY: demo test test-all test-oldest lint system-deps clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@rm -f $(VENV)/.installed-* && touch $@

demo: $(STAMP)
	$(BIN)/pipeline run --config configs/quickstart.toml

test: $(STAMP) system-deps
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/vermin -q --target=3.6- --no-tips --violations pipeline/fleet/devicecheck.py  # runs on any device Python
	$(BIN)/vermin -q --target=3.10- --no-tips --violations --eval-annotations $$($(BIN)/python -m tests.device_side)
	$(BIN)/pytest -m "not slow"
	$(MAKE) test-oldest

test-all: $(STAMP) system-deps $(OLDEST)/.installed
	$(BIN)/pytest

# Cluster training on devices with the oldest supported Python and torch (slow: stand-ins train the quickstart).
test-oldest: $(STAMP) system-deps $(OLDEST)/.installed
	$(BIN)/pytest tests/train/test_oldest_torch.py

$(OLDEST)/.installed: tests/requirements-oldest.txt
	@test -n "$(PY310)" || { echo "make: no Python 3.10 found for $(OLDEST); set PY310=/path/to/python3.10" >&2; exit 2; }
	rm -rf $(OLDEST) && $(PY310) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet -r $<
	@touch $@

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
	rm -rf artifacts/runs artifacts/devices .pytest_cache
