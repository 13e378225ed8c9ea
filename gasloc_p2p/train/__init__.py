"""Pure training code: the inner schedule, optimizer, step and evaluation.

One implementation for both drivers: :mod:`gasloc_p2p.sim` runs many :class:`InnerLoop` objects
in one process, :mod:`gasloc_p2p.node` runs one in its trainer thread. This package imports
torch, the model, the data pipeline and the core only; never the simulator, the daemon, the
tooling or any network or I/O package (``tests/test_layers.py`` enforces it).
"""

from gasloc_p2p.train.evaluate import evaluate
from gasloc_p2p.train.inner import InnerLoop, StepConfig, resolve_device
from gasloc_p2p.train.optim import AdamWConfig, build_adamw, param_groups
from gasloc_p2p.train.schedule import LRSchedule

__all__ = ["AdamWConfig", "InnerLoop", "LRSchedule", "StepConfig", "build_adamw", "evaluate",
           "param_groups", "resolve_device"]
