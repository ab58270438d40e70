# Each target is self-sufficient on a fresh machine with Python 3.11 (and 3.10 for the oldest stack): it
# creates its venv, installs the versions of its tested stack (constraints/*.txt), then runs.
#   .venv         the newest stack (Python 3.11, TF 2.21, NumPy 2): demo, test, bench, lint
#   .venv-oldest  the oldest stack (Python 3.10, TF 2.16.2, NumPy 1.26, Keras 3.12.0): test-oldest, bench-peers
PYTHON ?= $(shell command -v python3.11 || command -v python3)
# Python 3.10: python3.10 if it runs (a pyenv shim may not), else pyenv's.
OLDEST_PYTHON ?= $(shell for p in python3.10 $$(pyenv root 2>/dev/null || echo $${PYENV_ROOT:-$$HOME/.pyenv})/versions/3.10*/bin/python3.10; do \
	$$p -c "" 2>/dev/null && { command -v $$p; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OLDEST_VENV := .venv-oldest
OLDEST_PY := $(OLDEST_VENV)/bin/python
OLDEST_STAMP := $(OLDEST_VENV)/.installed
PEERS_STAMP := $(OLDEST_VENV)/.peers
PYTEST := -m pytest -q --durations=15 --cpu-durations=15
# The library's tests (tables, exchange, Keras, strategies, checkpoints, serving, faults, the readers);
# the application, benchmark and notebook tiers run on the newest stack only.
NEWEST_ONLY := tests/app/test_app.py tests/app/test_app_dynamic.py tests/app/test_demo.py tests/benchmarks/test_bench.py \
	tests/test_notebooks.py

.PHONY: demo test test-fast test-oldest lint format bench bench-peers clean

$(STAMP): setup.py pyproject.toml constraints/newest.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints/newest.txt -e ".[app,bench,io,test]"
	touch $(STAMP)

$(OLDEST_STAMP): setup.py pyproject.toml constraints/oldest.txt
	@test -n "$(OLDEST_PYTHON)" || { echo "The oldest stack needs Python 3.10: put python3.10 on PATH" \
		"(or pyenv install 3.10), or name one: make test-oldest OLDEST_PYTHON=/path/to/python3.10"; exit 1; }
	$(OLDEST_PY) -c 'import sys; assert sys.version_info[:2] == (3, 10)' 2>/dev/null || \
		{ rm -rf $(OLDEST_VENV) && $(OLDEST_PYTHON) -m venv $(OLDEST_VENV); }
	$(OLDEST_PY) -m pip install --quiet --upgrade pip
	$(OLDEST_PY) -m pip install --quiet -c constraints/oldest.txt -e ".[app,bench,io,test]"
	touch $(OLDEST_STAMP)

# The main job on its embedded default: DLRM on synthetic Criteo-shaped data, a local cluster of
# 2 parameter servers + 2 workers started by the library; checkpoints go to a fresh temporary directory.
demo: $(STAMP)
	$(PY) -m tf_sharded train --checkpoint_dir "$$(mktemp -d)/ckpt"

# The benchmark suite (about 30 minutes; run it with nothing else on the CPU).
bench: $(STAMP)
	$(PY) -m tf_sharded bench --mode both

# B1 and B7 with TFRA beside ours: TFRA 0.8.1 needs TensorFlow <= 2.16.2, so they run on the oldest stack.
$(PEERS_STAMP): $(OLDEST_STAMP)
	$(OLDEST_PY) -m pip install --quiet -c constraints/oldest.txt -e ".[app,bench,io,test,peers]"
	touch $(PEERS_STAMP)

bench-peers: $(PEERS_STAMP)
	$(OLDEST_PY) -m tf_sharded bench ps dynamic --mode both --out bench_results/peers

lint: $(STAMP)
	$(VENV)/bin/ruff check tf_sharded strategy tests setup.py
	$(VENV)/bin/ruff format --check tf_sharded strategy tests setup.py

format: $(STAMP)
	$(VENV)/bin/ruff check --fix tf_sharded strategy tests setup.py
	$(VENV)/bin/ruff format tf_sharded strategy tests setup.py

test: $(STAMP) lint
	$(PY) $(PYTEST) tests

# Everything not marked slow (benchmarks, notebooks, the demo, process clusters, fault injection, tests that
# start a Python process or take over 4 s).
test-fast: $(STAMP)
	$(PY) $(PYTEST) -m "not slow" tests

test-oldest: $(OLDEST_STAMP)
	$(OLDEST_PY) $(PYTEST) tests $(addprefix --ignore=,$(NEWEST_ONLY))

clean:
	rm -rf $(VENV) $(OLDEST_VENV) build *.egg-info
