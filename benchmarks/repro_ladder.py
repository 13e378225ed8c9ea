"""The size ladder (issue 25): does the outer step that wins at 0.1M parameters win at 25M?

The same five arms at every rung, same seeds and data order, n = 8 workers on the exponential
graph, H = 20, int8 payloads, 1000 inner steps per worker:

1. DiLoCo with Nesterov 0.7 / 0.9 (the papers' outer step; the first row, which the others are
   paired against),
2. DiLoCo with plain averaging (eta 1, gamma 0),
3. GASLoC as the daemon runs it (plain pair averaging),
4. GASLoC with outer momentum (mixed form) at equal effective step, gamma 0.5 / eta 0.5,
5. GASLoC off the eta / (1 - gamma) = 1 line: DiLoCo's own 0.7 / 0.9 (effective step 7).

CPU rungs (``make ladder-cpu``): the built-in GPT at 0.13M and 0.38M parameters (and 1.8M,
``--only ladder-2m --seeds 0``: one seed, 80 CPU-minutes) on the
byte-level corpus of the installed packages (``make corpus`` builds it: 4M tokens per run do
not repeat in it, where Shakespeare's 1.1M repeat about four times). GPU rungs (``make
gpu-next``, the GPU queue: benchmarks/gpu_plan.py): 4.9M and 25.5M parameters without the
embeddings (9.0M and 33.7M with the 16k-BPE vocabulary), 66M and 33M tokens per arm, bf16 on
``cuda``, the five arms of a rung side by side on one GPU, one seed per queue slice. Every rung's table lands in docs/results/ladder-*.md.
"""

from __future__ import annotations

import dataclasses

from gasloc_p2p.sim.config import SimConfig

BYTES = "runs/corpus-bytes"  # make corpus
BPE = "runs/corpus"

# (part, parameters in words, model and batch shape, device settings)
CPU_BASE = SimConfig(workers=8, steps=1000, H=20, graph="exponential", codec="int8",
                     eval_every=250, eval_batches=64, trace_batches=4, eval_workers=False,
                     threads=1, data=BYTES)
RUNGS: dict[str, tuple[str, SimConfig]] = {
    "ladder-0.1m": ("0.1M", dataclasses.replace(CPU_BASE, n_layer=2, n_embd=64, n_head=4)),
    "ladder-0.4m": ("0.4M", dataclasses.replace(CPU_BASE, n_layer=3, n_embd=96, n_head=4)),
    # one seed: about 16 CPU-minutes a run here, 80 for the five arms
    "ladder-2m": ("2M", dataclasses.replace(CPU_BASE, n_layer=4, n_embd=192, n_head=4)),
    "ladder-5m": ("5M", dataclasses.replace(
        CPU_BASE, data=BPE, n_layer=6, n_embd=256, n_head=8, seq_len=256, batch_size=16,
        steps=2000, eval_every=500, device="cuda", precision="bf16")),
    # sized for one GPU-queue slice (benchmarks/gpu_plan.py): five arms side by side in about
    # 4.5 minutes on an H100 (4000 steps of batch 16, 262M tokens an arm, never fitted a window)
    "ladder-25m": ("25M", dataclasses.replace(
        CPU_BASE, data=BPE, n_layer=8, n_embd=512, n_head=8, seq_len=512, batch_size=8,
        steps=1000, eval_every=250, device="cuda", precision="bf16")),
}
CPU_PARTS = ("ladder-0.1m", "ladder-0.4m")
GPU_PARTS = ("ladder-5m", "ladder-25m")
# Off the eta / (1 - gamma) = 1 line: DiLoCo's Nesterov at gamma 0.9 and effective steps 1, 2,
# 3 and 7 (DiLoCo's 0.7), against plain averaging, at the larger CPU rung.
SWEEP = "ladder-0.4m-sweep"
SWEEP_ETAS = (0.1, 0.2, 0.3, 0.7)
TITLES = {part: f"The size ladder at {size} parameters: DiLoCo's Nesterov, plain averaging, "
                "GASLoC with and without outer momentum"
          for part, (size, _) in RUNGS.items()}
TITLES[SWEEP] = ("The size ladder at 0.4M parameters, off the eta / (1 - gamma) = 1 line: "
                 "DiLoCo's Nesterov at gamma 0.9 and effective steps 1 to 7")
PARTS = (*RUNGS, SWEEP)


def rows(part: str) -> list[tuple[str, SimConfig]]:
    r = dataclasses.replace
    if part == SWEEP:
        _, base = RUNGS["ladder-0.4m"]
        return [("diloco plain averaging", r(base, algorithm="diloco", eta=1.0, gamma=0.0)),
                *((f"diloco Nesterov g0.9 eta{eta:g} (effective step {eta / 0.1:.0f})",
                   r(base, algorithm="diloco", eta=eta, gamma=0.9)) for eta in SWEEP_ETAS)]
    _, base = RUNGS[part]
    return [
        ("diloco Nesterov 0.7/0.9", r(base, algorithm="diloco", eta=0.7, gamma=0.9)),
        ("diloco plain averaging", r(base, algorithm="diloco", eta=1.0, gamma=0.0)),
        ("gasloc (default: plain pair averaging)", r(base, algorithm="gasloc")),
        ("gasloc momentum g0.5 eta0.5", r(base, algorithm="gasloc", gamma=0.5, eta=0.5)),
        ("gasloc g0.9 eta0.7 (effective step 7)", r(base, algorithm="gasloc", gamma=0.9,
                                                     eta=0.7)),
    ]
