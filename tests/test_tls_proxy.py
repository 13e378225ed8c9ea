"""An on-path proxy between two nodes: with TLS it reads nothing and changes nothing.

The proxy forwards the TCP bytes of a real exchange (the initiator dials the proxy, trusting the
responder's certificate from its record). Passing bytes through, the exchange commits and the
captured bytes hold neither the run id nor any run of the payload. Changing bytes (as the proxy
of the issue did: it rewrote 6.6 KB of a payload and kept its CRC32), the exchange fails and
neither side applies anything: 0 of 10 tampered exchanges committed.
"""

from __future__ import annotations

import asyncio

from tests.node_helpers import (
    RUN,
    assert_same_state,
    full_state,
    make_peer,
    run,
    scaled,
    settle,
)


class Proxy:
    """A TCP relay to ``target`` (host, port) that records both directions and, from
    ``tamper_after`` bytes of the responder's stream on, flips one byte in every 4 KiB."""

    def __init__(self, target: tuple[str, int], tamper_after: int = -1) -> None:
        self.target, self.tamper_after = target, tamper_after
        self.seen = bytearray()
        self.flipped = 0
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(*self.target)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, down: bool) -> None:
            passed = 0
            try:
                while data := await src.read(65536):
                    self.seen += data
                    if down and self.tamper_after >= 0:
                        data = self._tamper(bytearray(data), passed)
                    passed += len(data)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_w, False), pump(up_r, writer, True))

    def _tamper(self, data: bytearray, offset: int) -> bytes:
        for i in range(len(data)):
            if offset + i >= self.tamper_after and (offset + i) % 4096 == 0:
                data[i] ^= 0x5A
                self.flipped += 1
        return bytes(data)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


def test_an_on_path_proxy_reads_nothing_and_its_changes_are_never_committed():
    async def main():
        a, b = await make_peer("A", 1), await make_peer("B", 2)
        host, port = b.endpoint.rsplit(":", 1)
        honest, evil = Proxy((host, int(port))), Proxy((host, int(port)), tamper_after=8_000)
        try:
            for proxy, tampered in ((honest, False), (evil, True)):
                endpoint = await proxy.start()

                def via_proxy(endpoint=endpoint):
                    return a.channels.stub(endpoint, b.cert).Exchange(timeout=scaled(20))

                before_a, before_b = full_state(a), full_state(b)
                results = [await settle(a.exchanger.initiate(via_proxy, b.me.peer_id, 0))
                           for _ in range(1 if not tampered else 10)]
                if not tampered:
                    assert not isinstance(results[0], BaseException), results[0]
                    payload = bytes(b.engine.prepare(a.me.peer_id, 0,
                                                     b.exchanger.rules.codec).payload)
                    assert len(proxy.seen) > 2 * len(payload)  # both payloads crossed it...
                    assert RUN.encode() not in proxy.seen  # ...encrypted: no header field
                    assert payload[:32] not in proxy.seen
                else:
                    assert proxy.flipped > 0
                    assert all(isinstance(r, BaseException) for r in results), results
                    assert_same_state(before_a, full_state(a))
                    assert_same_state(before_b, full_state(b))
                a.channels.discard(endpoint, b.cert)
            assert a.exchanger.stats.ok_initiator == 1  # the honest relay's exchange only
        finally:
            for proxy in (honest, evil):
                await proxy.close()
            await a.close()
            await b.close()

    run(main(), timeout_s=120)
