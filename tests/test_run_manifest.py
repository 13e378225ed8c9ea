"""A run manifest: written by `init`, signed by the owner, its digest the run id; a node that
joins with --peers and nothing else trains by it; a contradicting flag or a tampered manifest
is refused in one line."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gasloc_p2p.node.config import ConfigError
from gasloc_p2p.node.manifest import Manifest, create, data_digest
from gasloc_p2p.node.settings import build_config
from gasloc_p2p.protocol.membership import Invitation, public_bytes, write_invitation
from tests.daemon_helpers import write_corpus
from tests.node_helpers import scaled

CLI = [sys.executable, "-m", "gasloc_p2p.cli"]
TINY = ["--n-layer", "2", "--n-embd", "64", "--seq-len", "64", "--batch-size", "8",
        "--inner-steps", "10", "--host", "127.0.0.1"]


def _manifest(tmp_path: Path, admission: str = "open", **extra: object
              ) -> tuple[Manifest, Ed25519PrivateKey, Path]:
    corpus = write_corpus(tmp_path / "corpus")
    owner = Ed25519PrivateKey.generate()
    cfg = build_config(argparse.Namespace(data=str(corpus), n_layer=2, n_embd=64, seq_len=64,
                                          open_swarm=True, **extra), environ={})
    values = {k: v for s in ("train", "outer", "gossip", "diloco")
              for k, v in vars(getattr(cfg, s)).items()}
    return create(values, owner, admission, "test", data_digest(str(corpus))), owner, corpus


def build(manifest: Manifest, **flags: object):
    return build_config(argparse.Namespace(**flags), environ={}, run=manifest.rule())


def test_a_manifest_sets_the_run_and_refuses_what_contradicts_it(tmp_path):
    m, owner, corpus = _manifest(tmp_path)
    assert Manifest.from_json(m.to_json(), "x") == m and m.run_id.startswith("r")
    cfg = build(m)
    assert (cfg.train.n_layer, cfg.train.seq_len, cfg.train.data) == (2, 64, str(corpus))
    assert cfg.discovery.run_id == m.run_id and cfg.network.open_swarm  # open: no flag needed
    assert build(m, lr=cfg.train.lr).train.lr == cfg.train.lr  # agreeing is fine
    with pytest.raises(ConfigError, match=r"^--lr=0.5 contradicts run r\w+ \(test\), which "
                                          r"trains with lr=0.003: drop it$"):
        build(m, lr=0.5)
    with pytest.raises(ConfigError, match="GASLOC_N_LAYER=3 contradicts"):
        build_config(argparse.Namespace(), environ={"GASLOC_N_LAYER": "3"}, run=m.rule())
    split = build(m, batch_size=8, grad_accum=2)  # the node's own split of the run's batch
    assert (split.train.batch_size, split.train.grad_accum) == (8, 2)
    with pytest.raises(ConfigError, match="must be run r\\w+'s batch of 16"):
        build(m, batch_size=4)
    device = build(m, device="cpu", precision="bf16", port=0)  # the node's own
    assert device.train.precision == "bf16"


def test_a_copy_of_the_runs_data_elsewhere_is_accepted_and_other_bytes_are_not(tmp_path):
    m, _, corpus = _manifest(tmp_path)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in corpus.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert build(m, data=str(copy)).train.data == str(copy)
    (copy / next(iter(corpus.iterdir())).name).write_text("other words\n" * 100)
    with pytest.raises(ConfigError, match="holds other bytes on this machine: pass --data"):
        build(m, data=str(copy))
    with pytest.raises(ConfigError, match="is not there on this machine"):
        build(m, data=str(tmp_path / "nowhere"))


def test_a_tampered_or_foreign_manifest_is_refused(tmp_path):
    m, _, _ = _manifest(tmp_path)
    doc = json.loads(m.to_json())
    doc["settings"]["lr"] = 0.3
    with pytest.raises(ConfigError, match="its signature is not its owner's"):
        Manifest.from_json(json.dumps(doc), "--manifest=x")
    with pytest.raises(ConfigError, match="a manifest of"):
        Manifest.from_json("x" * 20000, "--manifest=x")
    with pytest.raises(ConfigError, match="not a run manifest"):
        Manifest.from_json("{}", "--manifest=x")


def test_a_closed_run_needs_an_invitation_from_its_own_owner(tmp_path):
    m, owner, _ = _manifest(tmp_path, admission="closed")
    with pytest.raises(ConfigError, match=r"run r\w+ is closed: pass --invitation FILE"):
        build(m)
    key = Ed25519PrivateKey.generate()
    for name, signer in (("theirs.invite", Ed25519PrivateKey.generate()), ("ok.invite", owner)):
        write_invitation(str(tmp_path / name), Invitation.issue(
            signer, public_bytes(key), time.time() + 60), key.private_bytes_raw())
    with pytest.raises(ConfigError, match="an invitation from owner .* but run r\\w+ is owned"):
        build(m, invitation=str(tmp_path / "theirs.invite"))
    assert build(m, invitation=str(tmp_path / "ok.invite")).discovery.run_id == m.run_id
    # one bit of the owner's key flipped past the digits messages show: not "an invitation
    # from owner X, but run is owned by X", but what it is
    from tests.node_helpers import damage_invitation

    damage_invitation(tmp_path / "damaged.invite", tmp_path / "ok.invite")
    with pytest.raises(ConfigError, match=r"^--invitation=\S+: a damaged invitation \(its "
                                          r"signature does not verify\)$"):
        build(m, invitation=str(tmp_path / "damaged.invite"))


def test_init_then_join_with_peers_alone_trains_the_manifests_run(tmp_path):
    """Live: `init` writes the manifest, one node runs it, two nodes join with `--peers X` and
    nothing else: all three train the same model on the manifest's data and shape (same run
    id, model fingerprint and validation set) and exchange."""
    from gasloc_p2p.tools.nodes import NodeChild

    corpus = write_corpus(tmp_path / "corpus")
    env = dict(os.environ, HIVEMIND_LOGLEVEL="ERROR")
    out = subprocess.run([*CLI, "init", "--out", str(tmp_path / "run.json"), "--name", "t",
                          "--open", "--data", str(corpus), *TINY], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    run_id = re.match(r"run (r\w+) \(t\)", out.stdout).group(1)
    nodes = [NodeChild("a", tmp_path, ["--manifest", str(tmp_path / "run.json")])]
    try:
        hint = nodes[0].join_hint(scaled(120))
        assert hint.startswith("gasloc-node join --peers /ip4/"), hint  # nothing else needed
        peers = hint.split("--peers ")[1].split()
        nodes += [NodeChild(n, tmp_path, ["--peers", *peers], as_given=True) for n in "bc"]
        for node in nodes:
            node.wait_up(scaled(120))
        deadline = time.monotonic() + scaled(90)
        while time.monotonic() < deadline:
            infos = [n.info() for n in nodes]
            if all(i.exchanges_ok_initiator + i.exchanges_ok_responder for i in infos):
                break
            time.sleep(1)
        assert {i.run_id for i in infos} == {run_id}
        assert len({i.model_fingerprint for i in infos}) == 1
        assert len({i.validation_set for i in infos}) == 1 and str(corpus) in (
            nodes[1].tail(20000, stdout=True))  # the joiner names the run's data
        assert all(i.exchanges_ok_initiator + i.exchanges_ok_responder for i in infos), infos
        status = subprocess.run([*CLI, "status", "--peers", *peers, "--json", "--timeout-s",
                                 str(scaled(30))], capture_output=True, text=True,
                                timeout=scaled(60), env=env)
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)  # the run of the node asked, from its manifest
        assert report["info"]["run_id"] == run_id and len(report["swarm"]) == 3, report
        refused = subprocess.run([*CLI, "join", "--peers", *peers, "--lr", "0.5"],
                                 capture_output=True, text=True, timeout=scaled(60), env=env)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert f"--lr=0.5 contradicts run {run_id} (t)" in refused.stderr
    finally:
        for node in nodes:
            node.stop(30)
