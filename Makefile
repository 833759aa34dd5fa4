# `make serve` installs the server into .venv and serves the built-in model;
# `make test` installs the test extras too and runs the default suite;
# `make test-all` also runs the tests marked slow;
# `make docs` writes docs/cli.md from the code (a test fails when it is stale);
# `make bench` runs the serving benchmark against llama.cpp and transformers (bench/serving.py)
# and writes bench/RESULTS.md (the first run builds llama-server: about 15 min on 2 cores);
# `make soak` runs a few hundred mixed requests, bad ones and hang-ups among them, against run_server.py on
# loopback and checks the answers, the KV pages, the memory and the event loop lag afterwards (bench/soak.py).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: serve test test-all bench soak docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@ $(VENV)/.installed

serve: $(VENV)/.installed
	$(PY) run_server.py $(ARGS)

test: $(VENV)/.installed-test
	$(PY) -m pytest -q

test-all: $(VENV)/.installed-test
	$(PY) -m pytest -q -m ''

$(VENV)/.installed-bench: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[bench]'
	touch $@ $(VENV)/.installed

bench: $(VENV)/.installed-bench
	cd bench && ../$(PY) serving.py --runs 2 --write $(ARGS)

soak: $(VENV)/.installed-bench
	$(PY) bench/soak.py $(ARGS)

docs: $(VENV)/.installed
	$(PY) -c 'import run_server; run_server.CLI_REFERENCE.write_text(run_server.cli_reference())'

clean:
	rm -rf $(VENV) .pytest_cache
