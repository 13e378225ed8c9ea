"""Flat parameter buffers: every update in the core runs on one contiguous 1-D tensor.

A model's parameters are re-pointed to views of a single buffer, so an outer update or a gossip
correction is a handful of large tensor ops instead of a Python loop over parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

FRAGMENT_KINDS = ("strided", "sequential")
Piece = tuple[int, int, int]  # (start in the flat buffer, length, offset in a compact chunk)


def host_buffer(numel: int, like: torch.Tensor, host: torch.device,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty ``[numel]`` buffer on ``host``, pinned when ``like`` lives on a CUDA device and
    ``host`` is the CPU (so copies between them can be asynchronous)."""
    pin = host.type == "cpu" and like.device.type == "cuda"
    return torch.empty(numel, dtype=dtype or like.dtype, device=host, pin_memory=pin)


@dataclass(frozen=True)
class Span:
    """One parameter's place in the flat buffer: elements ``[offset, offset + numel)``."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]


class FlatParams:
    """Owns one flat buffer holding all parameters of ``module``; parameters become its views.

    Build optimizers *after* this, so they see the same ``nn.Parameter`` objects (their ``.data``
    now aliases the buffer). ``buffer`` may also be supplied by the caller, e.g. one row of an
    ``[n_workers, numel]`` tensor in the simulator.
    """

    def __init__(self, module: nn.Module, buffer: torch.Tensor | None = None) -> None:
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("module has no trainable parameters")
        dtype = named[0][1].dtype
        if any(p.dtype != dtype for _, p in named):
            raise ValueError("all parameters must share one dtype to live in one flat buffer")
        total = sum(p.numel() for _, p in named)
        if buffer is None:
            buffer = torch.empty(total, dtype=dtype, device=named[0][1].device)
        if buffer.dim() != 1 or buffer.numel() != total or buffer.dtype != dtype:
            raise ValueError(f"buffer must be 1-D {dtype} with {total} elements")
        spans: list[Span] = []
        offset = 0
        with torch.no_grad():
            for name, p in named:
                view = buffer[offset : offset + p.numel()].view_as(p)
                view.copy_(p.data)
                p.data = view
                spans.append(Span(name, offset, p.numel(), tuple(p.shape)))
                offset += p.numel()
        self.buffer = buffer
        self.spans: tuple[Span, ...] = tuple(spans)
        self._params = [p for _, p in named]

    @property
    def numel(self) -> int:
        return self.buffer.numel()

    def release(self, pin: bool = False) -> FlatParams:
        """The module no longer uses the buffer (its parameters were replaced, e.g. sharded):
        forget them, keeping the buffer and its layout; with ``pin`` move the buffer to pinned
        host memory (the old one is freed: nothing else holds it). Returns self."""
        self._params = []
        if pin:
            self.buffer = self.buffer.pin_memory()
        return self

    def to(self, device: torch.device | str) -> FlatParams:
        """Move the buffer to ``device`` and re-point the parameters at it (one copy of the
        parameters on the device, never two); returns self."""
        device = torch.device(device)
        if self.buffer.device == device:
            return self
        buffer = self.buffer.to(device)
        with torch.no_grad():
            for span, p in zip(self.spans, self._params, strict=True):
                p.data = buffer[span.offset : span.offset + span.numel].view(span.shape)
        self.buffer = buffer
        return self


def flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors into a new 1-D tensor (a copy)."""
    return torch.cat([t.reshape(-1) for t in tensors])


