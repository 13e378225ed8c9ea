"""A node keeps its identity across restarts by default, and two nodes of one run on one
machine never share one."""

from __future__ import annotations

import argparse
import subprocess
import sys

from gasloc_p2p.node import state_dir
from gasloc_p2p.node.settings import build_config
from gasloc_p2p.protocol.auth import load_or_create_identity


def cfg(**flags: object):
    return build_config(argparse.Namespace(open_swarm=True, **flags), environ={})


def test_the_default_identity_is_kept_per_run_and_never_shared(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr(state_dir, "_held", [])
    first = state_dir.default_identity(cfg())
    assert first == str(tmp_path / "gasloc_p2p" / "nodes" / "gasloc" / "identity.key")
    second = state_dir.default_identity(cfg())  # a second node of the run while the first runs
    assert second.endswith("identity-1.key")
    other_run = state_dir.default_identity(cfg(run_id="other"))
    assert "/nodes/other/identity.key" in other_run
    assert state_dir.default_identity(cfg(checkpoint_dir=str(tmp_path / "ck"))) == str(
        tmp_path / "ck" / "identity.key")
    assert state_dir.default_identity(cfg(identity_file=str(tmp_path / "mine.key"))) == str(
        tmp_path / "mine.key")
    for lock in state_dir._held:  # the first node stops: its file is free again...
        lock.close()
    state_dir._held.clear()
    assert state_dir.default_identity(cfg()) == first  # ...and a restart takes it back
    code = ("import sys, argparse; from gasloc_p2p.node import state_dir; from "
            "gasloc_p2p.node.settings import build_config; print(state_dir.default_identity("
            "build_config(argparse.Namespace(open_swarm=True), environ={})))")
    held = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"XDG_DATA_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
                          timeout=60)
    assert held.stdout.strip().endswith("identity-1.key"), held.stderr  # another process
    key = load_or_create_identity(first)
    assert load_or_create_identity(first).peer_id == key.peer_id  # the same peer id again
