"""The timing projection (benchmarks.projection): closed forms, the event model's limits."""

from __future__ import annotations

import pytest

from benchmarks.projection import (
    Profile,
    diloco,
    gasloc,
    gasloc_paced,
    min_link_for,
    project,
    streaming,
)


def profile(nodes: int = 4, link: float = 1e6, **kw) -> Profile:
    base = {"step_s": 0.1, "inner_steps": 20, "payload_bytes": 1e6, "allreduce_bytes": 1e6}
    base.update(kw)
    return Profile(nodes=nodes, link_bps=(link,) * nodes, **base)


def test_diloco_waits_for_the_butterfly_all_reduce_on_the_slowest_link():
    p = profile(link=1e6).with_links((1e6, 1e6, 1e6, 2.5e5))
    sync = 2 * 3 / 4 * 1e6 / 2.5e5 + 2 * 0.02
    q = diloco(p)
    assert q.exchange_s == pytest.approx(sync)
    assert q.utilization == pytest.approx(2.0 / (2.0 + sync))
    # each sync's encode/reduce/apply work is paid on top of the wait
    assert diloco(profile(link=1e6, work_s=0.3).with_links(p.link_bps)).utilization == \
        pytest.approx(2.0 / (2.0 + sync + 0.3))


def test_streaming_hides_what_tau_steps_cover_and_stalls_on_the_rest():
    fast = streaming(profile(link=1e8))  # a 0.25 MB fragment in 4 ms: tau = 0.5 s hides it
    assert fast.utilization == 1.0
    slow = streaming(profile(link=1e5))  # 7.5 s per fragment sync, 0.5 s hidden, 4 per round
    stall = 2 * 3 / 4 * 2.5e5 / 1e5 + 0.04 - 0.5
    assert slow.utilization == pytest.approx(2.0 / (2.0 + 4 * stall))


def test_gasloc_overlaps_the_link_and_pays_only_its_work():
    fast = gasloc(profile(nodes=16, link=1e9, work_s=0.05))
    # 2 starts per round, each with two participants: about 4 participations per round
    assert 3.0 < fast.participations_per_round < 4.2
    assert fast.utilization == pytest.approx(
        2.0 / (2.0 + fast.participations_per_round * 0.05), rel=0.02)
    slow = gasloc(profile(nodes=16, link=5e4, work_s=0.05))  # one exchange takes 10 rounds
    assert slow.exchange_s == pytest.approx(20.04)
    assert slow.participations_per_round < 0.11  # the link is the limit
    assert slow.utilization > 0.99
    assert gasloc(profile(nodes=16, link=1e9, starts_per_round=0)).participations_per_round == 0


def test_min_link_inverts_the_closed_form_and_gasloc_needs_a_round_per_payload():
    p = profile(nodes=64)
    need = min_link_for("diloco", p, 0.9)
    sync_ok = 2.0 / 0.9 - 2.0  # the sync time that leaves 90% utilization
    exact = 2 * 63 / 64 * 1e6 / (sync_ok - 0.04)
    assert need == pytest.approx(exact, rel=0.02)
    g = min_link_for("gasloc", p, 0.9)  # work 0: only the one-exchange-a-round rule binds
    assert g is not None and 1e6 / 2.0 < g < 4 * 1e6 / 2.0
    assert min_link_for("gasloc", profile(nodes=8, work_s=1.0), 0.99) is None  # work alone
    with pytest.raises(ValueError, match="unknown method"):
        project("allgather", p)
    with pytest.raises(ValueError, match="one link rate per node"):
        Profile(nodes=3, step_s=0.1, inner_steps=2, payload_bytes=1, allreduce_bytes=1,
                link_bps=(1.0,))


def test_paced_gasloc_trades_starts_for_utilization_down_to_its_floor():
    p = profile(nodes=16, link=1e9, work_s=0.05)
    free = gasloc(p)
    assert free.utilization < 0.95  # about 4 participations x 0.05 s on a 2 s round
    paced = gasloc_paced(p)
    assert paced.method == "gasloc-paced"
    assert paced.utilization >= 0.95
    assert 1.0 < paced.participations_per_round < free.participations_per_round
    # work so costly that even the floor misses the target: the floor, not zero gossip
    floor = gasloc_paced(profile(nodes=16, link=1e9, work_s=0.5))
    assert floor.utilization < 0.95
    assert 0.6 < floor.participations_per_round < 1.4  # 0.5 starts: about 1 participation
    idle = profile(nodes=16, link=1e9)
    assert gasloc_paced(idle).participations_per_round == \
        gasloc(idle).participations_per_round  # no work: no pacing