class Fragment:
    """A subset of the flat buffer made of disjoint spans, e.g. every other transformer layer.

    ``gather`` returns a compact 1-D copy ``[fragment_numel]``; ``add_`` adds a compact tensor back
    into the matching places. Contiguous runs are merged so a strided fragment costs one op per
    layer, not per parameter.
    """

    def __init__(self, index: int, ranges: Sequence[tuple[int, int]]) -> None:
        merged: list[tuple[int, int]] = []
        for start, length in sorted(ranges):
            if length <= 0:
                continue
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            elif merged and merged[-1][0] + merged[-1][1] > start:
                raise ValueError("fragment ranges overlap")
            else:
                merged.append((start, length))
        self.index = index
        self.ranges: tuple[tuple[int, int], ...] = tuple(merged)
        self.numel = sum(length for _, length in merged)

    def gather(self, buf: torch.Tensor) -> torch.Tensor:
        if len(self.ranges) == 1:
            start, length = self.ranges[0]
            return buf[start : start + length].clone()
        return torch.cat([buf[s : s + n] for s, n in self.ranges])

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        return [buf[s : s + n] for s, n in self.ranges]

    def add_(self, buf: torch.Tensor, values: torch.Tensor, alpha: float = 1.0) -> None:
        """``buf[fragment] += alpha * values`` in place; ``values`` is compact ``[numel]``."""
        pos = 0
        for start, length in self.ranges:
            buf[start : start + length].add_(values[pos : pos + length], alpha=alpha)
            pos += length

    def copy_(self, buf: torch.Tensor, values: torch.Tensor) -> None:
        pos = 0
        for start, length in self.ranges:
            buf[start : start + length].copy_(values[pos : pos + length])
            pos += length

    def chunks(self, size: int) -> Iterator[tuple[int, int, list[Piece]]]:
        """Walk the fragment in compact chunks of ``size`` elements (the last may be shorter).

        Yields ``(compact_start, length, pieces)``; each piece ``(start, length, offset)`` maps
        ``buf[start : start + length]`` to ``chunk[offset : offset + length]``. Lets callers work
        through a cache-sized scratch buffer instead of gathering the fragment.
        """
        pos, pieces, filled = 0, [], 0
        for start, length in self.ranges:
            while length:
                take = min(length, size - filled)
                pieces.append((start, take, filled))
                start, length, filled = start + take, length - take, filled + take
                if filled == size:
                    yield pos, filled, pieces
                    pos, pieces, filled = pos + filled, [], 0
        if filled:
            yield pos, filled, pieces

    def __repr__(self) -> str:
        return f"Fragment({self.index}, numel={self.numel}, ranges={len(self.ranges)})"


def whole(numel: int) -> Fragment:
    """The fragment covering the whole buffer."""
    return Fragment(0, [(0, numel)])


def layer_fragments(
    spans: Sequence[Span], layer_of: Callable[[str], int | None], parts: int, kind: str = "strided"
) -> list[Fragment]:
    """Split parameters into fragments by transformer layer.

    strided: layer ``l`` goes to fragment ``l mod parts``; sequential: contiguous groups of
    layers. Tensors outside layers (embeddings, final norm) form one more fragment, last.
    ``parts = 1`` puts all layers in one fragment (plus the non-layer one).
    """
    if kind not in FRAGMENT_KINDS:
        raise ValueError(f"unknown fragment kind {kind!r}; choose one of {FRAGMENT_KINDS}")
    if parts < 1:
        raise ValueError("need at least one fragment")
    layers = sorted({idx for s in spans if (idx := layer_of(s.name)) is not None})
    if parts > max(len(layers), 1):
        raise ValueError(f"{parts} fragments but the model has only {len(layers)} layers")
    groups: list[list[tuple[int, int]]] = [[] for _ in range(parts)]
    rest: list[tuple[int, int]] = []
    for s in spans:
        idx = layer_of(s.name)
        if idx is None:
            rest.append((s.offset, s.numel))
        else:
            pos = layers.index(idx)
            f = pos % parts if kind == "strided" else pos * parts // len(layers)
            groups[f].append((s.offset, s.numel))
    frags = [Fragment(i, g) for i, g in enumerate(groups) if g]
    if rest:
        frags.append(Fragment(len(frags), rest))
    return frags
