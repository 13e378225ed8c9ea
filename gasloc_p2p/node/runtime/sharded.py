"""A node's model sharded over its ranks (FSDP2, ``--sharding fsdp``): for a model larger than
one GPU.

``torch.distributed.fsdp.fully_shard`` on every transformer layer and on the root: each rank
holds dim-0 rows of every parameter (``torch.chunk`` of the rows over the K ranks), and so
1/K of the parameters, gradients and AdamW moments on its GPU. The exchange engine, the outer
state and the wire format stay those of a one-rank node, on rank 0's host, over the *full*
flat parameter vector: rank 0 keeps a host copy of it (the flat buffer every other part of the
node reads and writes, the "mirror"), which the ranks fill when a reader needs it
(:meth:`Sharded.pull`: every parameter's rows gathered to rank 0, one at a time) and take
their rows back from after a writer changed it (:meth:`Sharded.push`: scattered from rank 0).
Only rank 0 ever holds a whole parameter on its device, one at a time.
Both run only when the training lock says so: a pull when a holder arrives after a step, a
push before the next step after a write. The ranks never see half an exchange: they take whole
parameter sets, after rank 0 committed.

The AdamW state stays sharded, in checkpoints too: every rank writes its rows with
``torch.distributed.checkpoint`` (:meth:`Sharded.save_optimizer`), nothing gathers it; DCP
reshards at load, so the node resumes with any number of ranks (a one-rank node reads the whole
state: :func:`gasloc_p2p.node.runtime.checkpoint.read_sharded_optimizer`). A one-rank node's
checkpoint (the full state) is handed to the ranks by a broadcast from rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gasloc_p2p.core.flat import Span


def layer_stack(model: nn.Module) -> nn.ModuleList:
    """The model's transformer layers: the built-in GPT's ``blocks`` or a Hugging Face model's
    decoder layers (the one ``ModuleList`` of ``num_hidden_layers`` modules)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return blocks
    hf_model = getattr(model, "hf", None)
    count = getattr(getattr(hf_model, "config", None), "num_hidden_layers", None)
    stacks = [m for m in (hf_model.modules() if hf_model is not None else ())
              if isinstance(m, nn.ModuleList) and len(m) == count]
    if len(stacks) != 1:
        raise ValueError("this model has no stack of transformer layers to shard")
    return stacks[0]


