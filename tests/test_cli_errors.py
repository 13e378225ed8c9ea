"""What a new user sees when something is wrong: one line on stderr, naming the flag to fix,
and at once (before the DHT or the model starts). Every case runs the real CLI in a subprocess.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.node_helpers import KNOB, scaled

CLI = [sys.executable, "-m", "gasloc_p2p.cli"]
ENV = dict(os.environ, HIVEMIND_LOGLEVEL="ERROR")


def run_cli(*args: str, timeout_s: float = 60, env: dict[str, str] | None = None
            ) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    try:
        result = subprocess.run([*CLI, *args], capture_output=True, text=True,
                                timeout=scaled(timeout_s), env={**ENV, **(env or {})})
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"gasloc-node {' '.join(args[:2])} ran past {exc.timeout:.0f} s "
                             f"({KNOB})") from None
    return result, time.monotonic() - start


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_status_of_a_dead_endpoint_is_one_line():
    result, _ = run_cli("status", "--endpoint", "127.0.0.1:1", "--timeout-s", "10")
    assert result.returncode == 1
    line = one_line(result)
    assert line.startswith("gasloc-node status: error: no gasloc node answered at 127.0.0.1:1")
    assert "--endpoint" in line and "Connection refused" in line


@pytest.mark.parametrize("peer, problem", [
    ("/ip4/127.0.0.1/tcp/1/p2p/QmNotARealPeer", "not a valid multiaddr"),
    ("/ip4/127.0.0.1/tcp/1", "no /p2p/<peer id> part"),
    ("/ip4/1.2.3/tcp/5/p2p/QmXpQZ5i5WGi6pgc3yXfELRRtZmkXo8Nqkp1UG3ziodZxX", "not IPv4"),
])
@pytest.mark.parametrize("command", ["join", "status"])
def test_a_malformed_bootstrap_peer_fails_at_once(command, peer, problem):
    result, _ = run_cli(command, "--peers", peer, *(["--open"] if command == "join" else []))
    assert result.returncode == 2
    line = one_line(result)
    assert line.startswith(f"gasloc-node {command}: error: --peers='{peer}'") and problem in line


@pytest.mark.parametrize("flag, what", [("--port", "the gRPC port"), ("--dht-port", "the DHT"),
                                        ("--metrics-port", "/metrics")])
def test_a_port_in_use_names_its_flag(flag, what):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result, seconds = run_cli("join", "--host", "127.0.0.1", flag, str(port))
    assert result.returncode == 2
    line = one_line(result)
    assert line == (f"gasloc-node join: error: cannot listen on 127.0.0.1:{port} for {what} "
                    f"(Address already in use): choose another {flag} (0: any free port)")
    assert seconds < scaled(30), "the check must come before the DHT starts"


GOOD_PEER = "/ip4/127.0.0.1/tcp/1/p2p/QmXpQZ5i5WGi6pgc3yXfELRRtZmkXo8Nqkp1UG3ziodZxX"


@pytest.mark.parametrize("flags, problem", [
    ((), "the swarm is closed: pass --invitation FILE"),
    (("--open", "--owner-key", "o.key"), "--open contradicts --invitation/--owner-key"),
])
def test_joining_without_a_credential_is_refused_in_one_line(flags, problem):
    """Swarms are closed by default: a node that joins one needs an invitation from its owner
    (or the swarm key), and says so before it starts anything."""
    result, seconds = run_cli("join", "--check", "--peers", GOOD_PEER, *flags)
    assert result.returncode == 2
    line = one_line(result)
    assert line.startswith(f"gasloc-node join: error: {problem}"), line
    assert seconds < scaled(30)


TYPOS = {"sim": ("--wrkers", "--workers"), "join": ("--max_steps", "--max-steps"),
         "status": ("--endpont", "--endpoint"), "export": ("--ot", "--out"),
         "plan": ("--modle", "--model"), "swarm": ("--nodez", "--nodes"),
         "dashboard": ("--prometeus", "--prometheus"), "invite": ("--ot", "--out"),
         "revoke": ("--membr", "--member"), "id": ("--identiy-file", "--identity-file"),
         "init": ("--ot", "--out"), "corpus": ("--vocabb", "--vocab")}


def test_an_unknown_flag_names_the_closest_one_for_every_command(capsys):
    """Checked before anything else (export's --out is required: the typo, not the missing
    flag, is what the user needs to hear)."""
    from gasloc_p2p.cli import Parser, build_parser, main

    commands = build_parser()._commands()  # type: ignore[attr-defined]
    assert set(TYPOS) == set(commands) and all(isinstance(p, Parser) for p in commands.values())
    for command, (typo, meant) in TYPOS.items():
        with pytest.raises(SystemExit) as exit_:
            main([command, typo, "1"])
        assert exit_.value.code == 2
        assert capsys.readouterr().err == (
            f"gasloc-node {command}: error: unrecognized arguments: {typo}; did you mean {meant}? "
            f"(see 'gasloc-node {command} --help')\n")


@pytest.mark.parametrize("argv, hint", [
    (["--verison"], "did you mean --version?"),
    (["jion"], "invalid choice: 'jion' (choose from"),
    (["join", "--log-level", "DEBUG"],
     "--log-level is an option of gasloc-node itself: put it before the command"),
    (["--peers", "x", "join"], "put it after one (gasloc-node join --peers ...)"),
    (["swarm", "--data", "x.txt"], "put node flags after '--' (gasloc-node swarm -- --data ...)"),
])
def test_flags_in_the_wrong_place_say_where_they_go(capsys, argv, hint):
    from gasloc_p2p.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and hint in err and err.count("\n") == 1, err
    if argv == ["jion"]:
        assert err.endswith("did you mean 'join'? (see 'gasloc-node --help')\n")


def test_an_unreadable_data_file_stops_the_node_with_one_line(tmp_path):
    """Read when the node starts (after the DHT): still one line naming the flag and the file,
    exit 2, and no second line from the reader's own logging."""
    pytest.importorskip("datasets")
    bad = tmp_path / "corpus.jsonl"
    bad.write_text('{"text": "first document"}\n{not json\n')
    result, _ = run_cli("--log-level", "WARNING", "join", "--host", "127.0.0.1", "--data",
                        str(bad), "--metrics-port", "-1", timeout_s=120)
    assert result.returncode == 2, result.stderr
    assert one_line(result).startswith(
        f"gasloc-node join: error: --data {str(bad)!r}: cannot read it as JSON Lines")


