"""Hole punching's parts on loopback (circuits/punch.py): two bound ports dialing each other
form one connection; the loopback end a channel runs over; what a target spends on callers'
punches, against a member that asks as often as it can. The whole path between nodes is in
tests/test_node_daemon.py (loopback) and tests/test_nat.py (routers doing NAT)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from gasloc_p2p.node.transport.circuits import punch
from gasloc_p2p.node.transport.circuits.punch import (
    Observation,
    Puncher,
    SocketEnd,
    bound_socket,
    meet,
    parse_endpoint,
    pick,
)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_only_ipv4_endpoints_of_bounded_length_are_taken():
    assert parse_endpoint("10.1.2.3:4567") == ("10.1.2.3", 4567)
    for bad in ("", "10.1.2.3", "10.1.2.3:0", "10.1.2.3:65536", "10.1.2.3:-1", "host:80",
                "[::1]:80", "::1:80", "10.1.2.3:80x", "1" * 60 + ".1.1.1:80", "10.1.2.3 :80"):
        assert parse_endpoint(bad) is None, bad


def test_nodes_behind_one_router_dial_each_others_local_address():
    # the same observed host: behind one router, whose mapping few routers carry back inside
    assert pick("10.0.1.2:4000", "10.0.1.2:5000", "192.168.1.3:5000") == ("192.168.1.3", 5000)
    assert pick("10.0.1.2:4000", "10.0.2.2:5000", "192.168.1.3:5000") == ("10.0.2.2", 5000)
    assert pick("10.0.1.2:4000", "10.0.1.2:5000", "") == ("10.0.1.2", 5000)
    assert pick("10.0.1.2:4000", "junk", "192.168.1.3:5000") is None


def test_two_ports_dialing_each_other_at_once_form_one_connection():
    async def main():
        a, b = bound_socket(), bound_socket()
        pa, pb = a.getsockname()[1], b.getsockname()[1]
        try:
            # b starts a second later: its port's listener or its dial meets a's dials
            first = asyncio.ensure_future(meet(pa, ("127.0.0.1", pb), 10))
            await asyncio.sleep(1.0)
            x, y = await asyncio.gather(first, meet(pb, ("127.0.0.1", pa), 10))
        finally:
            a.close()
            b.close()
        assert x.getpeername() == ("127.0.0.1", pb) and y.getpeername() == ("127.0.0.1", pa)
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(x, b"over the punched connection")
        assert await loop.sock_recv(y, 100) == b"over the punched connection"
        x.close()
        y.close()

    run(main())


def test_a_punch_nobody_answers_ends_at_its_deadline_and_accepts_no_stranger():
    async def main():
        holder = bound_socket()
        port = holder.getsockname()[1]
        silent = socket.create_server(("127.0.0.1", 0))  # accepts, never the agreed peer
        task = asyncio.ensure_future(meet(port, ("127.0.0.9", 9), 1.5))
        await asyncio.sleep(0.3)
        # a stranger connecting to the punch's port is closed, not taken
        stranger = socket.create_connection(("127.0.0.1", port), timeout=2)
        with pytest.raises(TimeoutError):
            await task
        stranger.settimeout(2)
        assert stranger.recv(10) == b""
        for s in (holder, silent, stranger):
            s.close()

    run(main())


def test_a_socket_end_pipes_its_first_connection_and_refuses_the_next():
    async def main():
        near, far = socket.socketpair()
        near.setblocking(False)
        closed = []
        end = SocketEnd(near, lambda: closed.append(True))
        host, port = (await end.start()).split(":")
        r, w = await asyncio.open_connection(host, int(port))
        w.write(b"ping")
        await w.drain()
        far.settimeout(5)
        assert await asyncio.to_thread(far.recv, 10) == b"ping"
        far.sendall(b"pong")
        assert await asyncio.wait_for(r.read(10), 5) == b"pong"
        with pytest.raises(OSError):  # the endpoint listened for one connection only
            await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5)
        far.close()  # the far side ends: the near side sees its end, the end is reported
        assert await asyncio.wait_for(r.read(10), 5) == b""
        await asyncio.sleep(0.1)
        assert closed == [True]
        w.close()

    run(main())


class _Peer:
    def __init__(self, peer_id: str, endpoint: str) -> None:
        self.peer_id, self.endpoint, self.cert = peer_id, endpoint, b""
        self.reachable, self.relayed, self.relays = True, False, ()


def test_a_target_answers_few_punches_however_often_a_member_asks(monkeypatch):
    """The attack: one member (any number of keys) asks a node behind a router for hole
    punches to addresses of its choice as fast as it can, to make the node dial them. The
    node answers at most MAX_ANSWERING at once and ANSWER_BURST, then ANSWERS_PER_S; each
    answer dials one address for punch_s; refused ones cost nothing (no observation)."""
    observed = []

    async def fake_observe(cls, observer, port, timeout_s):
        observed.append(port)
        obs = Observation()
        obs.address = f"10.0.0.1:{port}"
        return obs

    monkeypatch.setattr(Observation, "at", classmethod(fake_observe))
    taken = []

    async def main():
        puncher = Puncher(signer=None, relayed_stub=None,  # type: ignore[arg-type]
                          observers=lambda: [_Peer("observer", "10.0.0.2:7000")],
                          public_host=lambda: "", take=lambda *a: taken.append(a),
                          on_up=lambda *a: None, on_lost=lambda *a: None, timeout_s=1.0,
                          punch_s=0.5)
        answers = [await puncher.answer(f"127.0.0.9:{1000 + i}") for i in range(50)]
        assert sum(bool(a[0]) for a in answers) == punch.MAX_ANSWERING
        assert len(observed) == punch.MAX_ANSWERING
        assert await puncher.answer("not an address") == ("", "")
        await asyncio.sleep(0.8)  # the answers' dials end unmet (nobody at 127.0.0.9)
        more = [await puncher.answer(f"127.0.0.9:{2000 + i}") for i in range(50)]
        # the bucket: its burst, less what the first ones spent, plus about a second's refill
        assert 1 <= sum(bool(a[0]) for a in more) <= punch.MAX_ANSWERING
        assert taken == []
        await puncher.close()

    run(main())
