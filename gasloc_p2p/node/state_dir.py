"""Where a node keeps its identity by default, so that its peer id survives restarts.

A node started without ``--identity-file`` (and without an invitation that carries its key)
keeps its key in ``<checkpoint-dir>/identity.key`` when it checkpoints, else in
``$XDG_DATA_HOME/gasloc_p2p/nodes/<run id>/identity.key``. Several nodes of one run on one
machine (a local swarm, tests) each take the first of ``identity.key``, ``identity-1.key``, ...
that no running node holds: a node holds its key file's lock while it runs.

Its DHT (libp2p) key lives beside its own key (:func:`dht_identity`), so the DHT multiaddr in
the join line it prints stays valid across restarts too, and so do its checkpoints unless
``--checkpoint-dir`` names a folder (:func:`default_checkpoint`): a restart resumes.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from gasloc_p2p.node.config import NodeConfig

MAX_NODES_PER_RUN = 64
_held: list[IO[bytes]] = []  # the lock files of this process's node (held until it exits)


def data_home() -> Path:
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")


def nodes_home() -> Path:
    """Where the state folders of every run's nodes on this machine live, one per run id."""
    return data_home() / "gasloc_p2p" / "nodes"


def default_identity(cfg: NodeConfig) -> str:
    """The identity file a node with ``cfg`` uses ("" when it needs none of its own: a file
    was given, or its invitation holds its key); creates the folder and takes the file's
    lock. OSError if no file is free (more than ``MAX_NODES_PER_RUN`` nodes of the run)."""
    net = cfg.network
    if net.identity_file:
        return net.identity_file
    if net.invitation:
        from gasloc_p2p.protocol.membership import read_invitation

        if read_invitation(net.invitation)[1]:
            return ""
    folder = _state_folder(cfg)
    for i in range(MAX_NODES_PER_RUN):
        path = folder / ("identity.key" if i == 0 else f"identity-{i}.key")
        lock = open(folder / f".{path.name}.lock", "wb")  # noqa: SIM115 - held while it runs
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue
        _held.append(lock)
        return str(path)
    raise OSError(f"{MAX_NODES_PER_RUN} nodes of run {cfg.discovery.run_id!r} already run on "
                  f"this machine ({folder}): pass --identity-file")


def _state_folder(cfg: NodeConfig) -> Path:
    """The node's state folder (``--checkpoint-dir``, else one per run), made if missing."""
    given = cfg.checkpoint.checkpoint_dir
    folder = Path(given) if given else nodes_home() / cfg.discovery.run_id
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        if not given:
            raise
        raise OSError(f"--checkpoint-dir={folder}: cannot use it as a directory "
                      f"({exc.strerror}); pass another one") from None
    return folder


def dht_identity(cfg: NodeConfig) -> str:
    """The file of the node's DHT (libp2p) key, beside its own key: ``identity.key`` ->
    ``identity.dht.key``; a member whose key is its invitation's: ``dht-<peer id>.key`` in
    the state folder. "" for a node whose own key is new at each start (its DHT key is too).
    hivemind makes the file at the first start."""
    net = cfg.network
    if net.identity_file:
        path = Path(net.identity_file)
        return str(path.with_name(path.name.removesuffix(".key") + ".dht.key"))
    if net.invitation:
        from gasloc_p2p.protocol.membership import read_invitation

        invitation, key = read_invitation(net.invitation)
        if key:
            return str(_state_folder(cfg) / f"dht-{invitation.member_id}.key")
    return ""


def default_checkpoint(cfg: NodeConfig, fingerprint: str) -> str:
    """The checkpoint folder of a node that keeps its identity in the state folder and was
    given no ``--checkpoint-dir`` ("" for any other: its identity, hence its state, is its
    own business): ``checkpoint-<key>-<model fingerprint>``. The model's fingerprint keeps a
    node started with other model flags of the same run (the run ``gasloc`` of flags) from
    meeting a checkpoint it cannot load."""
    cp, net = cfg.checkpoint, cfg.network
    if cp.checkpoint_dir or not cp.auto_checkpoint:
        return ""
    folder = nodes_home() / cfg.discovery.run_id
    if net.identity_file:
        path = Path(net.identity_file)
        if path.parent != folder:
            return ""
        key = path.name.removesuffix(".key")
    elif net.invitation:
        from gasloc_p2p.protocol.membership import read_invitation

        invitation, held = read_invitation(net.invitation)
        if not held:
            return ""
        key = f"member-{invitation.member_id[:16]}"
    else:
        return ""
    return str(folder / f"checkpoint-{key}-{fingerprint[:12]}")


def kept_checkpoints() -> list[Path]:
    """The checkpoint folders nodes kept in this machine's state folders
    (:func:`default_checkpoint`) that hold a checkpoint, newest first."""
    from gasloc_p2p.node.runtime.checkpoint import checkpoint_path

    found = [d for d in nodes_home().glob("*/checkpoint-*")
             if checkpoint_path(d).is_file()]
    return sorted(found, key=lambda d: checkpoint_path(d).stat().st_mtime, reverse=True)
