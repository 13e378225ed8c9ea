"""`gasloc-node swarm` as a real process: progress lines, a clean exit after --duration or
Ctrl+C (SIGINT), and nothing left behind in its session (nodes, DHT processes, p2pd)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gasloc_p2p.cli import build_parser
from gasloc_p2p.tools.cli_swarm import _config
from gasloc_p2p.tools.procs import session_members
from tests.daemon_helpers import write_corpus
from tests.node_helpers import scaled
from tests.swarm_helpers import tiny_node_args, wait_for

PROGRESS = r"node{i}\s+step\s+(\d+)\s+val loss\s+\S+\s+tok/s\s+\S+\s+exchanges ok\s+(\d+)"


def start_swarm(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, Path]:
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "swarm.out"
    with out.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gasloc_p2p.cli", "swarm", "--no-prometheus", "--refresh",
             "2", "--run-dir", str(tmp_path / "run"), *flags, "--", *tiny_node_args(corpus)],
            stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return proc, out


def finish(proc: subprocess.Popen, out: Path, timeout_s: float) -> str:
    """Wait for the exit (0 expected) and check that the session is empty."""
    try:
        code = proc.wait(timeout=scaled(timeout_s))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.read_text()
    assert code == 0, text[-3000:]
    wait_for(lambda: not session_members(proc.pid), 10, "the swarm's session to be empty")
    return text


def test_swarm_runs_for_its_duration_and_leaves_nothing(tmp_path):
    # 20 s: on a loaded box the two nodes need most of it to find each other and commit
    proc, out = start_swarm(tmp_path, "--nodes", "2", "--duration", "20")
    text = finish(proc, out, 120)
    # no Prometheus: the dashboard still runs, on the nodes' own /metrics
    assert re.search(r"swarm: dashboard: http://127\.0\.0\.1:\d+/  \(reads the nodes' /metrics",
                     text), text[-3000:]
    for i in (0, 1):
        steps = [int(m.group(1)) for m in re.finditer(PROGRESS.format(i=i), text)]
        assert len(steps) >= 3 and steps[-1] > steps[0], text[-3000:]
    last_ok = [int(m.group(2)) for m in re.finditer(PROGRESS.format(i=0), text)][-1]
    assert last_ok > 0, text[-3000:]
    assert "swarm: stopped cleanly" in text
    # what stays is said, and all of it is in the run folder (no key in the user's data)
    assert f"swarm: the nodes' logs, keys, checkpoints and invitations stay in {tmp_path / 'run'}" in text
    logs = sorted(p.name for p in (tmp_path / "run").iterdir())
    # a run: node0 owns it and runs its manifest, node1 joined with an invitation it signed
    assert logs == ["node0.err", "node0.out", "node1.err", "node1.invite", "node1.out",
                    "owner.key", "run.json", "state"]
    kept = sorted(p.name for p in (tmp_path / "run" / "state").rglob("*.key"))
    assert len(kept) == 3 and "identity.key" in kept, kept  # node0's two keys, node1's DHT's
    assert "  run      r" in (tmp_path / "run" / "node1.out").read_text()  # from the manifest


def test_ctrl_c_stops_the_swarm_cleanly(tmp_path):
    proc, out = start_swarm(tmp_path, "--nodes", "1")
    try:
        wait_for(lambda: re.search(PROGRESS.format(i=0), out.read_text()), 90,
                 "a progress line")
    except AssertionError:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl+C sends to the foreground process
    text = finish(proc, out, 60)
    assert "SIGINT: stopping" in text and "swarm: stopped cleanly" in text
    assert time.monotonic() - t0 < scaled(40)


@pytest.mark.parametrize("argv, problem", [
    (["swarm", "--nodes", "0"], "--nodes"),
    (["swarm", "--", "--peers", "/ip4/1.2.3.4/tcp/1/p2p/x"], "--peers"),
    (["swarm", "--dashboard-port", "-5"], "--dashboard-port"),
])
def test_bad_swarm_flags_are_rejected(argv, problem):
    args = build_parser().parse_args(argv)
    with pytest.raises(ValueError, match=problem):
        _config(args)
