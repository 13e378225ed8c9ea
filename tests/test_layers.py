"""Import-layer check: the rooms of the package and what each may import.

- ``core/``: torch and the standard library only (no I/O modules);
- ``protocol/``: the exchange protocol without I/O: no gRPC, asyncio, hivemind or node code;
- ``model``, ``data``, ``sim/``: never the network layers;
- ``train/`` (the one training loop): torch, the standard library (no I/O modules), the model,
  the data and the core only: never the simulator, the daemon or the tooling;
- ``node/`` (the daemon): never the developer tooling in ``tools/``; inside it, rooms (below):
  the shared types (config, settings, stats) import no other room; runtime, transport,
  discovery, averaging and observability import only the shared types and themselves (and the
  transport the runtime's lock); the modes compose those; only the daemon composes the modes,
  and nothing but the command-line entry imports the daemon;
- no installed module imports the benchmarks' tooling (fuzzers, network namespaces).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "gasloc_p2p"
IO_MODULES = {"asyncio", "socket", "ssl", "selectors", "http", "urllib", "subprocess", "threading"}
NETWORK_PACKAGES = {"grpc", "hivemind", "prometheus_client", "uvloop", "gasloc_p2p.node"}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_core_imports_only_torch_and_stdlib():
    bad = []
    for path in sorted((PKG / "core").glob("*.py")):
        for name in imported_modules(path):
            top = name.split(".")[0]
            ok = (top == "torch" or name.startswith("gasloc_p2p.core")
                  or (top in sys.stdlib_module_names and top not in IO_MODULES))
            if top == "__future__":
                ok = True
            if not ok:
                bad.append(f"{path.name}: {name}")
    assert not bad, f"core imports outside torch + stdlib: {bad}"


def test_simulator_and_model_do_not_import_network_layers():
    paths = [PKG / "model.py", *sorted((PKG / "data").glob("*.py")),
             PKG / "model_spec.py", PKG / "hf.py", *sorted((PKG / "sim").glob("*.py"))]
    bad = [f"{p.name}: {name}" for p in paths if p.exists() for name in imported_modules(p)
           if any(name == n or name.startswith(n + ".") for n in NETWORK_PACKAGES)]
    assert not bad, bad


def test_train_imports_only_torch_model_data_and_core():
    paths = sorted((PKG / "train").rglob("*.py"))
    assert len(paths) >= 4
    allowed = ("gasloc_p2p.train", "gasloc_p2p.model", "gasloc_p2p.data", "gasloc_p2p.core")
    bad = []
    for path in paths:
        for name in imported_modules(path):
            top = name.split(".")[0]
            ok = (top in ("torch", "__future__")
                  or any(name == a or name.startswith(a + ".") for a in allowed)
                  or (top in sys.stdlib_module_names and top not in IO_MODULES))
            if not ok:
                bad.append(f"{path.relative_to(PKG)}: {name}")
    assert not bad, f"train/ imports outside torch, stdlib, model, data, core: {bad}"


def test_importing_train_loads_no_driver_or_network_module():
    code = ("import sys, gasloc_p2p.train; print(','.join(m for m in sys.modules if m in "
            "('grpc', 'hivemind', 'prometheus_client', 'uvloop') or m.startswith("
            "('gasloc_p2p.node', 'gasloc_p2p.sim', 'gasloc_p2p.tools'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def _bad_imports(paths, forbidden):
    return [f"{p.relative_to(PKG)}: {name}" for p in paths for name in imported_modules(p)
            if any(name == n or name.startswith(n + ".") for n in forbidden)]


def test_protocol_imports_no_io_and_no_node():
    paths = sorted((PKG / "protocol").rglob("*.py"))
    assert paths
    bad = _bad_imports(paths, NETWORK_PACKAGES | {"asyncio", "socket", "gasloc_p2p.sim",
                                                  "gasloc_p2p.tools"})
    assert not bad, bad


def test_daemon_never_imports_the_tooling():
    paths = sorted((PKG / "node").rglob("*.py"))
    assert len(paths) > 10
    bad = _bad_imports(paths, {"gasloc_p2p.tools", "gasloc_p2p.sim"})
    assert not bad, bad


NODE = PKG / "node"
SHARED = ("config", "config_network", "config_train", "settings", "stats")
# room -> the node rooms it may import (besides the shared types and itself)
ROOMS: dict[str, tuple[str, ...]] = {
    "runtime": (), "discovery": (), "averaging": (), "observability": (),
    "transport": ("runtime",),  # the training lock's protocol
    "modes": ("runtime", "transport", "discovery", "averaging"),
}


def _node_room(name: str) -> str | None:
    """The room of a ``gasloc_p2p.node...`` module name (None: not in node/)."""
    if not name.startswith("gasloc_p2p.node."):
        return None
    part = name.split(".")[2]
    return "shared" if part in SHARED else part


def node_room_violations() -> list[str]:
    bad = []
    for path in sorted(NODE.rglob("*.py")):
        rel = path.relative_to(NODE)
        room = "shared" if rel.stem in SHARED and len(rel.parts) == 1 else (
            rel.parts[0] if len(rel.parts) > 1 else rel.stem)
        for name in imported_modules(path):
            other = _node_room(name)
            if other is None or other in ("shared", room):
                continue
            if room == "shared":
                bad.append(f"{rel}: {name} (the shared types import no room)")
            elif room in ROOMS and other not in ROOMS[room]:
                bad.append(f"{rel}: {name} ({room} may import {ROOMS[room] or 'no room'})")
            elif other == "daemon" and room != "cli_node":
                bad.append(f"{rel}: {name} (only the command line composes the daemon)")
    return bad


def test_node_rooms_import_downward_only():
    assert {p.name for p in NODE.iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        *ROOMS}, "a new room in node/: give it a rule"
    bad = node_room_violations()
    assert not bad, bad


def test_nothing_but_the_entry_point_imports_the_daemon():
    paths = [p for p in sorted(PKG.rglob("*.py")) if p.name not in ("cli_node.py", "daemon.py")]
    bad = [f"{p.relative_to(PKG)}: {n}" for p in paths for n in imported_modules(p)
           if n == "gasloc_p2p.node.daemon"]
    assert not bad, bad


def test_the_installed_package_never_imports_the_benchmarks():
    bad = _bad_imports(sorted(PKG.rglob("*.py")), {"benchmarks", "tests"})
    assert not bad, bad


def test_room_check_catches_an_upward_import(tmp_path, monkeypatch):
    """The rules bite: a runtime module importing a mode is reported."""
    room = tmp_path / "node"
    (room / "runtime").mkdir(parents=True)
    (room / "runtime" / "x.py").write_text("from gasloc_p2p.node.modes.gossip import PeerBook\n")
    (room / "stats.py").write_text("import gasloc_p2p.node.runtime.trainer\n")
    monkeypatch.setattr(sys.modules[__name__], "NODE", room)
    bad = node_room_violations()
    assert len(bad) == 2 and "runtime/x.py" in bad[0] and "stats.py" in bad[1], bad


def test_importing_core_loads_no_network_module():
    code = ("import sys, gasloc_p2p.core.async_state, gasloc_p2p.core.streaming, "
            "gasloc_p2p.core.topology, gasloc_p2p.core.codecs; "
            "print(','.join(m for m in ('grpc', 'hivemind', 'prometheus_client', 'uvloop') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_simulator_and_protocol_load_no_network_module():
    """The simulator runs the exchange protocol in memory: that must not pull gRPC in."""
    code = ("import sys, gasloc_p2p.sim.run, gasloc_p2p.sim.gossip, gasloc_p2p.protocol.memory; "
            "print(','.join(m for m in ('grpc', 'hivemind', 'prometheus_client', 'uvloop') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_layer_check_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import grpc\nfrom asyncio import sleep\nimport torch\n")
    assert imported_modules(bad) == {"grpc", "asyncio", "torch"}


def test_tests_and_benchmarks_share_helpers_not_test_modules():
    """Shared test code lives in tests/*_helpers.py, tests/toy.py and conftest.py: a test module
    importing another test module would run (or break) with it."""
    root = PKG.parent
    paths = [*sorted((root / "tests").glob("*.py")), *sorted((root / "benchmarks").glob("*.py"))]
    bad = [f"{p.relative_to(root)}: {name}" for p in paths for name in imported_modules(p)
           if name.startswith("tests.test_")]
    assert not bad, bad
