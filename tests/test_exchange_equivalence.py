"""A daemon exchange (two gRPC shells on 127.0.0.1) and a simulated one give identical tensors.

The same two parameter states go through a sequence of exchanges twice: once through the node's
:class:`GossipTransport` over real sockets, once through the simulator's
:class:`ProtocolExchanger` (in memory). The sequence covers a fresh link, the reverse direction
on the same link, a round end on one side between snapshot and commit (staleness 1: the
down-weighted gossip weight), and a link one side lost (reset to ``theta_0`` on both). After
every exchange both paths must hold bit-identical parameters, anchors, momentum memories,
references and link versions, and report the same staleness, weight and correction norm.
"""

from __future__ import annotations

import pytest
import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.sim.exchange import ProtocolExchanger
from tests.node_helpers import Peer, fragments, gossip_config, make_peer, run, wait_until

OUTER = AsyncConfig(eta=0.7, gamma=0.5, w=0.5, staleness_policy="downweight", max_staleness=0)
# (initiator, fragment, round end on the responder mid-exchange, responder loses the link)
STEPS = [(0, 0, False, False), (1, 1, False, False), (0, 1, True, False), (0, 0, False, True),
         (1, 0, True, False)]


def _clone_state(state: AsyncGaslocState, theta0: torch.Tensor) -> AsyncGaslocState:
    copy = AsyncGaslocState(state.theta.clone(), theta0, state.cfg)
    copy.anchor.copy_(state.anchor)
    copy.memory.copy_(state.memory)
    copy.rounds = state.rounds
    return copy


def _tensors(state: AsyncGaslocState, refs: object, other: str) -> dict[str, object]:
    link = refs.get(other)  # type: ignore[attr-defined]
    return {"theta": state.theta, "anchor": state.anchor, "memory": state.memory,
            "rounds": state.rounds, "ref_out": link.ref_out, "ref_in": link.ref_in,
            "version": link.version}


def _assert_identical(daemon: dict[str, object], sim: dict[str, object], where: str) -> None:
    for key, value in daemon.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, sim[key]), f"{where}: {key} differs"
        else:
            assert value == sim[key], f"{where}: {key} {value} != {sim[key]}"


def _round_end_before_check(peer: Peer) -> None:
    """The peer ends a round after its snapshot, while it checks the payload it received."""
    check = peer.engine.check

    def late_round_end(*args):
        with peer.engine.lock.urgent():
            peer.state.round_end()
        peer.engine.check = check  # once
        return check(*args)

    peer.engine.check = late_round_end


@pytest.mark.parametrize("codec", ["int8", "fp4"])
def test_daemon_and_simulator_exchanges_are_bit_identical(codec):
    async def main():
        peers = [await make_peer("0", 1, gossip_config(codec=codec), outer=OUTER),
                 await make_peer("1", 2, gossip_config(codec=codec), outer=OUTER)]
        try:
            t0 = peers[0].engine.theta0
            sim_states = [_clone_state(p.state, t0) for p in peers]
            ids = [p.me.peer_id for p in peers]  # key-derived: the simulator uses the same
            sim = ProtocolExchanger(sim_states, t0, fragments(), CodecSpec.of(codec), OUTER,
                                    references="links", peer_ids=ids)
            start = peers[0].state.theta.clone()
            for n, (i, frag, late_round, lost) in enumerate(STEPS):
                j = 1 - i
                if lost:  # the responder evicted the link: both paths must reset it
                    peers[j].engine.refs.get(ids[i]).reset(t0)
                    sim.engines[j].refs.get(ids[i]).reset(t0)
                if late_round:
                    _round_end_before_check(peers[j])
                ok = peers[j].exchanger.stats.ok_responder
                daemon_out = await peers[i].exchange(peers[j], frag)
                await wait_until(lambda j=j, ok=ok: peers[j].exchanger.stats.ok_responder > ok,
                                 what="the responder's commit")
                pend = sim.begin(i, j, frag)
                if late_round:
                    sim_states[j].round_end()
                staleness, weight = sim.commit(pend)
                assert (staleness, weight) == (daemon_out.staleness, daemon_out.weight)
                assert weight == (0.25 if late_round else 0.5)
                for k in (i, j):
                    _assert_identical(_tensors(peers[k].state, peers[k].engine.refs, ids[1 - k]),
                                      _tensors(sim_states[k], sim.engines[k].refs, ids[1 - k]),
                                      f"step {n}, side {k}")
                link = sim.engines[i].refs.get(ids[j])
                want = torch.tensor(weight) * (fragments()[frag].gather(link.ref_in)
                                               - fragments()[frag].gather(link.ref_out))
                # the states are bit-identical (above); the norm is a float32 reduction whose
                # summation order depends on torch's threads: 1e-6 failed once (1.1e-6)
                assert daemon_out.correction_norm == pytest.approx(float(want.norm()), rel=1e-5)
            assert peers[0].engine.refs.get(ids[1]).version == 2  # reset once, then one more
            assert not torch.equal(peers[0].state.theta, start)  # the exchanges did something
        finally:
            for p in peers:
                await p.close()

    run(main())


def _feedback_tensors(state: AsyncGaslocState, refs: object) -> dict[str, object]:
    errors = refs.errors  # type: ignore[attr-defined]
    out: dict[str, object] = {"theta": state.theta, "anchor": state.anchor,
                              "memory": state.memory, "rounds": state.rounds}
    for index, enc in errors.items():
        out[f"e{index}.data"], out[f"e{index}.scales"] = enc.data, enc.scales
    return out


def test_daemon_and_simulator_feedback_exchanges_are_bit_identical():
    """The same over the per-node error-feedback scheme (no links, so no resets)."""
    async def main():
        gossip = gossip_config(codec="int4", references="feedback", guard_factor=0)
        peers = [await make_peer("0", 1, gossip, outer=OUTER),
                 await make_peer("1", 2, gossip, outer=OUTER)]
        try:
            t0 = peers[0].engine.theta0
            sim_states = [_clone_state(p.state, t0) for p in peers]
            sim = ProtocolExchanger(sim_states, t0, fragments(), CodecSpec.of("int4"), OUTER,
                                    references="feedback")
            for n, (i, frag, late_round, _) in enumerate(STEPS):
                j = 1 - i
                if late_round:
                    _round_end_before_check(peers[j])
                ok = peers[j].exchanger.stats.ok_responder
                daemon_out = await peers[i].exchange(peers[j], frag)
                await wait_until(lambda j=j, ok=ok: peers[j].exchanger.stats.ok_responder > ok,
                                 what="the responder's commit")
                pend = sim.begin(i, j, frag)
                if late_round:
                    sim_states[j].round_end()
                assert sim.commit(pend) == (daemon_out.staleness, daemon_out.weight)
                for k in (i, j):
                    _assert_identical(_feedback_tensors(peers[k].state, peers[k].engine.refs),
                                      _feedback_tensors(sim_states[k], sim.engines[k].refs),
                                      f"step {n}, side {k}")
            assert len(peers[0].engine.refs.errors) == 2  # type: ignore[attr-defined]
        finally:
            for p in peers:
                await p.close()

    run(main())
