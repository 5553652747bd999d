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

.PHONY: demo test test-all lint system-deps clean

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
	$(BIN)/pytest -m "not slow"

test-all: $(STAMP) system-deps
	$(BIN)/pytest

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
