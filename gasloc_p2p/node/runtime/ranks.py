"""The ranks of one node: K local processes (``torch.distributed``) that train as one peer.

Rank 0 *is* the node: the DHT, the gRPC server and client, metrics, checkpoints, the outer state
(host memory, once per node) and the exchange engine. Every rank trains. Before each step rank
0 sends one control message (the step number, and whether the parameters or the AdamW state
changed since the last step), then the node's batch; each rank takes its rows of it, and DDP
averages the gradients, so the K replicas take the same AdamW step. Whatever changed the
parameters between two steps on rank 0 (a gossip commit, a round end, a rollback, a restore, a
downloaded state) reaches the other ranks as one broadcast of the flat parameters before the
next step (and of the AdamW state when that changed): the K replicas stay bit-identical, which
a checksum compared at every round end and at the stop verifies.

The node's batch (``batch_size`` x ``grad_accum`` rows, the run's) is split, not multiplied:
rank r takes rows ``r*b/K .. (r+1)*b/K`` of each micro-batch of ``b`` rows, so a K-rank node
takes the step a 1-rank node takes on the same batch (within float rounding of the mean), and
a multi-rank node exchanges with any other node of the run. Its traffic is one payload per
exchange, as for any node: only rank 0 speaks to peers.

With ``--sharding fsdp`` (:mod:`.sharded`) the ranks hold rows of one model instead of
replicas: "send the parameters" becomes "scatter rank 0's full copy into the ranks' rows",
and rank 0 asks between steps for what its full copy, its evaluation, its checkpoints and the
guard's drift probe need from the rows (the ``_PULL``, ``_EVAL``, ``_OPTSTATE`` and
``_PROBE_AT`` requests, answered in :meth:`RankGroup.follow_step`). Every request is sent
under the training lock, so the ranks meet each collective in rank 0's order.

Collectives go through one process group with gloo for host tensors (control, batch, checks)
and NCCL for CUDA tensors (parameters, AdamW state, DDP's gradients). A rank that dies makes
the others' next collective fail: rank 0's trainer stops with an error naming the node's
ranks, the other ranks exit, and the launcher (:mod:`gasloc_p2p.node.launch`) names the rank.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import pickle
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# A rank waits this long on rank 0 at most (rank 0's start-up: the DHT, a state download, a
# checkpoint restore; a DiLoCo round's network wait). A dead rank is noticed at once (its
# sockets close); this bounds only a rank 0 that hangs alive.
RANK_TIMEOUT_S = 1800.0
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# control operations: stop; a step; compare the replicas; (sharded) fill rank 0's full copy of
# the parameters, evaluate, save the AdamW state (each rank its rows), set the drift probe's
# sample
_STOP, _STEP, _CHECK, _PULL, _EVAL, _OPTSTATE, _PROBE_AT = 0, 1, 2, 3, 4, 5, 6
# control flags: what rank 0 sends before the step; (sharded) sample the probe around it
_PARAMS, _OPTIMIZER, _PROBE = 1, 2, 4
MAX_CONFIG_BYTES = 1 << 20  # the node's settings, sent once at start-up


class RankLost(RuntimeError):
    """A collective of the node failed: another rank is gone."""


def distributed_env(environ: dict[str, str] | None = None) -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when this process is one rank of a multi-rank node
    (``torchrun`` or ``gasloc-node join --nproc-per-node K`` set the environment), else
    None."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
    except ValueError as exc:
        raise ValueError(f"RANK/WORLD_SIZE/LOCAL_RANK must be integers: {exc}") from None
    if world < 2:
        return None
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return rank, world, local


def rank_device(name: str, local_rank: int) -> torch.device:
    """This rank's training device: ``auto``/``cuda`` take GPU ``LOCAL_RANK``; an explicit
    ``cuda:N`` is refused (every rank would take the same GPU); ``cpu`` stays."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda:"):
        raise ValueError(f"--device={name}: a multi-rank node takes GPU LOCAL_RANK on each "
                         "rank; use --device cuda (or auto)")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device=cuda: CUDA is not available on this machine (try cpu)")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"rank {local_rank} has no GPU: this machine has "
                             f"{torch.cuda.device_count()}; lower --nproc-per-node")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if name != "cpu":
        raise ValueError(f"--device={name}: a multi-rank node runs on cpu or cuda")
    return torch.device("cpu")


