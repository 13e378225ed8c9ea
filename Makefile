# gasloc_p2p developer commands. `make swarm` and `make test` are the README's quick start.
# Each step prints one summary line with its wall time; setup's pip output goes to .venv/setup.log.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
STEP := bash scripts/step.sh
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: setup test test-processes test-long lint typecheck unit sim swarm bench bench-core bench-codecs bench-sim \
	bench-node bench-diloco bench-scale bench-swarm100m bench-trainer-memory bench-downloads \
	bench-data bench-streaming bench-streaming-link bench-nat bench-fuzz bench-byzantine bench-direction \
	bench-chaos bench-poison bench-tamper bench-redteam bench-soak bench-external bench-external-1000 bench-projection bench-home-links bench-home-gossip bench-engine bench-optim bench-ranks reproduce \
	gpu-check gpu-plan gpu-next gpu-wheels proto corpus ladder-cpu clean

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

MYPY := $(PY) -m mypy gasloc_p2p
# Two workers; tests that start swarms of processes run one after another on one of them
# (tests/conftest.py). PYTEST_WORKERS=0: one process, as plain `pytest`.
PYTEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --durations=25
# tests marked `long` (variants of what the suite covers, each 40-100 s here) run apart, and
# the tests of real processes (swarms, ranks; tests/conftest.py) in `make test-processes`
PYTEST_TIER ?= -m "not long and not processes"

typecheck: setup
	@$(STEP) "typecheck: mypy" -- $(MYPY)

unit: setup
	@$(STEP) "unit: pytest" -- $(PYTEST) $(PYTEST_TIER)

# mypy (one core, about a minute from a fresh clone) runs beside pytest; its summary line is
# printed after pytest's (its messages too, if it fails).
test: lint
	@$(STEP) "typecheck: mypy" --log $(VENV)/typecheck.log -- $(MYPY) >$(VENV)/typecheck.out 2>&1 & \
	$(STEP) "unit: pytest" -- $(PYTEST) $(PYTEST_TIER); unit=$$?; \
	wait $$!; typecheck=$$?; cat $(VENV)/typecheck.out; \
	[ $$unit -eq 0 ] && [ $$typecheck -eq 0 ]

# the tests of real processes: node swarms, DHTs, Prometheus, Chromium, NAT routers in network
# namespaces, torch.distributed ranks (about 10 minutes on 2 cores; .ci/run runs it after
# `make test`)
test-processes: setup
	@$(STEP) "processes: pytest" -- $(PYTEST) -m "processes and not long"

# the tests `make test` leaves out (marked long: compiled ranks, a DDP and a Llama rank swarm,
# the dashboard without Prometheus, bench-external's runner); about 5 minutes
test-long: setup
	@$(STEP) "unit: pytest (long)" -- $(PYTEST) -m long

swarm: setup
	$(VENV)/bin/gasloc-node swarm --nodes 3

sim: setup
	$(VENV)/bin/gasloc-node sim --workers 4 --steps 200 --algorithms gasloc,diloco --out runs/sim

proto: setup
	$(PY) proto/generate.py

# 200 MB of text from the installed packages, a 16k BPE, memory-mapped tokens (offline, about
# 2 minutes), and 50 MB of the same as bytes for the CPU rungs of the size ladder
corpus: setup
	$(VENV)/bin/gasloc-node corpus --out runs/corpus --size-mb 200 --vocab 16384
	$(VENV)/bin/gasloc-node corpus --out runs/corpus-bytes --size-mb 50 --tokenizer byte

# the size ladder (benchmarks/repro_ladder.py; make corpus first): CPU rungs here; the GPU
# rungs are slices of the GPU queue (make gpu-plan)
ladder-cpu: setup
	$(PY) -m benchmarks.reproduce --only ladder-0.1m,ladder-0.4m,ladder-0.4m-sweep

# The GPU queue (benchmarks/gpu_queue.py): research in slices of a few minutes. gpu-plan prints
# it; gpu-next runs what is pending within BUDGET minutes on a GPU (on a CPU: every slice at
# smoke size, into a scratch folder); gpu-wheels fetches what a bare GPU machine lacks.
BUDGET ?= 9.5
gpu-plan: setup
	$(PY) -m benchmarks.gpu_queue plan

gpu-next:
	bash scripts/gpu_next.sh --budget-min $(BUDGET)

gpu-wheels: setup
	bash scripts/gpu_wheels.sh

bench-ranks: setup
	$(PY) -m benchmarks.bench_ranks

bench-core: setup
	$(PY) -m benchmarks.bench_core

bench-codecs: setup
	$(PY) -m benchmarks.bench_codecs

bench-sim: setup
	$(PY) -m benchmarks.bench_sim

bench-node: setup
	$(PY) -m benchmarks.bench_node

bench-diloco: setup
	$(PY) -m benchmarks.bench_diloco

bench-scale: setup
	$(PY) -m benchmarks.bench_scale

bench-swarm100m: setup
	nice -n 10 $(PY) -m benchmarks.bench_swarm100m

# On a machine with CUDA (no setup step: the machine's own torch may be the CUDA one; PYTHON=...)
gpu-check:
	bash scripts/gpu_check.sh

# one exchange's operations and syncs (1M-100M, CPU), and its timing on a GPU if present
bench-engine: setup
	$(PY) -m benchmarks.bench_engine

bench-optim: setup
	$(PY) -m benchmarks.bench_optim

bench-trainer-memory: setup
	nice -n 10 $(PY) -m benchmarks.bench_trainer_memory

bench-downloads: setup
	$(PY) -m benchmarks.bench_downloads

