"""A real Prometheus (Debian's binary) scrapes two real node processes; queries go through its
HTTP API. Skipped when the binary is missing (CI installs it: apt-get install -y prometheus)."""

from __future__ import annotations

import pytest

from gasloc_p2p.tools.prometheus import INSTALL_HINT, find_prometheus, query, query_range
from tests.swarm_helpers import live_swarm, wait_for

pytestmark = pytest.mark.skipif(find_prometheus() is None,
                                reason=f"no 'prometheus' binary: {INSTALL_HINT}")


def by_node(url: str, promql: str) -> dict[str, float]:
    return {s["metric"]["node"]: float(s["value"][1]) for s in query(url, promql)}


def test_prometheus_scrapes_two_nodes(tmp_path):
    with live_swarm(tmp_path, nodes=2) as swarm:
        assert swarm.prometheus is not None
        url = swarm.prometheus.url
        both = {"node0", "node1"}

        def up_and_training() -> bool:
            up = by_node(url, "up")
            steps = by_node(url, "gasloc_train_steps_total")
            return (set(up) == both and all(v == 1 for v in up.values())
                    and set(steps) == both and all(v > 0 for v in steps.values()))

        wait_for(up_and_training, 60, "both nodes up and training in Prometheus")
        def committed() -> float:
            return sum(by_node(url, 'gasloc_exchanges_total{outcome="ok"}').values())

        first = committed()
        wait_for(lambda: committed() > first, 60, "the exchange counter to move")
        sent = by_node(url, "sum by (node) (gasloc_sent_bytes_total)")
        assert set(sent) == both and all(v > 0 for v in sent.values())
        roles = query(url, "sum by (role) (gasloc_exchanges_by_role_total)")
        assert {s["metric"]["role"] for s in roles} == {"initiator", "responder"}
        info = query(url, "gasloc_info")
        assert {s["metric"]["algorithm"] for s in info} == {"gasloc"}
        assert len(by_node(url, "process_resident_memory_bytes")) == 2
        def val_loss_history() -> bool:
            end = server_time(url)
            series = query_range(url, "gasloc_val_loss", end - 120, end, 1)
            return ({s["metric"]["node"] for s in series} == both
                    and all(len(s["values"]) >= 3 for s in series))

        wait_for(val_loss_history, 30, "a val loss history of both nodes (query_range)")

def server_time(url: str) -> float:
    """Prometheus' clock: the timestamp of an instant query's sample."""
    return float(query(url, "vector(time())")[0]["value"][0])
