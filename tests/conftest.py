"""Fixtures shared by the test modules (helpers live in tests/*_helpers.py and tests/toy.py),
and the grouping of tests for parallel runs.

``make test`` runs pytest on two workers (pytest-xdist, ``--dist loadgroup``). The modules in
:data:`PROCESS_MODULES` start swarms of real processes (node processes, DHTs, hivemind
averagers, Prometheus, Chromium, shaped links in network namespaces) with wall-clock timeouts:
they form one group, so they run one after another on one worker, as in a serial run, while
the other worker takes the in-process tests. Two swarms never compete for the two cores.
"""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("GRPC_VERBOSITY", "NONE")  # as the CLI: no C-core INFO lines per handshake
# owner keys of nodes that start a closed swarm go here, not into the user's home (children too)
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="gasloc-test-data-")

from tests.daemon_helpers import write_corpus

PROCESS_MODULES = frozenset({
    "test_bench_external", "test_cli_node_process", "test_dashboard",
    "test_dashboard_direct", "test_fuzz_node", "test_gpu_queue", "test_hf_swarm", "test_netns",
    "test_node_averaging_identical", "test_node_diloco", "test_node_security",
    "test_node_shutdown", "test_node_streaming_swarm", "test_node_swarm", "test_prometheus",
    "test_ranks_swarm", "test_run_manifest", "test_state_dir",
    "test_swarm_command",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in PROCESS_MODULES:
            item.add_marker(pytest.mark.xdist_group("processes"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small real-text corpus directory, written once per session."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))
