"""Shaped links for benchmarks and soak tests: one network namespace per node, joined by a bridge.

Each host is a namespace with a veth pair: one end (``eth0``) inside the namespace with the
host's address, the other end on a bridge in the root namespace, which also holds the gateway
address (so the root namespace reaches every host, for example to scrape metrics). A host's
egress is shaped with ``tc tbf`` on its ``eth0``: what it sends leaves at most at its rate.
This kernel has no ``netem``, so there is no delay or jitter qdisc.

Names carry this process's pid, so :func:`sweep_stale` can delete what a killed run left
behind (namespaces and bridges whose pid is gone). Closing is idempotent and runs on
``__exit__`` also after an exception. Needs root, ``ip`` and ``tc`` (iproute2).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gasloc_p2p.node.discovery.dht import process_alive

log = logging.getLogger(__name__)

PREFIX = "gln"  # every namespace, bridge and veth name: PREFIX, the owner's pid in base 36, "-"
_NAME = re.compile(rf"^{PREFIX}([0-9a-z]+)-")
_COMMAND_TIMEOUT_S = 10.0


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message has the command and its stderr."""


def netns_unavailable() -> str | None:
    """None when namespaces can be made here, else a one-line reason (for ``pytest.skip``)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) is not installed"
    return None


def _run(argv: Sequence[str], check: bool = True) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def _free_subnet(start: int) -> int:
    """A third octet ``S`` such that no local address is in 10.213.S.0/24 yet."""
    used = set(re.findall(r"inet 10\.213\.(\d+)\.", _run(["ip", "-o", "-4", "addr", "show"])))
    for k in range(250):
        candidate = (start + k - 1) % 250 + 1
        if str(candidate) not in used:
            return candidate
    raise NetnsError("no free 10.213.x.0/24 subnet: 250 shaped networks exist")


def sweep_stale() -> int:
    """Delete namespaces and bridges left by dead processes; returns how many were deleted."""
    deleted = 0
    names = [line.split()[0] for line in _run(["ip", "netns", "list"], check=False).splitlines()
             if line.strip()]
    links = [p.name for p in Path("/sys/class/net").iterdir()] if Path("/sys/class/net").exists() else []
    for name in names + links:
        m = _NAME.match(name)
        if m is None or process_alive(int(m.group(1), 36)):
            continue
        if name in names:
            _run(["ip", "netns", "del", name], check=False)
        else:
            _run(["ip", "link", "del", name], check=False)
        deleted += 1
    return deleted


@dataclass
class Host:
    """One node's namespace: bind its ports to ``addr``; start its processes with :meth:`cmd`."""

    ns: str
    addr: str
    rate_mbit: float | None
    dev: str = "eth0"

    def cmd(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def _counter(self, name: str) -> int:
        path = f"/sys/class/net/{self.dev}/statistics/{name}"
        return int(_run(self.cmd(["cat", path])).strip())

    def tx_bytes(self) -> int:
        """Bytes this host has sent on its link (kernel counter, Ethernet frames)."""
        return self._counter("tx_bytes")

    def rx_bytes(self) -> int:
        """Bytes this host has received on its link (kernel counter, Ethernet frames)."""
        return self._counter("rx_bytes")

    def qdisc_stats(self) -> str:
        """``tc -s qdisc`` of the host's link: sent bytes, drops and overlimits of the shaper."""
        return _run(self.cmd(["tc", "-s", "qdisc", "show", "dev", self.dev]))

    def shape(self, rate_mbit: float | None, unshaped_to: str = "") -> None:
        """Shape this host's egress to ``rate_mbit`` from now on (None: remove the shaper),
        tbf as at the start; with ``unshaped_to`` (an address, e.g. the gateway a benchmark
        reads every node's Info from) HTB instead, with one unshaped class for what goes
        there: on a 50 kbit/s link an Info reply queued behind a 2.5 MB payload waits
        minutes. ARP is never shaped (it is the LAN's, not the uplink's): queued behind a
        payload, a host's ARP request for the bench's address held its replies for 20 s and
        the bench's Info calls timed out."""
        subprocess.run(self.cmd(["tc", "qdisc", "del", "dev", self.dev, "root"]),
                       capture_output=True, check=False)
        if rate_mbit is None:
            return
        if not unshaped_to:
            _run(self.cmd(["tc", "qdisc", "add", "dev", self.dev, "root", "tbf", "rate",
                           f"{rate_mbit}mbit", "burst", str(_burst(rate_mbit)), "latency",
                           "100ms"]))
            return
        burst = str(_burst(rate_mbit))
        for argv in (["qdisc", "add", "dev", self.dev, "root", "handle", "1:", "htb", "default",
                      "20"],
                     ["class", "add", "dev", self.dev, "parent", "1:", "classid", "1:10", "htb",
                      "rate", "1000mbit"],
                     ["class", "add", "dev", self.dev, "parent", "1:", "classid", "1:20", "htb",
                      "rate", f"{rate_mbit}mbit", "ceil", f"{rate_mbit}mbit", "burst", burst,
                      "cburst", burst],
                     ["filter", "add", "dev", self.dev, "parent", "1:", "protocol", "ip", "prio",
                      "1", "u32", "match", "ip", "dst", f"{unshaped_to}/32", "flowid", "1:10"],
                     ["filter", "add", "dev", self.dev, "parent", "1:", "protocol", "arp",
                      "prio", "2", "u32", "match", "u32", "0", "0", "flowid", "1:10"]):
            _run(self.cmd(["tc", *argv]))


class ShapedNetwork:
    """``len(rates_mbit)`` hosts on one bridge; ``rates_mbit[i]`` shapes host i's egress (None: unshaped).

    Addresses are ``10.213.S.i+2/24`` with ``S`` derived from the pid and a counter, so two
    networks in one machine do not collide; the root namespace is ``10.213.S.1`` (:attr:`gateway`).
    """

    _count = 0

    def __init__(self, rates_mbit: Sequence[float | None], burst_bytes: int | None = None) -> None:
        reason = netns_unavailable()
        if reason is not None:
            raise NetnsError(reason)
        if not 1 <= len(rates_mbit) <= 200:
            raise ValueError("ShapedNetwork: between 1 and 200 hosts")
        for rate in rates_mbit:
            if rate is not None and not rate > 0:
                raise ValueError(f"ShapedNetwork: rate {rate!r} Mbit/s must be positive or None")
        ShapedNetwork._count += 1
        pid = os.getpid()
        # Interface names are at most 15 bytes: "gln" + pid (<= 5 base-36 digits) + "-b" + count.
        self._tag = f"{PREFIX}{_b36(pid)}-"
        count = _b36(ShapedNetwork._count % 1296)
        subnet = _free_subnet((pid * 7 + ShapedNetwork._count) % 250 + 1)
        self.bridge = f"{self._tag}b{count}"
        self._veth = f"{self._tag}v{count}."
        self.gateway = f"10.213.{subnet}.1"
        self.hosts = [Host(ns=f"{self._tag}h{count}.{i}", addr=f"10.213.{subnet}.{i + 2}",
                           rate_mbit=rate) for i, rate in enumerate(rates_mbit)]
        self._burst = burst_bytes
        self._closed = False
        sweep_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        self._allow_forwarding(True)
        for i, host in enumerate(self.hosts):
            outer = f"{self._veth}{_b36(i)}"
            _run(["ip", "netns", "add", host.ns])
            _run(["ip", "link", "add", outer, "type", "veth", "peer", "name", host.dev,
                  "netns", host.ns])
            _run(["ip", "link", "set", outer, "master", self.bridge])
            _run(["ip", "link", "set", outer, "up"])
            _run(host.cmd(["ip", "addr", "add", f"{host.addr}/24", "dev", host.dev]))
            _run(host.cmd(["ip", "link", "set", host.dev, "up"]))
            _run(host.cmd(["ip", "link", "set", "lo", "up"]))
            if host.rate_mbit is not None:
                self._shape(host)
        log.info("shaped network %s: %s", self.bridge,
                 ", ".join(f"{h.addr}@{h.rate_mbit or 'unshaped'}" for h in self.hosts))

    def _shape(self, host: Host) -> None:
        _shape(host, self._burst)

    def _allow_forwarding(self, allow: bool) -> None:
        # With br_netfilter loaded, bridged frames pass iptables' FORWARD chain, which a Docker
        # engine sets to DROP: accept this bridge's traffic explicitly while it exists.
        if shutil.which("iptables") is None:
            return
        rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        _run(["iptables", "-I" if allow else "-D", *rule], check=False)

    def close(self) -> None:
        """Delete the namespaces (their veths go with them) and the bridge; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts:
            _run(["ip", "netns", "del", host.ns], check=False)
        _run(["ip", "link", "del", self.bridge], check=False)
        self._allow_forwarding(False)

    def __enter__(self) -> ShapedNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _free_net16(start: int) -> int:
    """A second octet ``N`` in 100-199 such that no local address is in 10.N.0.0/16 yet."""
    used = set(re.findall(r"inet 10\.(\d+)\.", _run(["ip", "-o", "-4", "addr", "show"])))
    for k in range(100):
        candidate = 100 + (start + k) % 100
        if str(candidate) not in used:
            return candidate
    raise NetnsError("no free 10.N.0.0/16 (N in 100-199) for a NAT network")


def nat_unavailable() -> str | None:
    """None when home routers (namespaces doing NAT) can be made here, else a one-line reason."""
    reason = netns_unavailable()
    if reason is None and shutil.which("iptables") is None:
        reason = "'iptables' is not installed (apt-get install -y iptables)"
    return reason


class NatNetwork:
    """The internet and homes behind routers, in namespaces.

    ``public[i]`` shapes public host i on a bridge in the root namespace (``10.N.0.i+2/16``,
    reachable from the root namespace through :attr:`gateway`). ``homes[h]`` lists the rates of
    home h's hosts: they sit on a LAN (``192.168.h+1.i+2``) behind a router namespace whose
    WAN end is on the public bridge (``10.N.h+1.2/16``: each home in its own /24, as homes on
    the internet are in distinct address blocks) and which translates their addresses
    (iptables MASQUERADE; nothing is forwarded inward, so nobody outside can dial them). A home
    in ``symmetric`` maps every connection to a random port (``--random``), the mapping that
    defeats hole punching. Names carry the pid, as :class:`ShapedNetwork`'s do.
    """

    _count = 0

    def __init__(self, public: Sequence[float | None], homes: Sequence[Sequence[float | None]],
                 symmetric: Sequence[int] = (), congestion: str | None = None) -> None:
        reason = nat_unavailable()
        if reason is not None:
            raise NetnsError(reason)
        if not public or not 1 <= len(homes) <= 9 or any(not 1 <= len(h) <= 9 for h in homes):
            raise ValueError("NatNetwork: at least one public host; 1-9 homes of 1-9 hosts")
        NatNetwork._count += 1
        self._tag = f"{PREFIX}{_b36(os.getpid())}-"
        count = _b36(NatNetwork._count % 36)
        net = _free_net16((os.getpid() * 11 + NatNetwork._count) % 100)
        self.bridge = f"{self._tag}n{count}"
        self.gateway = f"10.{net}.0.1"
        self._veth = f"{self._tag}{count}"
        self.public = [Host(ns=f"{self._tag}p{count}.{i}", addr=f"10.{net}.0.{i + 2}",
                            rate_mbit=rate) for i, rate in enumerate(public)]
        self.routers = [f"{self._tag}r{count}.{h}" for h in range(len(homes))]
        self.wan = [f"10.{net}.{h + 1}.2" for h in range(len(homes))]
        self.homes = [[Host(ns=f"{self._tag}h{count}.{h}{i}", addr=f"192.168.{h + 1}.{i + 2}",
                            rate_mbit=rate) for i, rate in enumerate(rates)]
                      for h, rates in enumerate(homes)]
        self.symmetric = set(symmetric)
        self.congestion = congestion
        self._closed = False
        sweep_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.gateway}/16", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        _run(["iptables", "-I", "FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"],
             check=False)
        for i, host in enumerate(self.public):
            self._attach(host.ns, f"{self._veth}p{i}", "eth0", f"{host.addr}/16")
            _shape(host)
            _congestion(host, self.congestion)
        for h, (router, wan) in enumerate(zip(self.routers, self.wan, strict=True)):
            self._attach(router, f"{self._veth}w{h}", "wan", f"{wan}/16")
            inside = ["ip", "netns", "exec", router]
            _run([*inside, "ip", "link", "add", "lan", "type", "bridge"])
            _run([*inside, "ip", "addr", "add", f"192.168.{h + 1}.1/24", "dev", "lan"])
            _run([*inside, "ip", "link", "set", "lan", "up"])
            _run([*inside, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
            nat = ["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"]
            _run([*inside, *nat, *(["--random"] if h in self.symmetric else [])])
            _run([*inside, "iptables", "-A", "FORWARD", "-i", "wan", "-m", "conntrack",
                  "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"])
            _run([*inside, "iptables", "-A", "FORWARD", "-i", "wan", "-j", "DROP"])
            # unsolicited packets to the router itself are dropped, not answered (no RST): a
            # consumer router's default, and what lets a hole punch's first SYN wait there
            _run([*inside, "iptables", "-A", "INPUT", "-i", "wan", "-m", "conntrack",
                  "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"])
            _run([*inside, "iptables", "-A", "INPUT", "-i", "wan", "-j", "DROP"])
            for i, host in enumerate(self.homes[h]):
                outer = f"{self._veth}l{h}{i}"
                _run(["ip", "netns", "add", host.ns])
                _run(["ip", "link", "add", outer, "type", "veth", "peer", "name", host.dev,
                      "netns", host.ns])
                _run(["ip", "link", "set", outer, "netns", router])
                _run([*inside, "ip", "link", "set", outer, "master", "lan", "up"])
                _run(host.cmd(["ip", "addr", "add", f"{host.addr}/24", "dev", host.dev]))
                _run(host.cmd(["ip", "link", "set", host.dev, "up"]))
                _run(host.cmd(["ip", "link", "set", "lo", "up"]))
                _run(host.cmd(["ip", "route", "add", "default", "via", f"192.168.{h + 1}.1"]))
                _shape(host)
                _congestion(host, self.congestion)
        log.info("NAT network %s: public %s; homes %s", self.bridge,
                 ", ".join(h.addr for h in self.public),
                 "; ".join(f"{wan} ({'symmetric' if h in self.symmetric else 'cone'}): "
                           + ", ".join(x.addr for x in hosts)
                           for h, (wan, hosts) in enumerate(zip(self.wan, self.homes, strict=True))))

    def _attach(self, ns: str, outer: str, inner: str, addr: str) -> None:
        """A new namespace ``ns`` whose ``inner`` interface (``addr``) is on the bridge."""
        _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns])
        _run(["ip", "link", "set", outer, "master", self.bridge])
        _run(["ip", "link", "set", outer, "up"])
        _run(["ip", "netns", "exec", ns, "ip", "addr", "add", addr, "dev", inner])
        _run(["ip", "netns", "exec", ns, "ip", "link", "set", inner, "up"])
        _run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"])

    def close(self) -> None:
        """Delete every namespace (their veths go with them) and the bridge; safe twice."""
        if self._closed:
            return
        self._closed = True
        for ns in [h.ns for h in self.public] + [h.ns for hs in self.homes for h in hs] + \
                self.routers:
            _run(["ip", "netns", "del", ns], check=False)
        _run(["ip", "link", "del", self.bridge], check=False)
        _run(["iptables", "-D", "FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"],
             check=False)

    def __enter__(self) -> NatNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _shape(host: Host, burst_bytes: int | None = None) -> None:
    """Shape ``host``'s egress to its rate with tc tbf (nothing when it has none)."""
    if host.rate_mbit is None:
        return
    rate = float(host.rate_mbit)
    burst = burst_bytes or _burst(rate)
    _run(host.cmd(["tc", "qdisc", "add", "dev", host.dev, "root", "tbf", "rate", f"{rate}mbit",
                   "burst", str(burst), "latency", "100ms"]))


def _congestion(host: Host, algorithm: str | None) -> None:
    """TCP congestion control ``algorithm`` for what ``host`` sends (every route of its main
    table, ``congctl``: a namespace's own sysctl may be read-only); None: the system's."""
    if algorithm is None:
        return
    for route in _run(host.cmd(["ip", "-o", "route", "show"])).splitlines():
        words = route.split()
        if "congctl" in words:
            continue
        _run(host.cmd(["ip", "route", "change", *words, "congctl", algorithm]))


def _burst(rate_mbit: float) -> int:
    """A shaper's burst: at least one MTU-sized packet, about 5 ms of traffic at the rate (tbf
    needs burst >= rate / HZ to reach the rate at all on a kernel with a 250 Hz timer)."""
    return max(16_000, int(rate_mbit * 1e6 / 8 / 200))