def test_a_checkpoint_dir_that_cannot_be_a_directory_names_the_flag(tmp_path):
    """A file where the checkpoint directory (or a folder above it) should be: one line naming
    --checkpoint-dir, exit 2, before anything starts."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result, _ = run_cli("join", "--host", "127.0.0.1", "--metrics-port", "-1",
                        "--checkpoint-dir", str(blocker / "ckpt"))
    assert result.returncode == 2, result.stderr
    assert one_line(result) == (f"gasloc-node join: error: --checkpoint-dir={blocker / 'ckpt'}: "
                                "cannot use it as a directory (Not a directory); pass another "
                                "one")


def test_an_expired_or_damaged_invitation_is_one_line(tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from gasloc_p2p.protocol.membership import Invitation, public_bytes, write_invitation
    from tests.node_helpers import damage_invitation

    owner, key = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    expired = tmp_path / "expired.invite"
    write_invitation(str(expired), Invitation.issue(owner, public_bytes(key), time.time() - 60),
                     key.private_bytes_raw())
    good = tmp_path / "good.invite"
    write_invitation(str(good), Invitation.issue(owner, public_bytes(key), time.time() + 3600),
                     key.private_bytes_raw())
    damage_invitation(tmp_path / "damaged.invite", good)
    for name, problem in (("expired", "expired on "), ("damaged", "a damaged invitation (its "
                                                                  "signature does not verify)")):
        path = tmp_path / f"{name}.invite"
        result, seconds = run_cli("join", "--invitation", str(path), "--host", "127.0.0.1",
                                  "--metrics-port", "-1")
        assert result.returncode == 2, result.stderr
        assert one_line(result).startswith(f"gasloc-node join: error: --invitation={path}: "
                                           f"{problem}")
        assert seconds < scaled(30), "before the DHT starts"


def test_a_hub_dataset_without_the_hub_fails_fast_in_one_line(tmp_path):
    """No way to the Hugging Face hub (here: its endpoint refuses; on a machine without
    internet, its name does not resolve): one line at once, not the hub client's retries
    (25 lines over 28 s)."""
    result, seconds = run_cli("--log-level", "WARNING", "join", "--host", "127.0.0.1",
                              "--data", "hf:someone/stories", "--metrics-port", "-1",
                              env={"HF_ENDPOINT": "http://127.0.0.1:1", "HF_HUB_OFFLINE": "",
                                   "HF_DATASETS_OFFLINE": ""})
    assert result.returncode == 2, result.stderr
    assert one_line(result) == (
        "gasloc-node join: error: --data 'hf:someone/stories': cannot reach the Hugging Face "
        "hub at 127.0.0.1:1 (Connection refused); check this machine's network (or "
        "HF_ENDPOINT), or pass a local copy of the data")
    assert seconds < scaled(25), f"{seconds:.0f} s"
