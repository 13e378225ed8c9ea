"""Fixtures shared by the test modules (helpers live in tests/*_helpers.py and tests/toy.py)."""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("GRPC_VERBOSITY", "NONE")  # as the CLI: no C-core INFO lines per handshake
# owner keys of nodes that start a closed swarm go here, not into the user's home (children too)
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="gasloc-test-data-")

from tests.daemon_helpers import write_corpus


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small real-text corpus directory, written once per session."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))
