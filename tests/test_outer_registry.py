"""Adding an outer optimizer is one class and one registry line (gasloc_p2p/core/outer.py).

A toy optimizer, registered from this test alone, with state of its own (two named buffers,
so the order a class declares them in is what checkpoints and the wire follow) goes through a
daemon trainer's round ends, a checkpoint written and resumed, a rollback, a state download
over gRPC and its adoption, and the simulator; nothing else in the package names it.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.outer import OUTER_OPTIMIZERS, Fill, OuterOptimizer, State, register
from gasloc_p2p.node.config import NetworkConfig, TrainConfig
from gasloc_p2p.node.modes.gossip import GossipMode
from gasloc_p2p.node.runtime import checkpoint as ckpt
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.runtime.trainer import Trainer
from gasloc_p2p.node.stats import TrainStats
from gasloc_p2p.node.transport.service import (
    GossipServicer,
    PeerChannels,
    download_state,
    start_server,
)
from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb
from gasloc_p2p.protocol.auth import Signer
from gasloc_p2p.protocol.certs import TlsIdentity
from gasloc_p2p.protocol.messages import ExchangeError, Identity
from gasloc_p2p.sim.config import SimConfig
from gasloc_p2p.sim.run import run as run_sim
from tests.node_helpers import FINGERPRINT, RUN, run, scaled

TINY = TrainConfig(n_layer=1, n_embd=16, n_head=2, seq_len=16, batch_size=2, inner_steps=2)
SNOO = AsyncConfig(eta=0.7, gamma=0.5, momentum="snoo")


class Snoo(OuterOptimizer):
    """SNOO-style (arXiv 2510.15830): Nesterov on the pseudo-gradient of the node's own steps
    (``d = a - theta``; ``v <- gamma v + d``; ``theta <- a - eta (d + gamma v)``), and an
    average of the iterates beside it (``e <- (e + theta) / 2``, from the start)."""

    name = "snoo"
    buffers = ("velocity", "ema")

    @property
    def reads_anchor(self) -> bool:
        return True

    def reset(self, fill: Fill) -> None:
        self.state["velocity"].zero_()
        fill(self.state["ema"])

    def round_end_chunk(self, anchor: torch.Tensor | None, theta: torch.Tensor,
                        state: State) -> dict[str, torch.Tensor]:
        assert anchor is not None
        d = anchor - theta
        v = self.gamma * state["velocity"] + d
        theta.copy_(anchor - self.eta * (d + self.gamma * v))
        return {"velocity": v, "ema": (state["ema"] + theta) / 2}


@pytest.fixture
def snoo():
    register(Snoo)  # the one line a new outer optimizer adds to the registry
    yield
    del OUTER_OPTIMIZERS[Snoo.name]


def trainer(outer: AsyncConfig = SNOO) -> Trainer:
    t = Trainer(TINY, outer, 1, TrainingLock(), TrainStats())
    t.load_data(0)
    return t


def tensors(t: Trainer) -> list[torch.Tensor]:
    st = t.state
    assert st.anchor is not None
    return [st.theta, st.anchor, *(st.outer.state[n] for n in Snoo.buffers)]


def assert_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_the_round_end_is_the_class_formula(snoo):
    theta0 = torch.randn(50, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    st = AsyncGaslocState(theta0.clone(), theta0, SNOO)
    assert isinstance(st.outer, Snoo) and torch.equal(st.outer.state["ema"], theta0)
    v = torch.zeros(50, dtype=torch.float64)
    ema = theta0.clone()
    for r in range(3):
        st.theta.add_(torch.randn(50, dtype=torch.float64,
                                  generator=torch.Generator().manual_seed(r + 1)))
        a, theta = st.anchor.clone(), st.theta.clone()
        st.round_end()
        d = a - theta
        v = 0.5 * v + d
        want = a - 0.7 * (d + 0.5 * v)
        ema = (ema + want) / 2
        assert torch.equal(st.theta, want) and torch.equal(st.anchor, want)
        assert torch.equal(st.outer.state["velocity"], v)
        assert torch.equal(st.outer.state["ema"], ema)


def test_a_trainer_checkpoints_resumes_and_rolls_back_its_named_state(snoo, tmp_path: Path):
    a = trainer()
    ema0 = a.state.outer.state["ema"].clone()  # theta_0
    for _ in range(5):  # two round ends and a step
        a.step()
    assert not torch.equal(a.state.outer.state["ema"], ema0)
    assert {p.name for p in a.placement()} >= {"outer velocity", "outer ema",
                                               "rollback velocity", "rollback ema"}
    # a checkpoint through the file: the name and the named buffers, checked on load
    saved = a.state_for_checkpoint()
    assert saved["outer"] == "snoo" and list(saved["outer_state"]) == ["velocity", "ema"]
    ckpt.save_atomic(saved, tmp_path)
    loaded = ckpt.load(tmp_path)
    assert loaded is not None
    ckpt.validate(loaded, a.fingerprint, a.flat.numel, ckpt.checkpoint_path(tmp_path))
    b = trainer()
    b.restore(loaded)
    for _ in range(3):  # the resumed node goes on as the original does, bit for bit
        a.step()
        b.step()
    assert_equal(tensors(a), tensors(b))
    with pytest.raises(ValueError, match="'snoo' outer optimizer, this node runs 'mixed'"):
        trainer(AsyncConfig(eta=0.7, gamma=0.5)).restore(loaded)
    # a rollback restores both buffers of the last good round end (a's step 8)
    assert a.stats.step % TINY.inner_steps == 0
    good = [t.clone() for t in tensors(a)]
    a.step()  # mid-round; then the buffers go bad, as a NaN would make them
    for buf in a.state.outer.state.values():
        buf.fill_(float("nan"))
    a._roll_back(1e9, jump=True)
    assert_equal(tensors(a), good)


def test_a_state_download_carries_the_buffers_in_the_declared_order(snoo):
    donor = trainer()
    for _ in range(5):
        donor.step()
    mode = GossipMode()  # its snapshot, the one DownloadState serves
    mode.ctx = types.SimpleNamespace(trainer=donor, lock=donor.lock,  # type: ignore[assignment]
                                     train_stats=donor.stats)
    snap = mode.snapshot()
    assert snap.outer == "snoo" and list(snap.state) == ["velocity", "ema"]

    async def main() -> tuple[pb.StateMeta, torch.Tensor, dict[str, torch.Tensor]]:
        tls = TlsIdentity.generate("donor")
        servicer = GossipServicer(Identity(RUN, FINGERPRINT, "donor"), None,  # no exchanges
                                  lambda: pb.InfoReply(peer_id="donor"), lambda: snap)
        server, port = await start_server(servicer, "127.0.0.1", 0, NetworkConfig(), tls)
        channels = PeerChannels(NetworkConfig())
        me = Identity.keyed(RUN, FINGERPRINT, Signer())
        try:
            stub = channels.stub(f"127.0.0.1:{port}", tls.cert_der)
            with pytest.raises(ExchangeError, match="'snoo', this node runs 'local'"):
                await download_state(stub, me, scaled(10), donor.flat.numel,
                                     outer=AsyncConfig(gamma=0.5, momentum="local").outer())
            return await download_state(stub, me, scaled(10), donor.flat.numel,
                                        outer=joiner.state.outer)
        finally:
            await channels.close()
            await server.stop(0)

    joiner = trainer()
    meta, params, outer = run(main())
    assert meta.total_bytes == 3 * 4 * donor.flat.numel and list(outer) == ["velocity", "ema"]
    joiner.adopt(params, outer)
    st = donor.state
    assert torch.equal(joiner.state.theta, st.public_iterate())
    for name in Snoo.buffers:
        assert torch.equal(joiner.state.outer.state[name], st.outer.state[name]), name
    fresh = trainer()  # a state without the optimizer's: its own restarts at the iterate
    fresh.adopt(params, None)
    assert torch.equal(fresh.state.outer.state["ema"], params)
    assert not fresh.state.outer.state["velocity"].any()


def test_the_simulator_runs_it(snoo):
    cfg = SimConfig(task="consensus", graph="ring", workers=8, H=1, steps=20, eval_every=20,
                    codec="none", dtype="float64", gamma=0.5, momentum="snoo", eta=0.8)
    out = run_sim(cfg)
    assert out["history"][-1]["val_loss"] < 1.0  # the workers moved toward agreement
