# gasloc_p2p developer commands. `make swarm` and `make test` are the README's quick start.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0

.PHONY: setup test lint typecheck unit sim swarm bench bench-core bench-sim bench-node bench-diloco reproduce proto clean

# torch is installed first and pinned: an open range would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH_PIN)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

lint: setup
	$(PY) -m ruff check gasloc_p2p tests benchmarks
	$(PY) proto/generate.py --check

typecheck: setup
	$(PY) -m mypy gasloc_p2p

unit: setup
	$(PY) -m pytest -q

test: lint typecheck unit

swarm: setup
	$(VENV)/bin/gasloc-node swarm --nodes 3

sim: setup
	$(VENV)/bin/gasloc-node sim --workers 4 --steps 200 --algorithms gasloc,diloco --out runs/sim

bench-core: setup
	$(PY) benchmarks/bench_core.py

proto: setup
	$(PY) proto/generate.py

bench-node: setup
	$(PY) benchmarks/bench_node.py

bench-swarm: setup
	$(VENV)/bin/gasloc-node swarm --nodes 3

sim: setup
	$(PY) benchmarks/bench_sim.py

reproduce: setup
	$(PY) benchmarks/reproduce.py

bench: bench-core bench-sim bench-node

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
