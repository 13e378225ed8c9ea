"""Count one exchange's tensor operations and host synchronisations (``TorchDispatchMode``).

Used by ``tests/test_engine_counts.py`` and ``benchmarks/bench_engine.py``: two engines over
``numel`` float32 parameters (int8 payloads, the update guard on) run one whole exchange
(prepare, check with the screen, commit, on both sides) under the counting mode. A residual
codec's exchange (half2, sign1) runs against a link both engines seeded before the count;
moving the link's reference after the commit is host work on host memory, walked in host
chunks whatever the device, and is not counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gasloc_p2p.core import sparse
from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
from gasloc_p2p.core.codecs import BlockCodec, CodecSpec
from gasloc_p2p.core.flat import whole
from gasloc_p2p.core.links import Link, LinkCache
from gasloc_p2p.core.wire import RESIDUAL_CODECS
from gasloc_p2p.protocol.engine import ON_CPU_CHUNK, ExchangeEngine, NoLock
from gasloc_p2p.protocol.guard import GuardRule, UpdateGuard

# operations that make the host wait for the device (on a GPU)
SYNC_OPS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.item", "aten.equal")


class Counter(TorchDispatchMode):
    """Counts non-view operations and host synchronisations."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.syncs = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        full = str(getattr(func, "overloadpacket", func))
        if full in SYNC_OPS or (full == "aten._to_copy" and _to_host(args, kwargs)):
            self.syncs += 1
        if not getattr(func, "is_view", False):
            self.ops += 1
        return func(*args, **kwargs)


def _to_host(args: tuple, kwargs: dict) -> bool:
    """A copy whose destination is the host and whose source is a device tensor (on a CPU run:
    the explicit reads, ``.to("cpu", copy=True)``)."""
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu"


def engines(numel: int, chunk: int, device: str = "cpu",
            stream_payloads: bool | None = None,
            kernels: bool | None = None) -> list[ExchangeEngine]:
    """Two engines of ``numel`` parameters on ``device`` (their theta_0 on the host, as a
    node keeps it); ``chunk`` 0: the device's default; ``stream_payloads``: the engine's
    (None: streamed int8 payloads on a GPU); ``kernels``: the engine's (None: the fused
    Triton kernels on a GPU)."""
    out = []

    def randn(seed: int, std: float) -> torch.Tensor:  # drawn where it is used (1B: seconds)
        gen = torch.Generator(device).manual_seed(seed)
        return torch.randn(numel, generator=gen, device=device).mul_(std)

    theta0, common = randn(9, 0.02), randn(8, 1e-3)
    host0 = theta0.to("cpu", torch.bfloat16)
    for seed in (0, 1):
        theta = randn(seed, 1e-3).add_(theta0).add_(common)
        state = AsyncGaslocState(theta, theta, AsyncConfig(), host="cpu")
        engine = ExchangeEngine(state, host0, [whole(numel)], NoLock(), chunk or None,
                                stream_payloads, kernels)
        engine.guard = UpdateGuard(GuardRule(trust_after=1, round_budget=1e30,
                                             block_budget=1e30))
        engine.guard.round_end({0: 1.0})  # a drift that admits these nodes' distance
        out.append(engine)
    return out


@contextlib.contextmanager
def device_passes(on: bool) -> Iterator[None]:
    """The codecs' passes as on an accelerator (the whole input at once) while ``on``: on a
    CPU they walk cache-sized pieces, which a GPU does not."""
    if not on:
        yield
        return
    original, passes = BlockCodec._blocks_per_pass, sparse._PASS_ELEMS
    BlockCodec._blocks_per_pass = lambda self, device: 1 << 62  # type: ignore[method-assign]
    sparse._PASS_ELEMS = 1 << 62
    try:
        yield
    finally:
        BlockCodec._blocks_per_pass = original  # type: ignore[method-assign]
        sparse._PASS_ELEMS = passes


@contextlib.contextmanager
def uncounted_folds(counter: Counter) -> Iterator[None]:
    """Links' folds (host work on host memory, see the module's docstring) left out of
    ``counter``."""
    fold = Link.fold

    def quiet(self: Link, *args: object, **kwargs: object) -> None:
        counter.paused = True
        try:
            fold(self, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            counter.paused = False

    Link.fold = quiet  # type: ignore[method-assign]
    try:
        yield
    finally:
        Link.fold = fold  # type: ignore[method-assign]


def seed_links(a: ExchangeEngine, b: ExchangeEngine, numel: int) -> list[Link | None]:
    """The link of engines ``a`` (peer "B") and ``b`` (peer "A"), seeded by an int8 exchange
    (a residual codec's exchange runs against it): [a's, b's]."""
    for e in (a, b):
        e.links = LinkCache(1)
    int8 = CodecSpec.of("int8")
    pa, pb = a.prepare("B", 0, int8), b.prepare("A", 0, int8)
    ra = b.check(int8, numel, bytearray(pa.payload), pa.digest, pb)
    rb = a.check(int8, numel, bytearray(pb.payload), pb.digest, pa)
    pa.seed = pb.seed = True
    a.commit(pa, rb, 0.5)
    b.commit(pb, ra, 0.5)
    return [a.links.get("B", 0), b.links.get("A", 0)]  # type: ignore[union-attr]


def count_exchange(numel: int, chunk: int, spec: str = "int8") -> dict[str, int]:
    """Operations and synchronisations of one exchange between two fresh engines whose chunks
    are ``chunk`` elements (the codecs' passes as on a GPU when chunks are device-sized)."""
    a, b = engines(numel, chunk)
    codec = CodecSpec.parse(spec)
    links = seed_links(a, b, numel) if codec.name in RESIDUAL_CODECS else [None, None]
    warm = codec.codec()  # its tables are built once per process: not the exchange's work
    warm.decode(warm.encode(torch.ones(max(codec.block_size, 1))))
    counter = Counter()
    with device_passes(chunk > ON_CPU_CHUNK), uncounted_folds(counter), counter:
        pa = a.prepare("B", 0, codec, link=links[0])
        pb = b.prepare("A", 0, codec, link=links[1])
        ra = b.check(codec, numel, bytearray(pa.payload), pa.digest, pb)
        rb = a.check(codec, numel, bytearray(pb.payload), pb.digest, pa)
        a.commit(pa, rb, 0.5)
        b.commit(pb, ra, 0.5)
    return {"ops": counter.ops, "syncs": counter.syncs}
