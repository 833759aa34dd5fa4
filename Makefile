# `make serve` installs the server into .venv and serves the built-in model;
# `make test` installs the test extras too and runs the default suite;
# `make test-all` also runs the tests marked slow;
# `make docs` writes docs/cli.md from the code (a test fails when it is stale);
# `make bench` runs the serving benchmark against llama.cpp's server, vLLM's CPU build and transformers
# (bench/serving.py) and writes bench/RESULTS.md (the first run builds llama-server, about 15 min on 2 cores,
# and installs vLLM and Debian's tcmalloc for it: bench/peers.py);
# `make soak` runs a few hundred mixed requests, bad ones and hang-ups among them, against run_server.py on
# loopback and checks the answers, the KV pages, the memory and the event loop lag afterwards (bench/soak.py).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=
# The tests run in three groups, not one process: XLA:CPU maps three memory regions for each compiled
# kernel (thousands for an engine), and the whole suite's engines and jitted helpers in one process
# pass Linux's vm.max_map_count (65530), where loading the next executable segfaults. Each group runs
# on TEST_WORKERS processes (pytest-xdist), a test file to one worker (its shared server and engines
# with it): with the executable cache warm, two workers halve the time (cold, XLA's compiles fill both
# cores either way); more workers than cores starve the servers the tests start.
TEST_GROUPS := 'tests/test_[a-l]*.py' 'tests/test_[m-r]*.py' 'tests/test_[s-z]*.py'
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

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
	status=0; for group in $(TEST_GROUPS); do $(PYTEST) $$group || status=1; done; exit $$status

test-all: $(VENV)/.installed-test
	status=0; for group in $(TEST_GROUPS); do $(PYTEST) -m '' $$group || status=1; done; exit $$status

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
