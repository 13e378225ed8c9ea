# gasloc_p2p developer commands. `make swarm` and `make test` are the README's quick start.
# Each step prints one summary line with its wall time; setup's pip output goes to .venv/setup.log.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
STEP := bash scripts/step.sh
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: setup test lint typecheck unit sim swarm bench bench-core bench-codecs bench-sim \
	bench-node bench-diloco bench-scale bench-swarm100m bench-trainer-memory bench-downloads \
	bench-data bench-streaming bench-streaming-link bench-fuzz bench-byzantine bench-direction \
	bench-chaos bench-poison bench-soak bench-external bench-external-1000 bench-peer-choice \
	bench-pacing bench-pacing-2nodes bench-projection reproduce proto clean

# torch is installed first and pinned: an open range would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	@$(STEP) "setup: venv" --log $(VENV)/setup.log -- $(PYTHON) -m venv $(VENV)
	@$(STEP) "setup: pip" --log $(VENV)/setup.log -- $(PIP) --upgrade pip
	@$(STEP) "setup: $(TORCH_PIN)" --log $(VENV)/setup-torch.log -- $(PIP) $(TORCH_PIN)
	@$(STEP) "setup: gasloc_p2p[dev]" --log $(VENV)/setup-project.log -- $(PIP) -e '.[dev]'
	@touch $@

setup: $(VENV)/.installed

lint: setup
	@$(STEP) "lint: ruff" -- $(PY) -m ruff check -q gasloc_p2p tests benchmarks
	@$(STEP) "lint: generated protobuf code is current" -- $(PY) proto/generate.py --check

typecheck: setup
	@$(STEP) "typecheck: mypy" -- $(PY) -m mypy gasloc_p2p

unit: setup
	@$(STEP) "unit: pytest" -- $(PY) -m pytest -q

test: lint typecheck unit

swarm: setup
	$(VENV)/bin/gasloc-node swarm --nodes 3

sim: setup
	$(VENV)/bin/gasloc-node sim --workers 4 --steps 200 --algorithms gasloc,diloco --out runs/sim

proto: setup
	$(PY) proto/generate.py

bench-core: setup
	$(PY) benchmarks/bench_core.py

bench-codecs: setup
	$(PY) benchmarks/bench_codecs.py

bench-sim: setup
	$(PY) benchmarks/bench_sim.py

bench-node: setup
	$(PY) benchmarks/bench_node.py

bench-diloco: setup
	$(PY) benchmarks/bench_diloco.py

bench-scale: setup
	$(PY) benchmarks/bench_scale.py

bench-swarm100m: setup
	nice -n 10 $(PY) benchmarks/bench_swarm100m.py

bench-trainer-memory: setup
	nice -n 10 $(PY) benchmarks/bench_trainer_memory.py

bench-downloads: setup
	$(PY) benchmarks/bench_downloads.py

bench-data: setup
	$(PY) benchmarks/bench_data.py --mb 100,300

bench-streaming: setup
	$(PY) benchmarks/bench_streaming.py

# Network namespaces with tbf-shaped links: needs root and iproute2.
bench-streaming-link: setup
	$(PY) benchmarks/bench_streaming_link.py

# Security figures (README, Security): each runs real node processes for minutes.
bench-fuzz: setup
	$(PY) benchmarks/bench_fuzz.py

bench-byzantine: setup
	$(PY) benchmarks/bench_byzantine.py

# The guard's direction test on two honest 99.5M-parameter Llamas (minutes; transformers)
bench-direction: setup
	$(PY) benchmarks/bench_direction.py

bench-chaos: setup
	$(PY) benchmarks/bench_chaos.py

bench-poison: setup
	$(PY) benchmarks/bench_poison.py

# 10 minutes; needs root, ip and tc (network namespaces, a tbf-shaped link)
bench-soak: setup
	$(PY) benchmarks/bench_soak.py

# External baselines (torchft DiLoCo, hivemind) on shaped links: installs the pinned
# bench-external extra (torchft) into the venv first; needs root (network namespaces, tc).
bench-external: setup
	@$(STEP) "bench-external: install the bench-external extra" --log $(VENV)/setup-external.log -- \
		$(PIP) -e '.[bench-external]'
	nice -n 10 $(PY) benchmarks/bench_external.py

# The suite's headline at 1000 steps, 3 repetitions, on the uneven links: GASLoC against DiLoCo
# mode and torchft's DiLoCo (Nesterov 0.7/0.9), then against DiLoCo mode with plain averaging
# (about 60 minutes; root, tc; installs the bench-external extra)
bench-external-1000: setup
	@$(STEP) "bench-external: install the bench-external extra" --log $(VENV)/setup-external.log -- \
		$(PIP) -e '.[bench-external]'
	nice -n 10 $(PY) benchmarks/bench_external.py --systems gasloc,gasloc-diloco,torchft-diloco \
		--cases uneven --steps 1000 --repeat 3 --no-exchange-check --timeout-s 1200 \
		--name external-1000
	nice -n 10 $(PY) benchmarks/bench_external.py --systems gasloc,gasloc-diloco-avg \
		--cases uneven --steps 1000 --repeat 3 --no-exchange-check --timeout-s 1200 \
		--name external-1000-avg

# --peer-choice bandwidth against uniform on uneven shaped links (about 10 minutes; root, tc)
bench-peer-choice: setup
	nice -n 10 $(PY) benchmarks/bench_external.py --systems gasloc,gasloc-bw --cases uneven \
		--steps 1000 --repeat 4 --no-exchange-check --name peer-choice

# --pacing compute against the defaults and no gossip, uneven shaped links (about 12 minutes)
bench-pacing: setup
	nice -n 10 $(PY) benchmarks/bench_external.py --systems gasloc,gasloc-paced,gasloc-solo \
		--cases uneven --steps 1000 --repeat 3 --no-exchange-check --name pacing

# The same with one core per node: 2 nodes (100 and 5 Mbit/s) on the 2 cores (about 5 minutes)
bench-pacing-2nodes: setup
	nice -n 10 $(PY) benchmarks/bench_external.py --systems gasloc,gasloc-paced,gasloc-solo \
		--cases uneven --nodes 2 --steps 1000 --repeat 3 --no-exchange-check --name pacing-2nodes

# Timing projection to n = 64 and 256 from the measured profile (docs/results/pacing.json);
# a second, no training
bench-projection: setup
	$(PY) benchmarks/bench_projection.py

bench: bench-core bench-codecs bench-sim bench-node bench-diloco bench-scale bench-swarm100m \
	bench-trainer-memory bench-downloads bench-data bench-streaming bench-streaming-link bench-fuzz \
	bench-byzantine bench-direction bench-chaos bench-poison bench-soak bench-external \
	bench-external-1000 bench-peer-choice bench-pacing bench-pacing-2nodes bench-projection

reproduce: setup
	$(PY) benchmarks/reproduce.py --only momentum-h10,slow,async,momentum-h50,consensus,gamma-sweep-h100,gamma-sweep-h10,graphs,graphs-16,staleness,capacity,mixing,acid-consensus,acid,gamma-graphs-8,gamma-graphs-16,noloco,references,references-int4

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
