"""Fixtures shared by the test modules (helpers live in tests/*_helpers.py and tests/toy.py),
and the grouping of tests for parallel runs.

``make test`` runs pytest on two workers (pytest-xdist, ``--dist loadgroup``) over the tests
that run in the test process; ``make test-processes`` runs the tests of real processes. The
modules in :data:`PROCESS_MODULES` start swarms of them (node processes, DHTs, hivemind
averagers, Prometheus, Chromium, shaped links in network namespaces) with wall-clock timeouts:
they form one group, so they run one after another on one worker, as in a serial run, while
the other worker takes the rest. Two swarms never compete for the two cores.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("GRPC_VERBOSITY", "NONE")  # as the CLI: no C-core INFO lines per handshake
# owner keys of nodes that start a closed swarm go here, not into the user's home (children too)
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="gasloc-test-data-")
# nodes of one run on one machine share the state folder: a test's node would resume the
# checkpoint an earlier test's node kept there by default; the default's own tests unset this
os.environ["GASLOC_AUTO_CHECKPOINT"] = "false"

from gasloc_p2p.node.discovery import dht
from tests.daemon_helpers import write_corpus

# hivemind DHTs of in-process nodes and helpers start from a clean fork server, never forked
# from this threaded test process (node/discovery/dht.py: dht_class); node processes the tests
# start fork theirs, as a user's node does
dht.DEFAULT_START = "forkserver"
atexit.register(shutil.rmtree, os.environ["XDG_DATA_HOME"], ignore_errors=True)

# A quiet machine of the CI kind runs the probe below in about this long (2 cores, 2026-11).
PROBE_QUIET_S = 0.15
MAX_SCALE = 4.0


def _probe_s() -> float:
    """Seconds of a fixed piece of work (Python and small tensor products), the best of 3."""
    import time

    import torch

    best = float("inf")
    a = torch.ones(96, 96)
    for _ in range(3):
        t0 = time.perf_counter()
        total = 0
        for i in range(60_000):
            total += i % 7
        for _ in range(200):
            a = (a @ a).clamp_(-1, 1)
        best = min(best, time.perf_counter() - t0)
    return best


def timeout_scale() -> tuple[float, str]:
    """How much slower than a quiet machine this one runs now: the larger of the 1-minute
    load per core and the probe's time against a quiet one's, between 1 and MAX_SCALE
    (rounded up to a half)."""
    import math

    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] / cores
    slow = _probe_s() / PROBE_QUIET_S
    scale = min(MAX_SCALE, max(1.0, math.ceil(2 * max(load, slow)) / 2))
    return scale, f"load {load:.1f} per core, probe {slow:.1f}x a quiet machine"


def pytest_configure(config: pytest.Config) -> None:
    """Set GASLOC_TEST_TIMEOUT_SCALE from the machine (unless given), before any worker or
    helper reads it: every wait of the process tests follows the machine's speed."""
    if "GASLOC_TEST_TIMEOUT_SCALE" in os.environ:
        config._gasloc_scale = f"{os.environ['GASLOC_TEST_TIMEOUT_SCALE']} (given)"
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a worker: the controller measured it and its environment has it
    scale, why = timeout_scale()
    os.environ["GASLOC_TEST_TIMEOUT_SCALE"] = f"{scale:g}"
    config._gasloc_scale = f"{scale:g} ({why})"


def pytest_report_header(config: pytest.Config) -> str:
    return f"GASLOC_TEST_TIMEOUT_SCALE={getattr(config, '_gasloc_scale', '?')}: every wait of " \
           "the process tests is multiplied by it"


PROCESS_MODULES = frozenset({
    "test_bench_external", "test_cli_node_process", "test_dashboard",
    "test_dashboard_direct", "test_fuzz_node", "test_gpu_queue", "test_hf_swarm", "test_nat", "test_netns",
    "test_node_averaging_identical", "test_node_diloco", "test_node_security",
    "test_node_shutdown", "test_node_streaming_swarm", "test_node_swarm", "test_prometheus",
    "test_ranks_swarm", "test_run_manifest", "test_state_dir",
    "test_swarm_command",
})


# Modules that start real processes of their own (torch.distributed ranks) but no swarm: they
# run beside the swarms, on the other worker.
RANK_MODULES = frozenset({"test_ranks"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests of real processes are marked ``processes``: ``make test`` leaves them out (its
    8 minutes on 2 cores), ``make test-processes`` runs them, ``.ci/run`` both."""
    for item in items:
        name = item.module.__name__.rsplit(".", 1)[-1] if item.module is not None else ""
        if name in PROCESS_MODULES:
            item.add_marker(pytest.mark.xdist_group("processes"))
        if name in PROCESS_MODULES or name in RANK_MODULES:
            item.add_marker(pytest.mark.processes)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small real-text corpus directory, written once per session."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))
