"""Nodes behind home routers, for real: namespaces with routers doing NAT (iptables
MASQUERADE, nothing forwarded, unsolicited packets dropped; the second router maps to random
ports, a symmetric NAT), real node processes joined with the reachable node's join line, two
with ``--client-mode``, one without (it learns from failed dial-backs). The two nodes behind
the ordinary routers must exchange over a hole-punched connection; the node behind the
symmetric one, whose mapping defeats hole punching, through the reachable node's relay.
Root, iproute2 and iptables (.ci/run installs it); skipped otherwise."""

from __future__ import annotations

import subprocess
import time

import pytest

from benchmarks.bench_nat import FLAGS, read, start
from benchmarks.tools.netns import NatNetwork, nat_unavailable
from tests.node_helpers import KNOB, scaled

pytestmark = pytest.mark.skipif(nat_unavailable() is not None, reason=nat_unavailable() or "")


def test_nodes_behind_routers_exchange_hole_punched_or_through_a_relay(tmp_path) -> None:
    nodes = []
    with NatNetwork([None], [[None], [None], [None]], symmetric=[1], congestion="cubic") as net:
        tag = net.bridge[:-2]
        for host in (net.public[0], net.homes[0][0]):  # the bench's congestion control
            routes = subprocess.run(host.cmd(["ip", "-o", "route"]), capture_output=True,
                                    text=True, check=True).stdout.splitlines()
            assert routes and all("congctl cubic" in r for r in routes), routes
        try:
            public = start("public", net.public[0], tmp_path,
                           [*FLAGS, "--host", net.public[0].addr])
            nodes.append(public)
            peers = public.child.wait_for(r"--peers (\S+)", scaled(120)).group(1)
            # home0 and home2 say they are behind routers; home1 does not, and learns it from
            # dial-backs
            nodes.append(start("home0", net.homes[0][0], tmp_path,
                               [*FLAGS, "--client-mode", "--peers", peers]))
            nodes.append(start("home1", net.homes[1][0], tmp_path, [*FLAGS, "--peers", peers],
                               {"GASLOC_REACHABILITY_INTERVAL_S": "10"}))
            nodes.append(start("home2", net.homes[2][0], tmp_path,
                               [*FLAGS, "--client-mode", "--peers", peers]))
            deadline = time.monotonic() + scaled(240)
            while True:
                for n in nodes:
                    read(n)
                ids = {n.peer_id[:12]: n.name for n in nodes if n.peer_id}
                paths = {(n.name, ids.get(to), path) for n in nodes
                         for _, to, path, _ in n.sent}
                punched = {(a, b) for a, b, path in paths if path == "holepunched"}
                relayed = {(a, b) for a, b, path in paths if path == "relayed"}
                if ({("home0", "home2"), ("home2", "home0")} & punched
                        and {("home0", "home1"), ("home1", "home0")} <= relayed):
                    break
                assert time.monotonic() < deadline, (
                    f"no hole-punched exchange between home0 and home2 or no relayed one "
                    f"between home0 and home1 ({KNOB}); hole-punched: {punched}; relayed: "
                    f"{relayed}; home0: {nodes[1].child.tail(1500)}")
                time.sleep(1.0)
            # nothing punched through the symmetric router
            assert not {p for p in punched if "home1" in p}, punched
        finally:
            for n in nodes:
                n.child.stop(30.0)
    # nothing of the network is left behind
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert tag not in left


def test_an_exchange_is_timed_alone_only_when_no_other_shared_a_shaped_uplink() -> None:
    """bench_nat's split of exchange times: an exchange overlapping another on a home's
    (shaped) uplink shares it; overlapping on the reachable node's unshaped uplink does not."""
    from benchmarks.bench_nat import sharing

    homes = {"h0", "h1", "h2"}
    exchanges = [("h0", "pub", 10.0, 7.0),   # [3, 10]
                 ("h1", "h0", 15.0, 14.0),   # [1, 15]: overlaps the first on h0
                 ("pub", "h2", 9.0, 7.0),    # [2, 9]: overlaps both in time, shares only pub
                 ("h2", "pub", 30.0, 7.0)]   # [23, 30]: alone
    assert sharing(exchanges, homes) == [1, 1, 0, 0]
    assert sharing(exchanges, homes | {"pub"}) == [2, 1, 1, 0]