class RankGroup:
    """This process's place among the node's ranks, and the collectives they run.

    Every method is a collective: all ranks call the same ones in the same order (rank 0's
    trainer thread drives them; the other ranks follow in :func:`follow`).
    """

    def __init__(self, rank: int, world: int, local_rank: int,
                 timeout_s: float = RANK_TIMEOUT_S) -> None:
        self.rank, self.world, self.local_rank = rank, world, local_rank
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.host = torch.device("cpu")
        self._seen: tuple[int, int] = (-1, -1)  # (lock writes, optimizer epoch) last sent
        # --sharding fsdp: this rank's rows of the model (set once the replica is built); rank
        # 0's AdamW state to hand the ranks at the next step (a restore; {} after a rollback)
        self.sharded: Any = None
        self.optimizer_to_send: dict[str, Any] | None = None
        self._probe = False  # (sharded) the drift probe samples around every step

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        """Leave the process group (safe twice)."""
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ start-up
    def share(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (small start-up values: the settings, the
        vocabulary size), pickled; bounded in size on the receiving side."""
        size = torch.zeros(1, dtype=torch.int64)
        data = b""
        if self.leader:
            data = pickle.dumps(obj)
            size[0] = len(data)
        self._broadcast(size)
        n = int(size[0])
        if not 0 < n <= MAX_CONFIG_BYTES:
            raise RankLost(f"rank 0 sent {n} bytes of settings (at most {MAX_CONFIG_BYTES})")
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.leader
               else torch.empty(n, dtype=torch.uint8))
        self._broadcast(buf)
        return obj if self.leader else pickle.loads(buf.numpy().tobytes())  # noqa: S301

    def share_batches(self, batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Rank 0's (x, y) int64 host batches on every rank (the validation set): their
        shapes (small), then each batch as one tensor."""
        shapes = self.share([tuple(x.shape) for x, _ in batches] if self.leader and batches
                            is not None else None)
        out = []
        for i, shape in enumerate(shapes):
            both = (torch.stack(batches[i]).long() if self.leader and batches is not None
                    else torch.empty((2, *shape), dtype=torch.int64))
            self._broadcast(both)
            out.append((both[0], both[1]))
        return out

    # ------------------------------------------------------------------ per step
    def lead(self, step: int, x: torch.Tensor, y: torch.Tensor, params: torch.Tensor,
             optimizer: Any, versions: tuple[int, int]) -> None:
        """Rank 0, before step ``step``: send the control message, the parameters and AdamW
        state if ``versions`` (lock writes, optimizer epoch) moved since the last step, then
        the node's batch ``x``, ``y`` (host tensors [B, T])."""
        flags = self._changed(versions) | (_PROBE if self._probe else 0)
        self._control(_STEP, step, flags)
        self._sync(flags, params, optimizer)
        self._broadcast(torch.stack((x, y)).long())  # the followers expect int64 [2, B, T]

    def _changed(self, versions: tuple[int, int]) -> int:
        flags = (_PARAMS if versions[0] != self._seen[0] else 0) | (
            _OPTIMIZER if versions[1] != self._seen[1] else 0)
        self._seen = versions
        return flags

    def follow_step(self, replica: Replica,
                    shape: tuple[int, int]) -> tuple[int, torch.Tensor, torch.Tensor, bool] | None:
        """A rank > 0, before a step: the step number, the node's batch and whether to sample
        the drift probe around the step; None on stop. Requests of rank 0's between steps
        (compare, fill its copy, evaluate, save the AdamW state) are answered on the way."""
        params = replica.flat.buffer if replica.flat is not None else None
        optimizer = replica.inner.optimizer
        while True:
            op, step, flags = self._control()
            if op == _STOP:
                self._sync(flags, params, optimizer)
                self.check(params)
                return None
            if op == _CHECK:
                self.check(params)
            elif op == _PULL:
                self._collective(self.sharded.pull, None)
            elif op == _EVAL:
                self.evaluate(replica.inner, replica.val)
            elif op == _OPTSTATE:
                path = self.share()
                if not isinstance(path, str):
                    raise RankLost(f"rank 0 sent a checkpoint path of type {type(path)}")
                self._collective(self.sharded.save_optimizer, optimizer, path)
            elif op == _PROBE_AT:
                self._probe_at(None)
            elif op == _STEP:
                self._sync(flags, params, optimizer)
                both = torch.empty((2, *shape), dtype=torch.int64)
                self._broadcast(both)
                return step, both[0], both[1], bool(flags & _PROBE)
            else:
                raise RankLost(f"rank {self.rank}: rank 0 sent an unknown request {op}")

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a scalar (this rank's loss) over the ranks."""
        out = value.detach().reshape(1).clone()
        try:
            dist.all_reduce(out)
        except (RuntimeError, dist.DistBackendError) as exc:
            raise self._lost(exc) from None
        return out[0] / self.world

    def stop(self, params: torch.Tensor, optimizer: Any, versions: tuple[int, int]) -> bool:
        """Rank 0: tell the other ranks to stop, with what changed since the last step (a
        round end after it, a commit), then compare the replicas one last time."""
        flags = self._changed(versions)
        self._control(_STOP, 0, flags)
        self._sync(flags, params, optimizer)
        return self.check(params)

    def verify(self, params: torch.Tensor) -> bool:
        """Rank 0, between steps: compare the replicas (at a round end)."""
        if self.sharded is not None:
            return True  # each rank holds other rows: no replicas to compare
        self._control(_CHECK, 0, 0)
        return self.check(params)

    # ------------------------------------------------------------------ sharded (FSDP2)
    def pull(self, mirror: torch.Tensor) -> None:
        """Rank 0, between steps: fill its full copy of the parameters from the ranks'
        rows (a reader of the flat buffer came after a step)."""
        self._control(_PULL, 0, 0)
        self._collective(self.sharded.pull, mirror)

    def evaluate(self, inner: Any, val: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """The validation loss of the sharded model, every rank evaluating its rows of each
        batch (the whole batch, counted once, where the rows do not split); rank 0 asks."""
        from gasloc_p2p.train import evaluate

        if self.leader:
            self._control(_EVAL, 0, 0)
        sums = torch.zeros(2, dtype=torch.float64)
        for x, y in val:
            split = x.shape[0] % self.world == 0
            mine = [split_rows(t, 1, self.rank, self.world) if split else t for t in (x, y)]
            with inner.autocast():
                loss = evaluate(inner.model, [(mine[0], mine[1])])
            if split or self.leader:
                sums += torch.tensor([loss * mine[1].numel(), mine[1].numel()],
                                     dtype=torch.float64)
        self.sharded.reshard()  # a forward without backward leaves the root's layers gathered
        try:
            dist.all_reduce(sums)
        except (RuntimeError, dist.DistBackendError) as exc:
            raise self._lost(exc) from None
        return float(sums[0] / sums[1])

    def save_optimizer(self, optimizer: Any, path: str) -> str:
        """Rank 0: every rank writes its rows of the AdamW state into the directory ``path``
        (a checkpoint: :meth:`Sharded.save_optimizer`); "" or why it failed."""
        self._control(_OPTSTATE, 0, 0)
        self.share(path)
        return str(self._collective(self.sharded.save_optimizer, optimizer, path))

    def probe_at(self, idx: torch.Tensor) -> None:
        """Rank 0: the drift probe's flat positions, sampled around every step from now."""
        self._control(_PROBE_AT, 0, 0)
        self._probe_at(idx)
        self._probe = True

    def _probe_at(self, idx: torch.Tensor | None) -> None:
        size = torch.tensor([idx.numel() if idx is not None else 0])
        self._broadcast(size)
        if not 0 < int(size[0]) <= MAX_CONFIG_BYTES:
            raise RankLost(f"rank 0 sent a probe of {int(size[0])} positions")
        buf = idx.cpu().long() if idx is not None else torch.empty(int(size[0]),
                                                                   dtype=torch.int64)
        self._broadcast(buf)
        self._collective(self.sharded.sample, buf)

    def sample(self) -> torch.Tensor:
        """Every rank (sharded, the probe on): the parameters at the probe's positions."""
        return self._collective(self.sharded.sample, None)

    def _collective(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except (RuntimeError, dist.DistBackendError) as exc:
            raise self._lost(exc) from None

    def check(self, params: torch.Tensor | None) -> bool:
        """Every rank: an exact checksum of the parameters' bits, gathered; True when all
        agree. Rank 0 logs a disagreement (its next step broadcasts the parameters)."""
        if self.sharded is not None:
            return True
        assert params is not None
        mine = checksum(params).to(self.host).reshape(1)
        every = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        try:
            dist.all_gather(every, mine)
        except (RuntimeError, dist.DistBackendError) as exc:
            raise self._lost(exc) from None
        sums = [int(t[0]) for t in every]
        agree = len(set(sums)) == 1
        if self.leader and not agree:
            differ = [r for r, s in enumerate(sums) if s != sums[0]]
            log.warning("rank(s) %s of this node hold other parameters than rank 0: "
                        "broadcasting rank 0's", differ)
            self._seen = (-1, self._seen[1])  # the next step sends the parameters
        return agree

    # ------------------------------------------------------------------ pieces
    def _control(self, op: int = 0, step: int = 0, flags: int = 0) -> tuple[int, int, int]:
        msg = torch.tensor([op, step, flags], dtype=torch.int64)
        self._broadcast(msg)
        return int(msg[0]), int(msg[1]), int(msg[2])

    def _sync(self, flags: int, params: torch.Tensor | None, optimizer: Any) -> None:
        if self.sharded is not None:
            if flags & _PARAMS:  # rank 0's full copy (written since) into every rank's rows
                self._collective(self.sharded.push, params if self.leader else None)
            if flags & _OPTIMIZER:
                state, self.optimizer_to_send = self.optimizer_to_send, None
                self._collective(self.sharded.load_optimizer_state, optimizer,
                                 (state or {}) if self.leader else None)
            return
        assert params is not None
        if flags & _PARAMS:
            self._broadcast(params)
        if flags & _OPTIMIZER:
            self._sync_optimizer(optimizer)

    def _sync_optimizer(self, optimizer: Any) -> None:
        """Rank 0's AdamW state on every rank (after a rollback cleared it or a checkpoint
        restored it): its layout first (small), then tensor by tensor in place."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        layout = None
        if self.leader:
            layout = [sorted((k, tuple(v.shape), str(v.dtype).removeprefix("torch."),
                              v.device.type)
                             for k, v in optimizer.state.get(p, {}).items()
                             if isinstance(v, torch.Tensor)) for p in params]
        layout = self.share(layout)
        if len(layout) != len(params):
            raise RankLost(f"rank 0 has {len(layout)} optimized tensors, this rank "
                           f"{len(params)}")
        if not self.leader:
            optimizer.state.clear()
        for p, entries in zip(params, layout, strict=True):
            if not entries:
                continue
            state = optimizer.state[p]
            for key, shape, dtype, where in entries:
                if not self.leader:
                    device = p.device if where != "cpu" else self.host
                    state[key] = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                self._broadcast(state[key])

    def _broadcast(self, t: torch.Tensor) -> None:
        try:
            dist.broadcast(t, 0)
        except (RuntimeError, dist.DistBackendError) as exc:
            raise self._lost(exc) from None

    def _lost(self, exc: BaseException) -> RankLost:
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". This is")[0]  # gloo's source
        who = "another rank of this node" if self.leader else "rank 0 (the node)"
        return RankLost(f"rank {self.rank} of {self.world}: {who} is gone ({first[:160]})")


def split_rows(x: torch.Tensor, micro: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a batch of ``micro`` micro-batches: 1/``world`` of each, in
    order (so the rank's own micro-batches are the same split of the same rows)."""
    b = x.shape[0] // micro
    if x.shape[0] % micro or b % world:
        raise ValueError(f"a batch of {x.shape[0]} rows in {micro} micro-batch(es) does not "
                         f"split over {world} ranks")
    part = x.view(micro, world, b // world, *x.shape[1:])[:, rank]
    return part.reshape(micro * (b // world), *x.shape[1:])


def rows_on(x: torch.Tensor, micro: int, rank: int, world: int,
            device: torch.device) -> torch.Tensor:
    """:func:`split_rows` on ``device``: through pinned memory, asynchronously, on CUDA."""
    part = split_rows(x, micro, rank, world)
    if device.type == "cuda":
        return part.pin_memory().to(device, non_blocking=True)
    return part.to(device)


def checksum(t: torch.Tensor, chunk: int = 1 << 22) -> torch.Tensor:
    """A checksum of a float32 tensor's bits (the sum of its words as integers, int64, on the
    tensor's device): equal bits give equal sums, and any float that changes changes it but
    for a coincidence. Chunked: at most ``chunk`` int64 words exist at once."""
    words = t.reshape(-1).view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for s in range(0, words.numel(), chunk):
        total += words[s : s + chunk].sum(dtype=torch.int64)
    return total


@dataclasses.dataclass
class Replica:
    """What a rank > 0 holds: its flat parameters (None when sharded: its rows live in the
    model), the inner loop, the device and (sharded) the validation batches and its rows (built
    by :func:`gasloc_p2p.node.runtime.trainer.follower_replica`)."""

    flat: Any
    inner: Any
    device: torch.device
    val: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    sharded: Any = None


def follow(group: RankGroup, build: Callable[[Any, RankGroup], Replica]) -> int:
    """The life of a rank > 0: receive the node's settings and vocabulary from rank 0, build
    the replica, then step with rank 0 until it says stop. Returns the exit code (0 after a
    stop, 1 when rank 0 is gone)."""
    try:
        cfg, vocab = group.share(), group.share()
        val = group.share_batches() if cfg.sharding == "fsdp" else []
        replica = build((cfg, vocab), group)
        replica.val = val
        group.sharded = replica.sharded
        torch.set_num_threads(cfg.torch_threads)
        rows = cfg.batch_size * cfg.grad_accum
        while True:
            got = group.follow_step(replica, (rows, cfg.seq_len))
            if got is None:
                log.info("rank %d: stopped by rank 0", group.rank)
                return 0
            step, x, y, probe = got
            mine = [rows_on(t, cfg.grad_accum, group.rank, group.world, replica.device)
                    for t in (x, y)]
            if probe:
                group.sample()
            loss = replica.inner.step(*mine, step)
            group.mean(loss)
            if probe:
                group.sample()
    except RankLost as exc:
        log.error("%s; this rank stops", exc)
        return 1
    except Exception as exc:  # its own failure (a device, memory): one line, then exit
        log.error("rank %d of %d failed: %s: %s", group.rank, group.world, type(exc).__name__,
                  exc)
        log.debug("details", exc_info=True)
        return 1
