"""An on-path proxy between two nodes: with TLS it reads nothing and changes nothing.

The proxy forwards the TCP bytes of a real exchange (the initiator dials the proxy, trusting the
responder's certificate from its record). Passing bytes through, the exchange commits and the
captured bytes hold neither the run id nor any run of the payload. Changing bytes (as the proxy
of the issue did: it rewrote 6.6 KB of a payload and kept its CRC32), the exchange fails and
neither side applies anything: 0 of 10 tampered exchanges committed.
"""

from __future__ import annotations

from benchmarks.tools.proxy import Proxy
from tests.node_helpers import (
    RUN,
    assert_same_state,
    full_state,
    make_peer,
    run,
    scaled,
    settle,
)


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
