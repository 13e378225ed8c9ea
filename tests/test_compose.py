"""Container files, checked without an engine: docker-compose.yml (``docker-compose config -q``
when docker-compose is installed), the Dockerfile's contract, Prometheus' scrape config, and the
Grafana provisioning and dashboard JSON (Grafana cannot run here: structure only).

The real engine test is ``scripts/compose_test.sh`` (builds the images, runs a swarm).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml  # PyYAML: a dependency of hivemind, so always installed with the project

from gasloc_p2p.node.settings import env_name, options

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
COMPOSE = ROOT / "docker-compose.yml"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "gasloc.json"
DATASOURCES = DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = DOCKER / "grafana" / "provisioning" / "dashboards" / "dashboards.yml"

PROMQL_WORDS = frozenset({
    "sum", "min", "max", "avg", "count", "rate", "irate", "increase", "delta", "by", "without",
    "histogram_quantile", "topk", "bottomk", "abs", "clamp_min", "clamp_max", "offset", "on",
    "ignoring", "group_left", "group_right", "and", "or", "unless", "time", "vector",
    "avg_over_time", "max_over_time", "min_over_time", "last_over_time", "label_values",
})
# GASLOC_* variables the container files may set that are not node flags.
CONTAINER_ONLY_ENV = frozenset({
    "GASLOC_CACHE", "GASLOC_BOOTSTRAP_DHT_PORT", "GASLOC_BOOTSTRAP_TIMEOUT_S",
    "GASLOC_INVITE_FROM",  # join-via: an owner key to invite the worker with (local swarms)
    # compose interpolation knobs (${GASLOC_...} on the host side), not container variables
    "GASLOC_BASE_IMAGE", "GASLOC_PROMETHEUS_PORT", "GASLOC_GRAFANA_PORT",
    "GASLOC_DASHBOARD_PORT",
})


def load_yaml(path: Path) -> dict:
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict), f"{path} is not a YAML mapping"
    return doc


def dockerfile_env(path: Path) -> dict[str, str]:
    """``ENV`` assignments of a Dockerfile (KEY=VALUE form, continuation lines joined)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.strip().startswith("ENV "):
            env.update(re.findall(r"(\w+)=(\S+)", line))
    return env


# ------------------------------------------------------------------------ compose
def compose_cmd() -> list[str]:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose (v1) is not installed: apt-get install -y docker-compose")
    return [exe, "--project-directory", str(ROOT), "-f", str(COMPOSE)]


@pytest.mark.parametrize("profile", [[], ["--profile", "grafana"]], ids=["default", "grafana"])
def test_docker_compose_config_is_valid(profile):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DOCKER_", "COMPOSE_"))}
    proc = subprocess.run([*compose_cmd(), *profile, "config", "-q"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_compose_services_make_a_scalable_swarm():
    services = load_yaml(COMPOSE)["services"]
    assert {"bootstrap", "worker", "prometheus", "dashboard", "grafana"} <= services.keys()
    boot, worker = services["bootstrap"], services["worker"]
    assert "--peers" not in boot.get("command", []), "the bootstrap node starts the swarm"
    # `--scale worker=N` needs no fixed name and no host port per replica.
    assert "container_name" not in worker and "ports" not in worker
    assert worker["entrypoint"][:5] == ["tini", "--", "gasloc-container", "join-via",
                                        "bootstrap:50051"]
    assert worker["depends_on"]["bootstrap"]["condition"] == "service_healthy"
    # Grafana cannot be pulled without a registry: a plain `up` must not need it.
    assert services["grafana"]["profiles"] == ["grafana"]
    assert "profiles" not in services["prometheus"] and "profiles" not in services["dashboard"]
    dash = services["dashboard"]
    assert dash["command"][:3] == ["dashboard", "--prometheus", "http://prometheus:9090"]
    assert "healthz" in " ".join(dash["healthcheck"]["test"]), "the image's check is for nodes"


def test_gasloc_variables_name_real_node_flags():
    known = {env_name(opt) for opt in options().values()}
    used = set(re.findall(r"\bGASLOC_[A-Z0-9_]+", COMPOSE.read_text()))
    used |= {k for k in dockerfile_env(DOCKER / "Dockerfile") if k.startswith("GASLOC_")}
    unknown = used - known - CONTAINER_ONLY_ENV
    assert not unknown, f"not gasloc-node options: {sorted(unknown)}"


# ------------------------------------------------------------------------ images
def test_dockerfile_contract():
    text = (DOCKER / "Dockerfile").read_text()
    first_from = text.index("\nFROM ")
    assert re.search(r"^ARG BASE_IMAGE=gasloc-base:bookworm$", text[:first_from], re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}", text, re.M)
    assert re.search(r"^USER gasloc$", text, re.M), "the node must not run as root"
    assert re.search(r"^HEALTHCHECK .*CMD \[\"gasloc-container\", \"health\"\]", text,
                     re.M | re.S)
    assert 'ENTRYPOINT ["tini", "--", "gasloc-node"]' in text, "exec form behind an init"
    env = dockerfile_env(DOCKER / "Dockerfile")
    assert env["PIP_NO_INDEX"] == "1", "the image build installs from docker/wheels/ only"
    exposed = set(re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split())
    assert {env["GASLOC_PORT"], env["GASLOC_DHT_PORT"], env["GASLOC_METRICS_PORT"]} == exposed


def test_dockerignore_is_an_allowlist():
    lines = [ln for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln and not ln.startswith("#")]
    assert lines[0] == "*", "exclude everything, then allow what the image needs"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    assert allowed <= {"pyproject.toml", "README.md", "gasloc_p2p", "docker/wheels",
                       "docker/gasloc_container.py"}


def test_prometheus_scrapes_every_node_on_the_metrics_port():
    cfg = load_yaml(DOCKER / "prometheus.yml")
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    (sd,) = jobs["gasloc"]["dns_sd_configs"]
    assert set(sd["names"]) == {"bootstrap", "worker"} and sd["type"] == "A"
    assert str(sd["port"]) == dockerfile_env(DOCKER / "Dockerfile")["GASLOC_METRICS_PORT"]
    assert "COPY prometheus.yml /etc/prometheus/prometheus.yml" in \
        (DOCKER / "prometheus.Dockerfile").read_text()


def test_join_via_builds_bootstrap_multiaddrs():
    spec = importlib.util.spec_from_file_location("gasloc_container",
                                                  DOCKER / "gasloc_container.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.multiaddr("bootstrap", 31337, "12D3Koo") == "/dns4/bootstrap/tcp/31337/p2p/12D3Koo"
    assert mod.multiaddr("172.18.0.2", 1, "Qm") == "/ip4/172.18.0.2/tcp/1/p2p/Qm"
    assert mod.multiaddr("fd00::2", 1, "Qm") == "/ip6/fd00::2/tcp/1/p2p/Qm"


# ------------------------------------------------------------------------ grafana
def exported_names() -> set[str]:
    """Sample names a node's /metrics serves, from a real collector (the source of truth)."""
    from prometheus_client import CollectorRegistry, ProcessCollector

    from gasloc_p2p.node.observability.metrics import NodeCollector
    from gasloc_p2p.node.stats import ExchangeStats, TrainStats

    train = TrainStats(train_loss=3.0, val_loss=3.1)  # NaN gauges are left out of a scrape
    exchange = ExchangeStats(consensus=0.01)
    exchange.add_sent("int8", 1)
    exchange.add_received("int8", 1)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(train, exchange, lambda: None, {"version": "0"},
                                    lambda: 0.0))
    ProcessCollector(registry=registry)
    return {sample.name for family in registry.collect() for sample in family.samples}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (label matchers, strings, ranges, `by` removed)."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", bare)
    bare = re.sub(r"\b(?:by|without)\s*\([^)]*\)", "", bare)
    return set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare)) - PROMQL_WORDS


