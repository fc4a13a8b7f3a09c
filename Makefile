# Fresh machine: `make demo` or `make test`; both create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of torch lies on local disk here; letting pip choose pulls GBs of CUDA.
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test test-second-tree clean browser

# make demo: the runtime, CosyVoice's pinned data (the cosyvoice extra: wetext's FSTs; Whisper's vocabulary
# through `mizuoto fetch`, from the shared assets when they are beside the checkout) and the demo's engine,
# the Piper plugin with its voice. No test tools: those come with make test.
WHISPER_VOCAB = $(wildcard $(ASSETS)/whisper/multilingual.tiktoken)
$(STAMP): pyproject.toml Makefile plugins/mizuoto-piper/pyproject.toml
	@echo "== make: [1/4] virtual environment $(VENV)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "== make: [2/4] $(TORCH) (the CPU wheel; about 800 MB installed)"
	$(PIP) install --progress-bar off $(TORCH)
	@echo "== make: [3/4] mizuoto-runtime from this checkout, with the cosyvoice extra, and the Piper plugin"
	$(PIP) install --progress-bar off -e '.[cosyvoice]' -e plugins/mizuoto-piper
	@echo "== make: [4/4] CosyVoice 1's vocabulary (mizuoto fetch whisper-vocab, sha256 checked)"
	$(PY) -m mizuoto.cli fetch whisper-vocab $(if $(WHISPER_VOCAB),--from $(WHISPER_VOCAB)) || \
	  echo "== make: not fetched; CosyVoice 1 models need it later: $(PY) -m mizuoto.cli fetch whisper-vocab"
	touch $(STAMP)
	@echo "== make: installed; $(VENV) holds $$(du -sh $(VENV) | cut -f1)"

# Only for tests: the test tools, every integration's extra (server, Wyoming, Ray, parquet lists, aac, hub
# ids, plots), every plugin and the test-only plugins (a toy engine and a deliberately broken one), so make
# demo's venv stays light and lists just real engines.
$(TEST_STAMP): $(STAMP) $(wildcard plugins/*/pyproject.toml) $(wildcard tests/plugins/*/pyproject.toml)
	@echo "== make: [test 1/2] test tools and every extra (test, server, wyoming, hub, parquet, aac, ray, plot)"
	$(PIP) install --progress-bar off -e '.[test,server,wyoming,cosyvoice,hub,parquet,aac,ray,plot]'
	@echo "== make: [test 2/2] every plugin and the test-only plugins"
	for p in plugins/*/ tests/plugins/*/; do [ ! -f $$p/pyproject.toml ] || $(PIP) install --progress-bar off -e $$p || exit 1; done
	touch $(TEST_STAMP)

# make demo [MODEL=DIR] [REF=clip.wav [REF_TEXT="what the clip says"]] [DEVICE=cpu] [DEBUG=1]
# Each value reaches the demo as one shell word, quotes and commas included.
quoted = '$(subst ','\'',$($(1)))'
demo: $(STAMP)
	@echo "== make: speaking the demo sentence (python -m mizuoto.demo)"
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
	@echo "== make: running the test suite (pytest)"
	$(PY) -m pytest -q

# The parity tests again on a second fixture tree of the same layout, derived from the first
# (mizuoto/testing/derived_tree.py: other case names and order, no aliases, legacy HiFT keys, the
# shortest clip left out), with the seeds and texts the tests pick themselves shifted: a test that
# leans on one tree fails here (tests/text is left out: the text fixtures are the same). CI runs it after `make test`.
FIXTURES ?= $(or $(MIZUOTO_FIXTURES),../shared/fixtures)
ASSETS ?= $(or $(MIZUOTO_ASSETS),$(FIXTURES)/../assets)
SECOND_TREE := $(VENV)/second-fixture-tree
PARITY_TESTS := tests/engines/cosyvoice tests/nn tests/testing
# Left out there (CI's time): the slowest tests whose inputs are the same on both trees, so their
# second run would compute what the first did: two whose inputs and seeds are the recorded cases' own,
# and the per-call memory check (its inputs are the models' sizes and the lengths it asks for, which
# the derived tree keeps; minutes of fresh processes).
SAME_ON_BOTH := not in_any_company and not test_compile_keeps_the_mel_within_tolerance \
	and not test_every_stage_call_is_planned_within_its_measured_peak
test-second-tree: $(TEST_STAMP)
	$(PY) -m mizuoto.testing.derived_tree $(FIXTURES) $(SECOND_TREE)
	MIZUOTO_FIXTURES=$(abspath $(SECOND_TREE)) MIZUOTO_ASSETS=$(abspath $(ASSETS)) MIZUOTO_TEST_SHIFT=1 \
		$(PY) -m pytest -q $(PARITY_TESTS) --ignore=tests/engines/cosyvoice/train -k "$(SAME_ON_BOTH)"

clean:
	rm -rf $(VENV) .pytest_cache
