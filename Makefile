# Fresh machine: `make demo` or `make test`; both create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of torch lies on local disk here; letting pip choose pulls GBs of CUDA.
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test clean browser

$(STAMP): pyproject.toml Makefile $(wildcard plugins/*/pyproject.toml)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[test,server,wyoming,cosyvoice,hub]'
	for p in plugins/*/; do [ -f $$p/pyproject.toml ] && $(PIP) install -q -e $$p || exit 1; done
	touch $(STAMP)

# Only for tests: the extras their integrations need (parquet lists, aac, Ray) and the test-only plugins
# (a toy engine and a deliberately broken one), so make demo's venv stays light and lists just real engines.
$(TEST_STAMP): $(STAMP) $(wildcard tests/plugins/*/pyproject.toml)
	$(PIP) install -q -e '.[parquet,aac,ray]'
	for p in tests/plugins/*/; do [ -f $$p/pyproject.toml ] && $(PIP) install -q -e $$p || exit 1; done
	touch $(TEST_STAMP)

# make demo [MODEL=DIR] [REF=clip.wav [REF_TEXT="what the clip says"]] [DEVICE=cpu] [DEBUG=1]
# Each value reaches the demo as one shell word, quotes and commas included.
quoted = '$(subst ','\'',$($(1)))'
demo: $(STAMP)
	$(PY) -m mizuoto.demo --as-make $(if $(MODEL),$(call quoted,MODEL)) $(if $(REF),--ref-audio $(call quoted,REF)) \
		$(if $(REF_TEXT),--ref-text $(call quoted,REF_TEXT)) $(if $(DEVICE),--device $(call quoted,DEVICE)) \
		$(if $(DEBUG),--debug)

# The web page's tests drive Debian's Chromium and ChromeDriver: installed here when missing (as root;
# about 80 s on a fresh machine), a no-op when present.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  [ "$$(id -u)" = 0 ] || { echo "make test needs: apt-get install -y chromium chromium-driver (as root)" >&2; exit 1; }; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; }

test: $(TEST_STAMP) browser
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
