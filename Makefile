# Fresh machine: `make demo` or `make test`; both create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of torch lies on local disk here; letting pip choose pulls GBs of CUDA.
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test clean

$(STAMP): pyproject.toml Makefile $(wildcard plugins/*/pyproject.toml)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[test,server,cosyvoice]'
	for p in plugins/*/; do [ -f $$p/pyproject.toml ] && $(PIP) install -q -e $$p || exit 1; done
	touch $(STAMP)

# The test-only plugins (a toy engine and a deliberately broken one) go into the venv only for tests.
$(TEST_STAMP): $(STAMP) $(wildcard tests/plugins/*/pyproject.toml)
	for p in tests/plugins/*/; do [ -f $$p/pyproject.toml ] && $(PIP) install -q -e $$p || exit 1; done
	touch $(TEST_STAMP)

demo: $(STAMP)
	$(PY) -m mizuoto.demo $(MODEL)

test: $(TEST_STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
