"""A node as a new user runs it, in a real process: the start-up block names every port the
user needs, `status` takes either the gRPC endpoint or the DHT multiaddr, a Ctrl+C (SIGINT to
the whole foreground process group, as a terminal sends it) prints only the node's own lines,
and a valid but dead bootstrap peer fails in one line that says what to check.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.daemon_helpers import write_corpus
from tests.node_helpers import scaled
from tests.swarm_helpers import wait_for

CLI = [sys.executable, "-m", "gasloc_p2p.cli"]
TINY = ["--host", "127.0.0.1", "--n-layer", "1", "--n-embd", "32", "--seq-len", "32",
        "--batch-size", "4", "--torch-threads", "1", "--eval-interval-steps", "20"]
# hivemind's own default log level, as in a user's terminal (the test suite quiets it elsewhere);
# tuning travels in the environment (no join flag)
ENV = {k: v for k, v in os.environ.items() if k != "HIVEMIND_LOGLEVEL"} | {
    "PYTHONUNBUFFERED": "1", "GASLOC_EVAL_BATCHES": "1"}
OWN_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO gasloc_p2p\.")


def status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "status", *args, "--json", "--timeout-s", str(scaled(30))],
                          capture_output=True, text=True, timeout=scaled(60), env=ENV)


def test_startup_block_status_by_multiaddr_and_a_quiet_ctrl_c(tmp_path: Path):
    corpus = write_corpus(tmp_path / "corpus")
    out, err = tmp_path / "node.out", tmp_path / "node.err"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen([*CLI, "join", *TINY, "--data", str(corpus)], stdout=o,
                                stderr=e, env=ENV, process_group=0)
    try:
        block = wait_for(lambda: "new swarm" in out.read_text() and out.read_text(), 90,
                         "the start-up block")
        grpc = re.search(r"^  grpc     (127\.0\.0\.1:\d+)$", block, re.M)
        dht = re.search(r"^  dht      (/ip4/127\.0\.0\.1/tcp/\d+/p2p/(\w+))$", block, re.M)
        metrics = re.search(r"^  metrics  (http://127\.0\.0\.1:\d+/metrics)$", block, re.M)
        assert grpc and dht and metrics, block
        assert f"  status   gasloc-node status --endpoint {grpc.group(1)}" in block
        # the run's settings without a flag come first, as GASLOC_* (eval_batches here)
        assert re.search(rf"^  GASLOC_EVAL_BATCHES=1 gasloc-node join .*--peers "
                         rf"{re.escape(dht.group(1))}", block, re.M), block

        owner = ["--owner-key", os.path.join(os.environ["XDG_DATA_HOME"], "gasloc_p2p",
                                             "owner.key")]  # the node owns a closed swarm
        health = status("--endpoint", grpc.group(1))
        assert not json.loads(health.stdout)["info"].get("authenticated"), health.stdout
        by_endpoint = status("--endpoint", grpc.group(1), *owner)
        assert by_endpoint.returncode == 0, by_endpoint.stderr
        info = json.loads(by_endpoint.stdout)["info"]
        assert info["dht_peer_id"] == dht.group(2) and info["endpoint"] == grpc.group(1)
        assert "probe_ok" not in info  # meaningful only in a reachability probe

        def by_multiaddr() -> dict | None:  # the node announces itself a moment after start
            result = status("--endpoint", dht.group(1), *owner)
            return json.loads(result.stdout)["info"] if result.returncode == 0 else None

        info = wait_for(by_multiaddr, 60, "status by the DHT multiaddr")
        assert info["dht_peer_id"] == dht.group(2) and info["endpoint"] == grpc.group(1)

        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl+C: the whole group
        assert proc.wait(timeout=scaled(60)) == 0, err.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [line for line in err.read_text().splitlines() if line.strip()]
    foreign = [line for line in lines if not OWN_LINE.match(line)]
    assert not foreign, "\n".join(foreign)
    assert "stopping (signal received" in lines[-1] or any("stopping" in x for x in lines)


def test_a_dead_bootstrap_peer_fails_in_one_line_saying_what_to_check(tmp_path: Path):
    dead = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWE8ZqNNbnBuXpp8jHyjRrSjLDJ89i8XZhJgaPVCbvaUHe"
    result = subprocess.run([*CLI, "join", *TINY, "--peers", dead, "--metrics-port", "-1",
                             "--open"],
                            capture_output=True, text=True, timeout=scaled(90), env=ENV)
    # the node asks the peer for its run's manifest first: one line naming --peers, exit 2
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith(f"gasloc-node join: error: no bootstrap peer answered "
                                f"(--peers {dead}): check that the node there is running")


def _interrupted(tmp_path: Path, ready: Callable[[str], bool], *flags: str
                 ) -> tuple[int, float, str]:
    """A ``join`` sent SIGINT (a terminal's Ctrl+C, to the whole group) once ``ready(its
    stderr so far)``: (exit code, seconds from the signal to the exit, stderr)."""
    err = tmp_path / "node.err"
    with err.open("w") as e:
        proc = subprocess.Popen([*CLI, "join", *TINY, *flags, "--metrics-port", "-1",
                                 "--open"], stdout=subprocess.DEVNULL, stderr=e, env=ENV,
                                process_group=0)
    try:
        wait_for(lambda: ready(err.read_text()), 90, "the moment to interrupt", 0.05)
        os.killpg(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        code = proc.wait(timeout=scaled(60))
        return code, time.monotonic() - sent, err.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_ctrl_c_while_loading_is_one_line(tmp_path: Path):
    """Ctrl+C while Python loads torch and hivemind: one line, no KeyboardInterrupt trace."""
    code, _, err = _interrupted(tmp_path, lambda _: time.sleep(0.3) or True)
    assert code == 130 and err.strip() == "gasloc-node: interrupted", err


def test_ctrl_c_while_the_model_is_built_stops_promptly(tmp_path: Path):
    """The node says what it builds (and its host memory) before building it; a Ctrl+C then
    (or anywhere before the node is up) cancels the start: the node stops at once, quietly,
    instead of finishing the start first."""
    corpus = write_corpus(tmp_path / "corpus")
    code, took, err = _interrupted(tmp_path, lambda text: "building the model" in text,
                                   "--data", str(corpus), "--n-layer", "6", "--n-embd", "384",
                                   "--n-head", "6")
    assert re.search(r"building the model gpt on cpu: 10\.\dM parameters; host memory about "
                     r"[\d.]+ GiB while training, [\d.]+ GiB at most while building it", err), err
    assert code == 130 and "stopped while starting" in err and "Traceback" not in err, err
    assert took < scaled(15), f"the stop took {took:.1f} s"


def test_a_restarted_node_resumes_from_the_checkpoint_it_keeps_by_default(tmp_path: Path):
    """No ``--checkpoint-dir``: a node that keeps its identity in the state folder keeps a
    checkpoint beside it, so a restart (the owner's node of a run, say) resumes where it
    stopped instead of from theta_0."""
    corpus = write_corpus(tmp_path / "corpus")
    env = {k: v for k, v in ENV.items() if k != "GASLOC_AUTO_CHECKPOINT"} | {
        "XDG_DATA_HOME": str(tmp_path / "state")}
    cmd = [*CLI, "join", *TINY, "--data", str(corpus), "--log-interval-s", "0.5"]

    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str) -> tuple[subprocess.Popen[bytes], Path, str]:
        """The node started again, its stderr and its start-up block."""
        out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        with out.open("w") as o, err.open("w") as e:
            procs.append(subprocess.Popen(cmd, stdout=o, stderr=e, env=env, process_group=0))
        block = wait_for(lambda: "new swarm" in out.read_text() and out.read_text(), 90,
                         f"the {name} start-up block")
        return procs[-1], err, block

    def stop(proc: subprocess.Popen[bytes], err: Path) -> None:
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=scaled(60)) == 0, err.read_text()[-3000:]

    steps = re.compile(r"INFO gasloc_p2p\.node\.daemon: step (\d+) loss")
    try:
        proc, err, block = start("first")
        ckpt = re.search(r"^  ckpt     (\S+) \(every 300 s and at stop; a restart resumes "
                         r"from it\)$", block, re.M)
        assert ckpt, block
        folder = Path(ckpt.group(1))
        assert folder.parent == tmp_path / "state" / "gasloc_p2p" / "nodes" / "gasloc"
        assert folder.name.startswith("checkpoint-identity-"), folder
        wait_for(lambda: any(int(s) >= 10 for s in steps.findall(err.read_text())), 90,
                 "ten steps")
        stop(proc, err)
        stopped_at = max(int(s) for s in steps.findall(err.read_text()))
        assert list(folder.iterdir()), "no checkpoint written at stop"

        proc, err, block = start("second")
        resumed = re.search(rf"^  ckpt     {re.escape(str(folder))} \(every 300 s and at "
                            r"stop; resumed at step (\d+)\)$", block, re.M)
        assert resumed, block
        assert int(resumed.group(1)) >= stopped_at >= 10  # the stop's own checkpoint
        stop(proc, err)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
