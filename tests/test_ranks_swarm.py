"""A node of two ranks in a real swarm (processes, gloo, the hivemind DHT, gRPC): it gossips
with a node of one rank, sends one payload per exchange, keeps its replicas identical, and a
rank that dies stops the node in one line; the same command resumes from its checkpoint."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from gasloc_p2p.node.runtime import checkpoint as ckpt
from gasloc_p2p.tools.nodes import METRICS_LINE
from gasloc_p2p.tools.procs import group_members
from gasloc_p2p.tools.swarm import read_metrics
from tests.daemon_helpers import write_corpus
from tests.hf_helpers import documents, write_jsonl, write_llama_config, write_tokenizer
from tests.node_helpers import moment_elements_per_file, scaled
from tests.swarm_helpers import NodeProc, stopped_within

FLAGS = ("--device", "cpu", "--eval-interval-steps", "40", "--batch-size", "8", "--seq-len", "32",
         "--n-embd", "32", "--n-head", "2")


def _rank_pid(node: NodeProc, rank: int) -> int:
    """The pid of rank ``rank`` among the launcher's children (its RANK variable)."""
    for pid in group_members(node.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"GASLOC_NPROC_PER_NODE=2" in env:
            return pid
    raise AssertionError(f"no rank {rank} in {node.name}'s process group")


def _wait(what: str, check, timeout_s: float) -> None:
    deadline = time.monotonic() + scaled(timeout_s)
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def _pair(tmp_path: Path, flags: list[str], nodes: list[NodeProc],
          sharding: str = "ddp") -> tuple[NodeProc, NodeProc]:
    """A node of 2 ranks, then a node of 1 joining it (appended to ``nodes`` as they start)."""
    two = NodeProc("two", tmp_path, [*flags, "--nproc-per-node", "2", "--sharding", sharding])
    nodes.append(two)
    peers = two.join_peers(scaled(90))
    one = NodeProc("one", tmp_path, [*flags, "--peers", *peers])
    nodes.append(one)
    return two, one


STOPPED = {"ddp": "stopped the node's 2 ranks: replicas identical",
           "fsdp": "stopped the node's 2 ranks (sharded; rank 0's full copy is current)"}


@pytest.mark.parametrize("sharding", [pytest.param("ddp", marks=pytest.mark.long), "fsdp"])
def test_a_two_rank_node_gossips_with_a_one_rank_node(tmp_path, sharding):
    """With FSDP2 the guard's drift probe samples the ranks' rows around every step, and
    every exchange reads and writes rank 0's full copy."""
    corpus = write_corpus(tmp_path / "corpus")
    flags = ["--data", str(corpus), *FLAGS]
    nodes: list[NodeProc] = []
    try:
        two, _ = _pair(tmp_path, flags, nodes, sharding)
        urls = [n.wait_for(METRICS_LINE, scaled(90)).group(1) for n in nodes]
        assert f"  ranks    2 on cpu ({sharding.upper()}" in two.tail(5000, stdout=True)

        def views():
            return [read_metrics(u) for u in urls]

        _wait("4 exchanges on both nodes",
              lambda: all(v is not None and v.ok >= 4 for v in views()), 150)
        a, b = views()
        assert a is not None and b is not None
        # one payload per exchange whatever the ranks: every exchange of this swarm is
        # between these two nodes and each side sends one payload of the same model, so the
        # two have sent the same bytes (K payloads would double the 2-rank node's), but for
        # the payloads of an exchange under way at the scrape, or one that failed, on one side.
        # (Per applied exchange is no measure: commits at weight 0 and failures send too.)
        assert a.sent_bytes > 0 and 2 / 3 < a.sent_bytes / b.sent_bytes < 3 / 2, (
            a.sent_bytes, b.sent_bytes)
        assert a.step > 0 and a.val_loss < 5.0
        for node in nodes:
            node.terminate()
            assert stopped_within(node, scaled(60)) == 0, node.tail(3000)
        log = two.tail(20000)
        assert STOPPED[sharding] in log, log
        assert "rank 1: stopped by rank 0" in log
    finally:
        for node in nodes:
            node.stop(10)


def test_a_dead_rank_stops_the_node_in_one_line_and_a_restart_resumes(tmp_path):
    """A sharded node (FSDP2, its layers' activations recomputed in the backward pass): its
    checkpoints hold the AdamW state each rank wrote (its rows); the restart gives every rank
    its rows back."""
    corpus = write_corpus(tmp_path / "corpus")
    ckdir = tmp_path / "ckpt"
    flags = ["--data", str(corpus), *FLAGS, "--nproc-per-node", "2", "--sharding", "fsdp",
             "--activation-checkpointing", "--checkpoint-dir", str(ckdir),
             "--checkpoint-interval-s", "1"]
    nodes: list[NodeProc] = []
    try:
        first = NodeProc("first", tmp_path, flags)
        nodes.append(first)
        first.wait_up(scaled(90))
        _wait("a checkpoint", lambda: ckpt.checkpoint_path(ckdir).exists(), 60)
        victim = _rank_pid(first, 1)
        os.kill(victim, signal.SIGKILL)
        code = first.proc.wait(timeout=scaled(60))
        err = first.tail(20000)
        assert code == 1, err
        lines = [ln for ln in err.splitlines() if "rank 1 of 2 died" in ln]
        assert lines == ["gasloc-node join: rank 1 of 2 died (signal SIGKILL); the node stops; "
                         "run the same command again to resume from its checkpoint"], err
        # every rank, and rank 0's DHT daemon, goes with the launcher
        _wait("the ranks to be gone",
              lambda: not [p for p in group_members(first.pid) if p != first.pid], 15)
        saved = ckpt.load(ckdir)
        assert saved is not None and saved["step"] > 0
        # the AdamW state: each rank wrote its rows (torch.distributed.checkpoint), the two
        # files hold both moments of every parameter, complete and readable
        ckpt.validate(saved, saved["fingerprint"], saved["theta"].numel(),
                      ckpt.checkpoint_path(ckdir))
        per_file = moment_elements_per_file(ckdir / ckpt.sharded_name(saved["optimizer"]))
        assert len(per_file) == 2 and sum(per_file.values()) == 2 * saved["theta"].numel()

        again = NodeProc("again", tmp_path, flags)
        nodes.append(again)
        found = again.wait_for(r"resumed from \S+ at step (\d+)", scaled(90), stdout=False)
        assert int(found.group(1)) >= int(saved["step"])
        again.wait_up(scaled(60))
        again.terminate()
        assert stopped_within(again, scaled(60)) == 0, again.tail(6000)
        assert STOPPED["fsdp"] in again.tail(20000)
        # one AdamW directory left: the last checkpoint's (the earlier ones, and what the
        # killed node may have left half-written, are removed)
        last = ckpt.load(ckdir)
        assert [d.name for d in ckdir.glob("optim-*")] == [ckpt.sharded_name(last["optimizer"])]
        # a node of one rank resumes it too (reads the ranks' files whole), and its own
        # checkpoints leave none of them
        plain = flags[:flags.index("--nproc-per-node")] + flags[flags.index("--sharding") + 2:]
        solo = NodeProc("solo", tmp_path, [*plain, "--max-steps", str(last["step"] + 4)])
        nodes.append(solo)
        found = solo.wait_for(r"resumed from \S+ at step (\d+)", scaled(90), stdout=False)
        assert int(found.group(1)) == int(last["step"])
        assert solo.proc.wait(timeout=scaled(60)) == 0, solo.tail(6000)
        assert ckpt.load(ckdir)["step"] == last["step"] + 4
        assert not list(ckdir.glob("optim-*"))
    finally:
        for node in nodes:
            node.stop(10)


@pytest.mark.long
def test_a_two_rank_llama_node_syncs_with_a_one_rank_node_in_diloco(tmp_path):
    """DiLoCo's round end runs after the step on rank 0 (hivemind's all-reduce, then the
    outer step): the other rank gets its rows of the result before the next step. A Hugging
    Face Llama sharded with FSDP2 (its decoder layers, then the root)."""
    pytest.importorskip("transformers")
    docs = documents(200)
    flags = ["--model", str(write_llama_config(tmp_path / "llama")), "--data",
             str(write_jsonl(tmp_path / "corpus.jsonl", docs)), "--tokenizer",
             str(write_tokenizer(tmp_path / "tok", docs)), "--device", "cpu", "--algorithm",
             "diloco", "--inner-steps", "10", "--batch-size", "4", "--seq-len", "32",
             "--eval-interval-steps", "50"]
    nodes: list[NodeProc] = []
    try:
        two, _ = _pair(tmp_path, flags, nodes, "fsdp")

        def synced(node: NodeProc) -> int:
            found = re.findall(r"syncs ok/failed/solo f0:(\d+)/", node.tail(20000))
            return int(found[-1]) if found else 0

        _wait("2 DiLoCo syncs on both nodes", lambda: min(map(synced, nodes)) >= 2, 150)
        for node in nodes:
            node.terminate()
            assert stopped_within(node, scaled(60)) == 0, node.tail(3000)
        assert STOPPED["fsdp"] in two.tail(20000)
    finally:
        for node in nodes:
            node.stop(10)
