"""Shaped links (benchmarks/tools/netns.py): real namespaces, veths, a bridge and tc tbf; root only."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from benchmarks.tools import netns
from benchmarks.tools.netns import ShapedNetwork, netns_unavailable

pytestmark = pytest.mark.skipif(netns_unavailable() is not None,
                                reason=netns_unavailable() or "")

_SINK = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); print("ready", flush=True)
c, _ = s.accept(); n = 0
while True:
    d = c.recv(1 << 16)
    if not d:
        break
    n += len(d)
print(n, flush=True)
"""

_SEND = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
s.sendall(b"x" * int(sys.argv[3])); s.close()
"""


def _names() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout + \
        subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout


def _send(net: ShapedNetwork, src: int, dst: int, nbytes: int) -> float:
    """Seconds to move ``nbytes`` from host ``src`` to host ``dst`` over TCP (after connect)."""
    a, b = net.hosts[dst], net.hosts[src]
    sink = subprocess.Popen(a.cmd([sys.executable, "-c", _SINK, a.addr, "5601"]),
                            stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        subprocess.run(b.cmd([sys.executable, "-c", _SEND, a.addr, "5601", str(nbytes)]),
                       check=True, timeout=60)
        received = int(sink.stdout.readline())
        elapsed = time.monotonic() - t0
        assert received == nbytes
        return elapsed
    finally:
        sink.kill()
        sink.wait()


def test_egress_is_shaped_and_counted() -> None:
    nbytes = 2_500_000  # 2 s at 10 Mbit/s
    with ShapedNetwork([None, 10.0]) as net:
        tx0 = net.hosts[1].tx_bytes()
        shaped = _send(net, src=1, dst=0, nbytes=nbytes)
        sent = net.hosts[1].tx_bytes() - tx0
        fast = _send(net, src=0, dst=1, nbytes=nbytes)
        assert "tbf" in net.hosts[1].qdisc_stats()
    # The shaper cannot make a transfer faster than its rate (python start-up is outside t0..).
    assert shaped >= 0.85 * nbytes * 8 / 10e6, shaped
    assert fast < shaped / 2, (fast, shaped)
    # Kernel counters see the payload plus TCP/IP/Ethernet headers (about 3-5 %).
    assert nbytes <= sent <= 1.10 * nbytes


def test_a_host_reshaped_later_keeps_one_destination_unshaped() -> None:
    """``Host.shape(rate, unshaped_to=...)``: peers get the rate, the named address (a bench's
    Info calls) does not; ``shape(None)`` removes the shaper."""
    nbytes = 1_000_000  # 1.6 s at 5 Mbit/s
    with ShapedNetwork([None, None, None]) as net:
        net.hosts[1].shape(5.0, unshaped_to=net.hosts[2].addr)
        assert "htb" in net.hosts[1].qdisc_stats()
        shaped = _send(net, src=1, dst=0, nbytes=nbytes)
        free = _send(net, src=1, dst=2, nbytes=nbytes)
        net.hosts[1].shape(None)
        assert "htb" not in net.hosts[1].qdisc_stats()
        again = _send(net, src=1, dst=0, nbytes=nbytes)
    assert shaped >= 0.85 * nbytes * 8 / 5e6, shaped
    assert free < shaped / 2 and again < shaped / 2, (free, again, shaped)


def test_root_namespace_reaches_hosts_through_the_gateway() -> None:
    with ShapedNetwork([None, None]) as net:
        host = net.hosts[1]
        sink = subprocess.Popen(host.cmd([sys.executable, "-c", _SINK, host.addr, "5602"]),
                                stdout=subprocess.PIPE, text=True)
        try:
            assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
            with socket.create_connection((host.addr, 5602), timeout=10) as conn:
                conn.sendall(b"hello")
            assert int(sink.stdout.readline()) == 5
        finally:
            sink.kill()
            sink.wait()
        assert net.gateway.rsplit(".", 1)[0] == host.addr.rsplit(".", 1)[0]


def test_everything_is_deleted_also_after_an_exception() -> None:
    with pytest.raises(RuntimeError, match="boom"), ShapedNetwork([5.0, None, 1.0]) as net:
        names = [h.ns for h in net.hosts] + [net.bridge]
        assert all(name in _names() for name in names)
        raise RuntimeError("boom")
    left = _names()
    assert not [name for name in names if name in left]
    net.close()  # a second close is harmless


def test_stale_namespaces_of_dead_owners_are_swept() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"{netns.PREFIX}{netns._b36(dead.pid)}-hx.0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert netns.sweep_stale() >= 1
        assert stale not in _names()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


def test_bad_rates_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        ShapedNetwork([0.0])
    with pytest.raises(ValueError, match="hosts"):
        ShapedNetwork([])
