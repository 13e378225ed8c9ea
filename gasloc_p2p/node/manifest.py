"""A run manifest: what every node of a run trains, signed by the run's owner.

``gasloc-node init`` writes one from its flags: the run-level settings (:data:`RUN_FIELDS`:
the model and its init seed, the tokenizer, the data source and its field, the training shape,
the algorithm and its parameters, the codec), the data's sha256 when it is a local file, the
admission policy, and the owner's public key, signed with the owner key. Its digest is the run
id, so nodes that agree on the run id agree on every one of these settings, and a manifest
that was changed after signing names another run. Nodes publish their run's manifest in the
DHT; a node that joins with ``--peers`` and nothing else fetches it, checks it, and trains
what it says (:func:`apply`). A local setting that contradicts it is a one-line error naming
the flag and the run's value; a node chooses only what is its own (device, precision, ports,
threads, checkpoints) and how it splits the run's batch (``batch_size`` x ``grad_accum``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from gasloc_p2p.core.options import ConfigError
from gasloc_p2p.protocol.membership import public_bytes

MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 16 * 1024  # a manifest travels in a DHT record
RUN_ID_PREFIX = "r"
ADMISSIONS = ("closed", "keyed", "open")
# the settings that make a run: every node of the run has these values
RUN_FIELDS = (
    "model", "data", "data_field", "tokenizer", "seed", "n_layer", "n_embd", "n_head",
    "seq_len", "lr", "min_lr_ratio", "warmup_steps", "lr_horizon_steps", "weight_decay",
    "decay_vectors", "inner_steps", "eval_batches",
    "algorithm", "eta", "gamma", "w", "momentum",
    "codec", "block_size", "fragments", "exchanges_per_round",
    "diloco_eta", "diloco_gamma", "diloco_codec", "tau", "merge_alpha",
)
BATCH = "batch"  # the run's sequences per inner step: batch_size x grad_accum on every node


@dataclass(frozen=True)
class Manifest:
    """A signed run manifest (see the module docstring)."""

    body: dict[str, Any]  # everything but the signature
    signature: bytes

    @property
    def run_id(self) -> str:
        """``r`` + 24 hex digits of the sha256 of the canonical body."""
        return RUN_ID_PREFIX + hashlib.sha256(canonical(self.body)).hexdigest()[:24]

    @property
    def name(self) -> str:
        return str(self.body.get("name", ""))

    @property
    def owner(self) -> bytes:
        return bytes.fromhex(str(self.body["owner"]))

    @property
    def admission(self) -> str:
        return str(self.body["admission"])

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self.body["settings"])

    def rule(self) -> Callable[[dict[str, Any], dict[str, str]], dict[str, Any]]:
        """This run's settings as ``build_config``'s ``run`` rule (:func:`apply`)."""
        return functools.partial(apply, self)

    def to_json(self) -> str:
        return json.dumps({**self.body, "signature": self.signature.hex()}, indent=2,
                          sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> Manifest:
        """A manifest whose fields parse and whose signature is its owner's; ConfigError
        naming ``where`` otherwise."""
        if len(text) > MAX_MANIFEST_BYTES:
            raise ConfigError(f"{where}: a manifest of {len(text)} bytes (at most "
                              f"{MAX_MANIFEST_BYTES})")
        try:
            doc = json.loads(text)
            signature = bytes.fromhex(doc.pop("signature"))
            manifest = cls(doc, signature)
            problem = manifest.problem()
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ConfigError(f"{where}: not a run manifest ({exc})") from None
        if problem:
            raise ConfigError(f"{where}: {problem}")
        return manifest

    def problem(self) -> str:
        """Why this manifest is not one its owner signed ("" if it is)."""
        b = self.body
        if b.get("gasloc_manifest") != MANIFEST_VERSION:
            return f"manifest version {b.get('gasloc_manifest')!r}, this node reads " \
                   f"{MANIFEST_VERSION}"
        if b.get("admission") not in ADMISSIONS or not isinstance(b.get("settings"), dict):
            return "a manifest without an admission policy or settings"
        unknown = set(b["settings"]) - {*RUN_FIELDS, BATCH}
        if unknown:
            return f"unknown run settings {sorted(unknown)}"
        try:
            Ed25519PublicKey.from_public_bytes(self.owner).verify(self.signature,
                                                                  canonical(self.body))
        except (InvalidSignature, ValueError):
            return "its signature is not its owner's (changed after it was signed?)"
        return ""


def canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def create(values: dict[str, Any], owner: Ed25519PrivateKey, admission: str, name: str,
           data_sha256: str = "") -> Manifest:
    """A manifest of the run settings in ``values`` (config field -> value, every field of
    :data:`RUN_FIELDS` and ``batch_size``/``grad_accum``), signed by ``owner``."""
    if admission not in ADMISSIONS:
        raise ValueError(f"admission {admission!r}: one of {ADMISSIONS}")
    settings = {k: values[k] for k in RUN_FIELDS}
    settings[BATCH] = int(values["batch_size"]) * int(values["grad_accum"])
    body = {"gasloc_manifest": MANIFEST_VERSION, "name": name, "owner": public_bytes(owner).hex(),
            "admission": admission, "settings": settings, "data_sha256": data_sha256}
    return Manifest(body, owner.sign(canonical(body)))


def apply(manifest: Manifest, values: dict[str, Any], given: dict[str, str]
          ) -> dict[str, Any]:
    """``values`` (config field -> value, merged from the node's flags, environment and TOML)
    with the run's settings: a value the node gave itself (``given``: field -> where it came
    from, e.g. ``--lr`` or ``GASLOC_LR``) that differs from the run's is a ConfigError naming
    it and the run's value. ``batch_size`` and ``grad_accum`` are the node's to choose as long
    as their product is the run's batch."""
    out = dict(values)
    run = manifest.settings
    out.update(_membership(manifest, values, given))
    for field in RUN_FIELDS:
        want = run[field]
        if field == "data":
            out["data"] = _data(manifest, values, given)
            continue
        if field in given and _differs(values[field], want):
            raise ConfigError(f"{given[field]}={values[field]!r} contradicts run "
                              f"{manifest.run_id} ({manifest.name or 'unnamed'}), which "
                              f"trains with {field}={want!r}: drop it")
        out[field] = tuple(want) if isinstance(want, list) else want
    batch, accum = values.get("batch_size"), values.get("grad_accum", 1)
    if "batch_size" in given or "grad_accum" in given:
        if batch is None or int(batch) * int(accum) != run[BATCH]:
            where = given.get("batch_size") or given.get("grad_accum")
            raise ConfigError(f"{where}: batch_size x grad_accum = {batch} x {accum} must be "
                              f"run {manifest.run_id}'s batch of {run[BATCH]} sequences per "
                              "inner step")
    else:
        out["batch_size"], out["grad_accum"] = run[BATCH], 1
    out["run_id"] = manifest.run_id
    out["data_sha256"] = str(manifest.body.get("data_sha256", ""))
    return out


