"""The node child's environment (gasloc_p2p/tools/nodes.py): every log folder its own state
folder, so nodes started one after another never take each other's identities or
checkpoints (a benchmark's second swarm resumed from its first one's state: 2026-11-29)."""

from __future__ import annotations

from gasloc_p2p.node.state_dir import nodes_home
from gasloc_p2p.tools.nodes import child_env


def test_each_log_folder_is_its_own_state_folder_unless_the_caller_names_one(tmp_path, monkeypatch):
    first, second = child_env(tmp_path / "a", {}), child_env(tmp_path / "b", {"X": "1"})
    assert first["XDG_DATA_HOME"] == str((tmp_path / "a" / "state").resolve())
    assert second["XDG_DATA_HOME"] != first["XDG_DATA_HOME"] and second["X"] == "1"
    # the node finds its identities and checkpoints under it
    monkeypatch.setenv("XDG_DATA_HOME", first["XDG_DATA_HOME"])
    assert nodes_home().is_relative_to(tmp_path / "a")
    # the swarm command keeps its own run folder's
    named = child_env(tmp_path / "a", {"XDG_DATA_HOME": str(tmp_path / "run")})
    assert named["XDG_DATA_HOME"] == str(tmp_path / "run")
    assert named["PYTHONUNBUFFERED"] == "1"
