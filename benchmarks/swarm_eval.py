"""Helpers of the swarm benchmarks (not a benchmark itself): node flags, the network-average
model's validation loss from the nodes' published states."""

from __future__ import annotations

import argparse
import math

import torch

from gasloc_p2p.core.flat import FlatParams
from gasloc_p2p.model import build_model
from gasloc_p2p.node.runtime.trainer import load_data
from gasloc_p2p.node.settings import build_config
from gasloc_p2p.tools.nodes import NodeChild
from gasloc_p2p.train import evaluate

TINY = {"n_layer": 2, "n_embd": 64, "seq_len": 64, "batch_size": 8, "inner_steps": 10,
        "eval_batches": 4, "host": "127.0.0.1", "torch_threads": 1}


def flags(extra: dict[str, object] | None = None) -> list[str]:
    """``--flag value`` pairs of the tiny model (and ``extra``)."""
    out: list[str] = []
    for key, value in {**TINY, **(extra or {})}.items():
        out += [f"--{key.replace('_', '-')}", str(value)]
    return out


class Evaluator:
    """The validation loss of a flat parameter vector, on the nodes' fixed validation batches."""

    def __init__(self, extra: dict[str, object] | None = None) -> None:
        cfg = build_config(argparse.Namespace(**{**TINY, **(extra or {})}), environ={})
        self.model = build_model(cfg.train.gpt(), cfg.train.seed)
        self.flat = FlatParams(self.model)  # the daemon's layout of the flat vector
        self.val = load_data(cfg.train, cfg.train.seed).val
        self.theta0 = self.flat.buffer.detach().clone()

    def loss(self, flat: torch.Tensor) -> float:
        with torch.no_grad():
            self.flat.buffer.copy_(flat)
        return evaluate(self.model, self.val)


def network_average(nodes: list[NodeChild], run_id: str = "gasloc"
                    ) -> tuple[torch.Tensor | None, int]:
    """Mean of the published states (public iterates) of the nodes that answer; and how many
    held a non-finite value."""
    states, nan = [], 0
    for node in nodes:
        try:
            _, params = node.download_state(run_id)
        except Exception as exc:  # a node that just restarted: skip it
            print(f"  (no state from {node.name}: {type(exc).__name__})")
            continue
        if not math.isfinite(float(params.sum())):
            nan += 1
            continue
        states.append(params)
    return (torch.stack(states).mean(0) if states else None), nan