def _data(manifest: Manifest, values: dict[str, Any], given: dict[str, str]) -> str:
    """The data this node reads: the run's, or its own copy of the run's bytes (a local file
    or folder whose sha256 the manifest names); ConfigError if neither is here."""
    run, sha = str(manifest.settings["data"]), str(manifest.body.get("data_sha256", ""))
    mine = str(values["data"]) if "data" in given else run
    from gasloc_p2p.data.sources import is_url

    if is_url(run) and mine == run:  # checked when it is downloaded (data_sha256)
        return run
    if not sha:  # the default corpus or a hub dataset: the same name everywhere
        if mine != run:
            raise ConfigError(f"{given['data']}={mine!r} contradicts run {manifest.run_id}, "
                              f"which trains on {run or 'the default corpus'}: drop it")
        return run
    if data_digest(mine) != sha:
        where = given.get("data", "--data")
        what = "is not there" if not data_digest(mine) else "holds other bytes"
        raise ConfigError(f"{where}: run {manifest.run_id} trains on {run} (sha256 "
                          f"{sha[:16]}...), which {what} on this machine: pass --data PATH to "
                          "your copy of it")
    return mine


def _membership(manifest: Manifest, values: dict[str, Any], given: dict[str, str]
                ) -> dict[str, Any]:
    """The network settings the run's admission policy implies for this node (an open run
    needs no flag); ConfigError if this node's credential cannot join it."""
    from gasloc_p2p.protocol.membership import read_invitation, read_key_file

    policy, run_id = manifest.admission, manifest.run_id
    if policy == "open":
        return {} if any(k in given for k in _CREDENTIALS) else {"open_swarm": True}
    if policy == "keyed":
        if "swarm_key" not in given:
            raise ConfigError(f"run {run_id} is keyed: pass --swarm-key FILE (its secret)")
        return {}
    owner = manifest.owner
    if values.get("invitation"):
        try:
            invitation, _ = read_invitation(str(values["invitation"]))
        except (OSError, ValueError) as exc:
            path = str(values["invitation"])
            raise ConfigError(f"--invitation={path}: {str(exc).removeprefix(path + ': ')}"
                              ) from None
        if invitation.owner != owner:
            raise ConfigError(f"{given.get('invitation', '--invitation')}: an invitation from "
                              f"owner {invitation.owner.hex()[:16]}, but run {run_id} is "
                              f"owned by {owner.hex()[:16]}")
        return {}
    if values.get("owner_key"):
        key = read_key_file(str(values["owner_key"]))
        if key is not None and public_bytes(key) != owner:
            raise ConfigError(f"{given.get('owner_key', '--owner-key')}: another owner than "
                              f"run {run_id}'s ({owner.hex()[:16]})")
        return {}
    from gasloc_p2p.node.runtime.identity import default_owner_key_path

    mine = read_key_file(default_owner_key_path()) if Path(
        default_owner_key_path()).exists() else None
    if mine is not None and public_bytes(mine) == owner:  # the owner's own machine
        return {"owner_key": default_owner_key_path()}
    raise ConfigError(f"run {run_id} is closed: pass --invitation FILE from its owner "
                      f"({owner.hex()[:16]}; they run `gasloc-node invite --out FILE`)")