def shard_model(model: nn.Module, device: torch.device, world: int) -> nn.Module:
    """``fully_shard`` every layer, then the root (embeddings, head, final norm: tied weights
    stay in one unit), over the node's ``world`` ranks on ``device``'s kind; in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for layer in layer_stack(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class Sharded:
    """One rank's view of the sharded parameters in the canonical flat order (``spans``: the
    flat buffer's layout, the wire format). Every method is a collective."""

    def __init__(self, model: nn.Module, spans: Sequence[Span], rank: int, world: int) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        if [tuple(p.shape) for p in params] != [s.shape for s in spans]:
            raise ValueError("the sharded model's parameters are not the flat buffer's")
        self.model, self.params, self.spans = model, params, tuple(spans)
        self.rank, self.world = rank, world
        self._mesh = params[0].device_mesh  # type: ignore[attr-defined]
        self._sample: tuple[torch.Tensor, list[tuple[int, torch.Tensor, torch.Tensor]]] | None \
            = None

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def local_bytes(self) -> int:
        """Bytes of this rank's rows of the parameters."""
        return sum(p.to_local().nbytes for p in self.params)  # type: ignore[attr-defined]

    def reshard(self) -> None:
        """Free every gathered layer (FSDP2 keeps the root's parameters gathered after a
        forward that no backward follows, an evaluation: the model then names its full
        tensors, not its rows, which the AdamW state dict cannot map)."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    @torch.no_grad()
    def materialize(self, mirror: torch.Tensor | None, device: torch.device) -> None:
        """At start-up: a rank built on the meta device (``mirror`` None) gets storage for
        its rows on ``device``, then every rank takes rank 0's buffers (rotary tables, masks)
        and its rows of rank 0's ``mirror``."""
        if mirror is None:
            self.model.to_empty(device=device)
            self.params = [p for p in self.model.parameters() if p.requires_grad]
        for b in self.model.buffers():
            dist.broadcast(b, 0)
        self.push(mirror)

    @torch.no_grad()
    def pull(self, mirror: torch.Tensor | None) -> None:
        """Every parameter's full value into ``mirror`` (rank 0's flat host buffer; None on
        the other ranks), one parameter at a time: each rank's rows gathered to rank 0 alone
        (the other ranks never hold more than their rows, and nothing travels to them)."""
        pinned = mirror is not None and mirror.is_pinned()
        for p, s in zip(self.params, self.spans, strict=True):
            rows, full = self._gather_rows(p.to_local(), s.shape)  # type: ignore[attr-defined]
            if mirror is not None:  # (freed tensors' memory is reused in stream order)
                mirror[s.offset : s.offset + s.numel].copy_(full[:rows].reshape(-1),
                                                            non_blocking=pinned)
            del full
        if pinned:  # one wait for all the copies, before anything reads the copy
            torch.cuda.current_stream(self.device).synchronize()

    def _chunk(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """``(rows, c)``: a parameter's rows and the rows of one rank's ``torch.chunk`` share
        (the last ranks may hold fewer, or none)."""
        rows = shape[0]
        return rows, -(-rows // self.world)

    def _gather_rows(self, local: torch.Tensor, shape: tuple[int, ...]
                     ) -> tuple[int, torch.Tensor]:
        """Every rank's rows of one parameter, padded to equal shares, gathered to rank 0:
        ``(rows, [world * c, ...])`` there (the first ``rows`` are the parameter), ``(rows,
        the padded share)`` elsewhere."""
        rows, c = self._chunk(shape)
        share = local
        if local.shape[0] != c:
            share = local.new_zeros((c, *shape[1:]))
            share[: local.shape[0]] = local
        group = self._mesh.get_group()
        if self.rank == 0:
            out = local.new_empty((self.world * c, *shape[1:]))
            dist.gather(share.contiguous(), list(out.chunk(self.world)), dst=0, group=group)
            return rows, out
        dist.gather(share.contiguous(), None, dst=0, group=group)
        return rows, share

    @torch.no_grad()
    def push(self, mirror: torch.Tensor | None) -> None:
        """Rank 0's ``mirror`` into every rank's rows, one parameter at a time: rank 0
        scatters equal padded shares (the other ranks hold one share, never the whole
        parameter)."""
        pinned = mirror is not None and mirror.is_pinned()
        group = self._mesh.get_group()
        for p, s in zip(self.params, self.spans, strict=True):
            local = p.to_local()  # type: ignore[attr-defined]
            rows, c = self._chunk(s.shape)
            share = local.new_empty((c, *s.shape[1:]))
            if mirror is not None:
                full = local.new_zeros((self.world * c, *s.shape[1:]))
                full[:rows].copy_(mirror[s.offset : s.offset + s.numel].view(s.shape),
                                  non_blocking=pinned)
                dist.scatter(share, list(full.chunk(self.world)), src=0, group=group)
                del full
            else:
                dist.scatter(share, None, src=0, group=group)
            local.copy_(share[: local.shape[0]])
            del share
        if pinned:  # the host may write the copy again only once the device has read it
            torch.cuda.current_stream(self.device).synchronize()

    @torch.no_grad()
    def sample(self, idx: torch.Tensor | None) -> torch.Tensor:
        """The parameters at flat positions ``idx`` (the drift probe's sample), from the
        ranks that hold them (each position on one rank; a sum of the others' zeros).
        ``idx`` is given once (rank 0's, broadcast by the caller) and kept."""
        if idx is not None:
            self._sample = (idx, self._locate(idx.cpu()))
        assert self._sample is not None, "sample: no positions given yet"
        n = self._sample[0].numel()
        out = torch.zeros(n, device=self.device)
        for i, where, local in self._sample[1]:
            out[where] = self.params[i].to_local().reshape(-1)[local].float()  # type: ignore
        dist.all_reduce(out)
        return out

    def _locate(self, idx: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """For each parameter holding some of ``idx`` on this rank: (parameter, positions in
        ``idx``, flat positions in this rank's rows)."""
        out = []
        for i, s in enumerate(self.spans):
            inside = ((idx >= s.offset) & (idx < s.offset + s.numel)).nonzero().reshape(-1)
            if not inside.numel():
                continue
            rows = s.shape[0] if s.shape else 1
            row_len = s.numel // rows
            chunk = -(-rows // self.world)  # torch.chunk's rows per rank
            first, last = self.rank * chunk, min((self.rank + 1) * chunk, rows)
            rel = idx[inside] - s.offset
            mine = (rel >= first * row_len) & (rel < last * row_len)
            if mine.any():
                out.append((i, inside[mine].to(self.device),
                            (rel[mine] - first * row_len).to(self.device)))
        return out

    # ------------------------------------------------------------------ AdamW state
    def save_optimizer(self, optimizer: Any, path: str) -> str:
        """Every rank writes its rows of the AdamW state into the directory ``path`` with
        ``torch.distributed.checkpoint`` (one file per rank, then DCP's metadata). Returns ""
        or, on every rank alike, why a rank could not write (a full disk): DCP gathers every
        rank's outcome."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        self.reshard()  # the state dict maps rows, not gathered layers
        try:
            dcp.save(get_optimizer_state_dict(self.model, optimizer), checkpoint_id=path)
        except CheckpointException as exc:  # (a BaseException); failures: rank -> (error, stack)
            rank = min(exc.failures, default=0)
            found = exc.failures.get(rank)
            error: BaseException = found[0] if isinstance(found, tuple) else exc
            text = " ".join(str(error).split())[:200]
            return f"rank {rank}: {type(error).__name__}: {text}"
        return ""

    def load_optimizer_state(self, optimizer: Any, state: dict[str, Any] | None) -> None:
        """Rank 0's AdamW ``state`` (None on the other ranks) into every rank's rows: a
        sharded checkpoint (``{"sharded": directory}``: each rank reads its rows, DCP
        reshards whatever number of ranks wrote it), a full state (``optimizer.state_dict()``
        format: broadcast from rank 0), or an empty one (every rank clears its moments: a
        rollback)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        where = [state["sharded"] if state is not None and set(state) == {"sharded"} else None]
        kind = 2 if where[0] is not None else 0 if state is None or state.get("state") else 1
        flag = torch.tensor([kind])
        dist.broadcast(flag, 0)
        if int(flag[0]) == 1:  # no moments: every rank starts them afresh
            optimizer.state.clear()
            return
        if int(flag[0]) == 2:
            dist.broadcast_object_list(where, 0)
            self.reshard()
            into = get_optimizer_state_dict(self.model, optimizer)
            # the moments and counts only: the hyperparameters stay this run's, as for a node
            # of one rank reading the same files
            dcp.load({"state": into["state"]}, checkpoint_id=str(where[0]))
            set_optimizer_state_dict(self.model, optimizer, into)
            return
        full = _by_name(state, optimizer_names(self.model, optimizer)) if state is not None else {}
        set_optimizer_state_dict(
            self.model, optimizer, full,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def optimizer_names(model: nn.Module, optimizer: Any) -> list[str]:
    """The optimized parameters' names in the optimizer's order (its state dict's ids)."""
    name = {id(p): n for n, p in model.named_parameters()}
    return [name[id(p)] for g in optimizer.param_groups for p in g["params"]]


def _by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An ``optimizer.state_dict()`` (integer ids) keyed by parameter names, as
    ``set_optimizer_state_dict`` takes it."""
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {names[int(i)]: v for i, v in state["state"].items()},
            "param_groups": groups}
