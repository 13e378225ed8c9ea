"""Node configuration: precedence flags > env > TOML > defaults, validation, CLI errors."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from gasloc_p2p.node.config import ConfigError, NodeConfig
from gasloc_p2p.node.settings import add_config_flags, build_config, options


def parse(argv):
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return parser.parse_args(argv)


def test_defaults_are_valid_and_names_unique():
    cfg = build_config(parse([]), environ={})
    assert cfg == NodeConfig()
    assert len(options()) == sum(len(vars(getattr(cfg, s))) for s in vars(cfg))


def test_precedence_flags_over_env_over_toml(tmp_path):
    toml = tmp_path / "node.toml"
    toml.write_text('[gossip]\ncodec = "fp4"\nfragments = 2\n[train]\nlr = 1e-3\n'
                    '[discovery]\npeers = ["/ip4/1.2.3.4/tcp/1/p2p/Qm"]\n')
    env = {"GASLOC_CODEC": "int4", "GASLOC_LR": "2e-3", "GASLOC_CLIENT_MODE": "yes",
           "GASLOC_CACHE": "/ignored"}
    cfg = build_config(parse(["--config", str(toml), "--codec", "fp16", "--open"]),
                       environ=env)
    assert cfg.gossip.codec == "fp16"  # flag
    assert cfg.train.lr == 2e-3  # env beats TOML
    assert cfg.gossip.fragments == 2  # TOML beats default
    assert cfg.network.client_mode is True
    assert cfg.discovery.peers == ("/ip4/1.2.3.4/tcp/1/p2p/Qm",)
    cfg = build_config(parse(["--peers", "/ip4/a", "/ip4/b", "--no-init-from-swarm",
                              "--open"]), environ={"GASLOC_PEERS": "/ip4/c,/ip4/d"})
    assert cfg.discovery.peers == ("/ip4/a", "/ip4/b") and not cfg.gossip.init_from_swarm
    assert build_config(None, environ={"GASLOC_PEERS": "/ip4/c, /ip4/d",
                                       "GASLOC_OPEN_SWARM": "yes"}).discovery.peers == (
        "/ip4/c", "/ip4/d")


@pytest.mark.parametrize("text, match", [
    ("[gossip]\ncodek = 1\n", "unknown key 'codek' in \\[gossip\\]"),
    ("[gosip]\ncodec = 'int8'\n", "unknown table \\[gosip\\]"),
    ("[gossip]\nfragments = 'two'\n", "fragments must be int"),
    ("[gossip\n", "not valid TOML"),
])
def test_bad_toml_is_reported(tmp_path, text, match):
    toml = tmp_path / "bad.toml"
    toml.write_text(text)
    with pytest.raises(ConfigError, match=match):
        build_config(parse(["--config", str(toml)]), environ={})


@pytest.mark.parametrize("env, match", [
    ({"GASLOC_HEADER_TIMEOUT_S": "500"},
     r"header_timeout_s=500.0 \(\[gossip\] in --config, or GASLOC_HEADER_TIMEOUT_S\): must be "
     "shorter than"),
    ({"GASLOC_ANNOUNCE_TTL_S": "1"}, "announce_ttl_s=1.0 .*: must exceed --announce-interval-s"),
    ({"GASLOC_FRAGMENTS": "9"}, "--fragments=9: cannot exceed the model's --n-layer=4"),
    ({"GASLOC_KEEPALIVE_TIMEOUT_S": "30"}, "must be shorter than --keepalive-time-s"),
    ({"GASLOC_CODEC": "int9"}, "--codec='int9': choose one of"),
    ({"GASLOC_PORT": "http"}, "environment GASLOC_PORT: --port: expected int"),
    ({"GASLOC_PEERS": "1.2.3.4:5"}, "each peer is a multiaddr"),
    ({"GASLOC_GAMMA": "1.5"}, "--gamma=1.5: the outer momentum needs"),
    ({"GASLOC_MOMENTUM": "acid"}, "momentum='acid' .*: choose one of"),
    ({"GASLOC_DATA": "/nonexistent/c.jsonl"}, "^--data '/nonexistent/c.jsonl': no such file or "
                                              "directory$"),
    ({"GASLOC_DATA": "/nonexistent/*.parquet"}, "^--data '/nonexistent/\\*.parquet' matched no "
                                                "files$"),
])
def test_invalid_values_and_relations_name_the_flag(env, match):
    with pytest.raises(ConfigError, match=match):
        build_config(None, environ=env)


@pytest.mark.parametrize("argv, match", [
    (["join", "--codec", "int9"], "gasloc-node join: error: --codec='int9'"),
    (["join", "--bogus"], "unrecognized arguments: --bogus"),
    (["join", "--inner-steps", "x"], "--inner-steps: expected int, got 'x'"),
    (["status"], "give --endpoint HOST:PORT or --peers MADDR"),
    (["join", "--data", "/nonexistent/c.jsonl"],
     "gasloc-node join: error: --data '/nonexistent/c.jsonl': no such file or directory"),
    (["sim", "--data", "/nonexistent/plays.txt"],
     "gasloc-node sim: error: --data '/nonexistent/plays.txt': no such file or directory"),
])
def test_cli_errors_are_one_line_with_exit_code_2(argv, match):
    out = subprocess.run([sys.executable, "-m", "gasloc_p2p.cli", *argv], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and match in lines[0], out.stderr
