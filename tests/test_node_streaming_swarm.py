"""Three real ``gasloc-node join --algorithm streaming-diloco --fragments 4 --tau 5
--diloco-codec fp4`` processes on 127.0.0.1 (the issue's "Done when" command).

Four layers and ``--fragments 4`` make five fragments (layers 0-3 and the non-layer tensors)
syncing at offsets 0, 2, 4, 6 and 8 of every 10 steps, each all-reduce overlapped with
``--tau 5`` steps (syncs queue on the one shared averager: a new one starts every 2 steps) and
sent as 4-bit FP4 through hivemind averaging on the nodes' own DHT. Each node's /metrics is
scraped for the per-fragment series. About 30 s; every wait is scaled by
GASLOC_TEST_TIMEOUT_SCALE.
"""

from __future__ import annotations

import signal
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.tools.nodes import METRICS_LINE
from tests.daemon_helpers import write_corpus
from tests.node_helpers import scaled
from tests.swarm_helpers import NodeProc, start_three, wait_for

H, FRAGMENTS = 10, 5
OFFSETS = [0, 2, 4, 6, 8]
STREAMING = ["--algorithm", "streaming-diloco", "--fragments", "4", "--tau", "5",
             "--diloco-codec", "fp4", "--n-layer", "4", "--n-embd", "32", "--seq-len", "32",
             "--batch-size", "4", "--inner-steps", str(H), "--eval-interval-steps", "20",
             "--matchmaking-time-s", "3", "--request-timeout-s", "2",
             "--averaging-timeout-s", "15", "--log-interval-s", "3"]


def fragments_averaged(infos: list[pb.InfoReply], syncs: int) -> bool:
    return all(len(i.fragment_syncs) == FRAGMENTS
               and min(f.syncs_ok for f in i.fragment_syncs) >= syncs for i in infos)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A real /metrics scrape: (sample name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def check_fragment_metrics(url: str, before: pb.InfoReply) -> None:
    """The per-fragment series agree with an Info reply taken just before (counters only
    grow) and show each fragment syncing at its own offset."""
    got = scrape(url)
    for f, info in enumerate(before.fragment_syncs):
        label = (("fragment", str(f)),)
        ok = got[("gasloc_fragment_syncs_total", (("fragment", str(f)), ("outcome", "ok")))]
        assert ok >= info.syncs_ok >= 5, (f, ok, info)
        assert got[("gasloc_fragment_syncs_total",
                    (("fragment", str(f)), ("outcome", "failed")))] >= info.syncs_failed
        assert got[("gasloc_fragment_last_sync_step", label)] % H == OFFSETS[f]
        assert got[("gasloc_fragment_sent_bytes_total", label)] >= info.bytes_sent > 0
        assert got[("gasloc_fragment_received_bytes_total", label)] > 0
        assert got[("gasloc_fragment_stall_seconds_total", label)] >= info.wait_s
        assert got[("gasloc_fragment_averaging_seconds_total", label)] > 0
        assert ("gasloc_fragment_resyncs_total", label) in got
    assert ("gasloc_fragment_syncs_total", (("fragment", str(FRAGMENTS)), ("outcome", "ok"))
            ) not in got


def test_three_streaming_processes_average_every_fragment_at_its_offset(tmp_path: Path):
    corpus = write_corpus(tmp_path / "corpus")
    data = ["--data", str(corpus)]
    nodes: list[NodeProc] = []
    try:
        start_three(nodes, NodeProc, tmp_path, [*data, *STREAMING], "s", "streaming-diloco")
        wait_for(lambda: fragments_averaged([n.info() for n in nodes], 6), 150,
                 "6 averaged syncs of every fragment on every node", 1.0)
        infos = [n.info() for n in nodes]
        for node, info in zip(nodes, infos, strict=True):
            check_fragment_metrics(node.wait_for(METRICS_LINE, 5).group(1), info)
        for node, info in zip(nodes, infos, strict=True):
            assert info.algorithm == "streaming-diloco" and info.exchanges_ok_initiator == 0
            assert [f.offset for f in info.fragment_syncs] == OFFSETS
            width = max(f.numel for f in info.fragment_syncs)  # the shared averager's size
            for f in info.fragment_syncs:
                assert (f.last_start_step - f.offset) % H == 0, (node.name, f)
                assert f.epoch >= f.syncs_ok
                # fp4: half a byte per value (and a scale per block) of the zero-padded vector
                # for the parts sent to and returned from the groupmates: 2 (n-1)/n of it with
                # equal shares, up to (n-1) bytes per value when load balancing gives one peer
                # all of it; fp32 would be 8 (n-1)/n bytes per value
                per_sync = f.bytes_sent / max(1, f.syncs_ok + f.syncs_failed)
                assert 0 < per_sync < 1.1 * width, (node.name, f)
            assert info.val_loss < info.first_val_loss - 0.3, (node.name, info)
            print(f"{node.name}: " + "; ".join(
                f"f{f.index}@{f.offset} ok {f.syncs_ok} failed {f.syncs_failed} solo "
                f"{f.syncs_solo} epoch {f.epoch} {f.bytes_sent / max(1, f.syncs_ok):.0f} B/sync "
                f"stalled {f.wait_s:.2f} s resyncs {f.resyncs}" for f in info.fragment_syncs)
                  + f" | val {info.first_val_loss:.3f} -> {info.val_loss:.3f}")
        # the joiners started from theta_0 (--no-init-from-swarm) while s0 trained alone, and
        # groups that met out of phase failed (then resynced); fp4 payloads alone must not
        # make syncs resync (every member keeps the same averaged bytes: digests agree)
        assert sum(i.resyncs for i in infos) >= 1
        for info in infos:
            assert info.resyncs < sum(f.syncs_ok for f in info.fragment_syncs) / 2, info
        states = [n.download_state("gasloc") for n in nodes]
        assert {meta.momentum for meta, _ in states} == {"local"}  # Nesterov
        spread = max(float((a - states[0][1]).abs().max()) for _, a in states[1:])
        print(f"anchors: largest difference between nodes {spread:.3g} (max |anchor| "
              f"{float(states[0][1].abs().max()):.3g}), epochs {[m.rounds for m, _ in states]}")
        nodes[1].wait_for(r"\| diloco epochs \[\d+(, \d+){4}\] syncs ok/failed/solo f0:",
                          scaled(15), stdout=False)  # the progress line
        for node in nodes:
            node.proc.send_signal(signal.SIGTERM)
        for node in nodes:
            assert node.proc.wait(timeout=scaled(30)) == 0, node.err.read_text()[-3000:]
            wait_for(lambda n=node: not n.group_alive(), 15, f"{node.name}'s children")
    finally:
        for node in nodes:
            node.kill()