def test_metric_name_extraction():
    expr = ('histogram_quantile(0.95, sum by (le) (rate(gasloc_exchange_duration_seconds_bucket'
            '{job="gasloc", instance=~"$instance"}[2m]))) / sum(up{a="rate(x)"})')
    assert metric_names(expr) == {"gasloc_exchange_duration_seconds_bucket", "up"}


def dashboard_panels() -> list[dict]:
    panels = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # panels of collapsed rows
    return panels


def test_dashboard_panels_are_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    ds_uid = load_yaml(DATASOURCES)["datasources"][0]["uid"]
    panels = dashboard_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 10
    served = exported_names() | {"up"}  # `up`: Prometheus' own series per target
    for p in graphs:
        where = f"panel {p['id']} {p['title']!r}"
        assert p["datasource"] == {"type": "prometheus", "uid": ds_uid}, where
        pos = p["gridPos"]
        assert pos["w"] >= 1 and pos["h"] >= 1 and pos["x"] + pos["w"] <= 24, where
        assert p["targets"], f"{where} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), where
        for t in p["targets"]:
            assert t["expr"].strip(), where
            assert t.get("datasource", p["datasource"])["uid"] == ds_uid, where
            unknown = metric_names(t["expr"]) - served
            assert not unknown, f"{where}: no node serves {sorted(unknown)} ({t['expr']})"
            assert t["expr"].count("(") == t["expr"].count(")"), where


def test_dashboard_covers_the_issue_panels():
    used = set()
    for p in dashboard_panels():
        for t in p.get("targets", []):
            used |= metric_names(t["expr"])
    needed = {"gasloc_train_loss", "gasloc_val_loss", "gasloc_tokens_per_second",
              "gasloc_exchanges_total", "gasloc_sent_bytes_total", "gasloc_received_bytes_total",
              "gasloc_exchange_duration_seconds_bucket", "gasloc_exchange_staleness_rounds_bucket",
              "gasloc_peers_known", "gasloc_peers_reachable", "gasloc_consensus_estimate",
              "process_resident_memory_bytes", "gasloc_event_loop_lag_seconds",
              "gasloc_threads"}
    assert needed <= used, f"no panel shows {sorted(needed - used)}"


def test_grafana_provisioning_matches_compose_mounts():
    grafana = load_yaml(COMPOSE)["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"])
    assert mounts["./docker/grafana/provisioning"] == "/etc/grafana/provisioning"
    (provider,) = load_yaml(PROVIDERS)["providers"]
    assert provider["type"] == "file"
    assert mounts["./docker/grafana/dashboards"] == provider["options"]["path"]
    (source,) = load_yaml(DATASOURCES)["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"