bench-data: setup
	$(PY) -m benchmarks.bench_data --mb 100,300

bench-streaming: setup
	$(PY) -m benchmarks.bench_streaming

# Network namespaces with tbf-shaped links: needs root and iproute2.
bench-streaming-link: setup
	$(PY) -m benchmarks.bench_streaming_link

# nodes behind home routers (namespaces with NAT; root and iptables): partners, paths, times
bench-nat: setup
	$(PY) -m benchmarks.bench_nat

# Security figures (README, Security): each runs real node processes for minutes.
bench-fuzz: setup
	$(PY) -m benchmarks.bench_fuzz

bench-byzantine: setup
	$(PY) -m benchmarks.bench_byzantine

# member attacks that know the defence (issue 39), each 10 minutes beside a clean swarm;
# ATTACKS=farm-push,member-push,... for some of them
ATTACKS ?= fresh-keys,farm-push,member-push,slow-push,orthogonal,ascent,ascent-slow,rewind
bench-redteam: setup
	$(PY) -m benchmarks.bench_redteam --attacks $(ATTACKS)

# an on-path relay: what it reads, changes and replays (about a minute)
bench-tamper: setup
	$(PY) -m benchmarks.bench_tamper

# The guard's direction test on two honest 99.5M-parameter Llamas (minutes; transformers)
bench-direction: setup
	$(PY) -m benchmarks.bench_direction

bench-chaos: setup
	$(PY) -m benchmarks.bench_chaos

# ATTACK=records (dead records), tarpits (150 records at ports that never answer) or preauth
# (15 idle streams per node from 5 addresses); about 5 minutes each
ATTACK ?= records
bench-poison: setup
	$(PY) -m benchmarks.bench_poison --attack $(ATTACK)

# 10 minutes; needs root, ip and tc (network namespaces, a tbf-shaped link)
bench-soak: setup
	$(PY) -m benchmarks.bench_soak

# External baselines (torchft DiLoCo, hivemind) on shaped links: installs the pinned
# bench-external extra (torchft) into the venv first; needs root (network namespaces, tc).
bench-external: setup
	@$(STEP) "bench-external: install the bench-external extra" --log $(VENV)/setup-external.log -- \
		$(PIP) -e '.[bench-external]'
	nice -n 10 $(PY) -m benchmarks.bench_external

# The suite's headline at 1000 steps, 3 repetitions, on the uneven links: GASLoC against DiLoCo
# mode and torchft's DiLoCo (Nesterov 0.7/0.9), then against DiLoCo mode with plain averaging
# (about 60 minutes; root, tc; installs the bench-external extra)
bench-external-1000: setup
	@$(STEP) "bench-external: install the bench-external extra" --log $(VENV)/setup-external.log -- \
		$(PIP) -e '.[bench-external]'
	nice -n 10 $(PY) -m benchmarks.bench_external --systems gasloc,gasloc-diloco,torchft-diloco \
		--cases uneven --steps 1000 --repeat 3 --no-exchange-check --timeout-s 1200 \
		--name external-1000
	nice -n 10 $(PY) -m benchmarks.bench_external --systems gasloc,gasloc-diloco-avg \
		--cases uneven --steps 1000 --repeat 3 --no-exchange-check --timeout-s 1200 \
		--name external-1000-avg

# Bytes and link time per node on home uplinks: gossip against DiLoCo at n = 8, 16, 64
# (arithmetic on the payloads' wire sizes; a second, no training)
bench-home-links: setup
	$(PY) -m benchmarks.bench_home_links

# Gossip codecs on home-scaled links (root, network namespaces): int8 against half2, time to
# int8's loss and bytes per node, uniform links and one 10x slower; about 60 minutes
HOME_GOSSIP := $(PY) -m benchmarks.bench_home_gossip --codecs int8 half2 --reps 3 --nodes 3 \
	--rate-mbit 0.5 --minutes 4
bench-home-gossip: setup
	$(HOME_GOSSIP)
	$(HOME_GOSSIP) --slow-factor 10

# Timing projection to n = 64 and 256 from the measured profile (docs/results/pacing.json);
# a second, no training
bench-projection: setup
	$(PY) -m benchmarks.bench_projection

bench: bench-core bench-codecs bench-sim bench-node bench-diloco bench-scale bench-swarm100m \
	bench-trainer-memory bench-downloads bench-data bench-streaming bench-streaming-link bench-fuzz \
	bench-byzantine bench-direction bench-chaos bench-poison bench-tamper bench-redteam bench-soak bench-external \
	bench-external-1000 bench-projection bench-home-links bench-home-gossip bench-engine bench-optim bench-ranks bench-nat

reproduce: setup
	$(PY) -m benchmarks.reproduce --only momentum-h10,slow,async,momentum-h50,consensus,gamma-sweep-h100,gamma-sweep-h10,graphs,graphs-16,mixing,acid-consensus,acid,gamma-graphs-8,gamma-graphs-16,codecs-8,codecs-16
	$(PY) -m benchmarks.reproduce --only home-8 --seeds 0,1,2,3,4
	$(PY) -m benchmarks.reproduce --only home-8-deciding --seeds 0,1,2,3,4,5,6,7,8,9
	$(PY) -m benchmarks.reproduce --only home-links-8,home-links-8-uneven --seeds 0,1,2,3,4
	$(PY) -m benchmarks.reproduce --only home-links-8-deciding,home-links-8-bound --seeds 0,1,2,3,4,5,6,7,8,9
	$(PY) -m benchmarks.reproduce --only home-links-16 --seeds 0,1,2,3,4,5

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