_CREDENTIALS = ("swarm_key", "invitation", "owner_key", "open_swarm")


def _differs(mine: Any, run: Any) -> bool:
    if isinstance(run, list):
        run = tuple(run)
    if isinstance(mine, float) or isinstance(run, float):
        try:
            return float(mine) != float(run)
        except (TypeError, ValueError):
            return True
    return bool(mine != run)


def data_digest(data: str, fetch: bool = False) -> str:
    """sha256 (hex) of a data source's bytes: a file, or a directory's or glob's files in
    sorted order, each as its relative name and content; a URL's file when ``fetch`` (it is
    downloaded into the cache); "" for anything else (the default corpus, a hub dataset, a
    URL without ``fetch``)."""
    from gasloc_p2p.data.sources import fetch_url, file_sha256, is_hub, is_url

    if is_url(data):
        return file_sha256(fetch_url(data)) if fetch else ""
    if not data or is_hub(data):
        return ""
    path = Path(data).expanduser()
    if path.is_file():
        files = [path]
        base = path.parent
    elif path.is_dir():
        files, base = sorted(p for p in path.rglob("*") if p.is_file()), path
    else:
        import glob

        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(data), recursive=True)
                       if Path(p).is_file())
        base = Path(os.path.commonpath([str(f) for f in files])) if files else path
    if not files:
        return ""
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(base) if f != base else f.name).encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
    return h.hexdigest()
