"""What the GPU queue holds, in priority order (issue 38; runner: :mod:`benchmarks.gpu_queue`).

Expected minutes are for one H100 (16 host cores) and are *estimates* until a window measures
a slice (``gpu_queue plan`` then shows the measurement). The estimates: a simulator arm costs
``6 N`` FLOPs per token (plus attention), and five arms side by side are taken to reach about
150 TFLOP/s together at 5-9M parameters (eager, launch-bound) and 250 TFLOP/s at 34M (an H100
reaches about 800 on large bf16 products); each eager worker step costs its process about
10-15 ms of host time whatever the model; a process starts in about 30 s (torch, CUDA, data).
A slice whose arms would run past its deadline stops after half a minute and says so.

1. ``concurrency``: does running arms side by side change a result? One ladder arm alone,
   then beside the other four (same seed): losses within bf16 noise, and the throughput gain.
2. ``ladder-5m-s0``, ``ladder-25m-s0``: the size ladder's GPU rungs (repro_ladder.py), all five
   arms at once, one seed per slice; more seeds at the end of the queue.
3. ``payloads``: issue 40's GPU figures, each codec's exchange (tensor work) at 135M against
   a device copy (target: at most 5x), and the CUDA tests of the streamed payloads.
4. ``swarm-*``: 4 real ``gasloc-node join`` processes on one GPU training a 135M Llama (bf16,
   ``--compile``) for 4 minutes, each in its own network namespace on a 100 Mbit/s tbf link,
   so that one int8 exchange (137 MB) takes about 11 s: about one round of 50 steps. One slice
   per arm: GASLoC's default, DiLoCo Nesterov 0.7/0.9, DiLoCo plain averaging.
5. ``ring16-h1``, ``ring16-h5``: the GASLoC paper's regime, a ring of 16 workers at 25M with 1
   and 5 local steps per exchange, gamma 0 against 0.5, 0.7 and 0.9 (mixed momentum at equal
   effective step): consensus distance and loss. The first window measured 0.42 steps/s an arm
   with four side by side (H = 1), so 300 steps would take 13 minutes: 120 steps (H = 1) and
   150 (H = 5).
6. ``throughput-135m``, ``throughput-1b``: tokens/s and model FLOP utilisation with the
   fastest settings a user can choose (``--compile``, micro-batch; SDPA attention and the
   chunked cross-entropy are always on).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from benchmarks import repro_ladder
from benchmarks.gpu_queue import Arm, Slice
from gasloc_p2p.sim.config import SimConfig

SIM_SMOKE = {"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 32, "batch_size": 4,
             "steps": 4, "eval_every": 2, "eval_batches": 2, "trace_batches": 1,
             "device": "cpu", "precision": "fp32", "data": "@smoke-corpus"}


def _sim_arms(rows: list[tuple[str, SimConfig]], seed: int, **change: Any) -> tuple[Arm, ...]:
    return tuple(Arm(label, dataclasses.asdict(dataclasses.replace(cfg, seed=seed, **change)))
                 for label, cfg in rows)


def _ladder(part: str, seed: int) -> Slice:
    size, cfg = repro_ladder.RUNGS[part]
    estimate = {"ladder-5m": (7.2, "estimated: 5 x 66M tokens, launch-bound"),
                "ladder-25m": (4.5, "estimated: 5 x 33M tokens at 250 TFLOP/s")}[part]
    return Slice(f"{part}-s{seed}", part, f"The size ladder at {size}: five outer steps, "
                 f"seed {seed}", "sim", *estimate, _sim_arms(repro_ladder.rows(part), seed),
                 seed, dict(SIM_SMOKE, workers=2))


def _concurrency() -> Slice:
    rows = repro_ladder.rows("ladder-5m")
    return Slice("concurrency", "concurrency", "One ladder arm alone, then beside four others "
                 "(same seed): the same loss?", "concurrency", 3.5,
                 "estimated: 2 phases of 400 steps, and the corpus build",
                 _sim_arms(rows, 0, steps=400, eval_every=100), 0,
                 dict(SIM_SMOKE, workers=2, arms=2))


def _ring16(H: int) -> Slice:
    _, rung = repro_ladder.RUNGS["ladder-25m"]
    base = dataclasses.replace(rung, algorithm="gasloc", workers=16, graph="ring", H=H,
                               steps=120 if H == 1 else 150, eval_every=40 if H == 1 else 50)
    rows = [(f"ring16 H{H} g0 eta1 (plain pair averaging)", base),
            *((f"ring16 H{H} g{g:g} eta{1 - g:.1g} (mixed momentum)",
               dataclasses.replace(base, gamma=g, eta=round(1 - g, 6))) for g in (0.5, 0.7, 0.9))]
    return Slice(f"ring16-h{H}", f"ring16-h{H}", f"A ring of 16 at 25M, H = {H}: outer momentum "
                 "against plain gossip", "sim", 5.7 if H == 1 else 5.5,
                 "estimated: 0.42 steps/s an arm, 4 arms (H200, H=1)",
                 _sim_arms(rows, 0), 0, dict(SIM_SMOKE, workers=4))


SWARM_ARMS = {
    "gasloc": ("GASLoC (defaults: plain pair averaging, int8 gossip)", "gasloc"),
    "diloco-nesterov": ("DiLoCo, Nesterov 0.7/0.9 (fp32 all-reduce)", "gasloc-diloco"),
    "diloco-avg": ("DiLoCo, plain averaging (fp32 all-reduce)", "gasloc-diloco-avg"),
}
SWARM = {"nodes": 4, "model": "llama-135m", "precision": "bf16", "compile": True,
         "seq_len": 512, "batch_size": 8, "inner_steps": 50, "max_time_s": 240, "rate_mbit": 100,
         "eval_every": 100, "eval_batches": 4, "corpus_mb": 48}
# one node an arm at smoke size: the queue's own code (flags the node must accept, the
# runners, figures, records) end to end; exchanges between nodes have their own swarm tests
SWARM_SMOKE = {"nodes": 1, "model": "gpt", "precision": "fp32", "compile": False, "seq_len": 32,
               "batch_size": 4, "inner_steps": 5, "max_time_s": 0, "max_steps": 20,
               "rate_mbit": 0, "eval_every": 10, "eval_batches": 2, "corpus_mb": 0.2,
               # two nodes that start seconds apart: DiLoCo's first sync gives up sooner
               "extra_flags": ["--averaging-timeout-s", "4", "--matchmaking-time-s", "2",
                               "--request-timeout-s", "1"]}


def _swarm(arm: str) -> Slice:
    label, system = SWARM_ARMS[arm]
    return Slice(f"swarm-{arm}", "swarm-135m", "4 real nodes on one GPU, 135M Llama, 100 "
                 f"Mbit/s links: {label}", "swarm", 5.5,
                 "estimated: start and compile 1.5 min, 4 min train",
                 (Arm(label, {**SWARM, "system": system}),), 0, SWARM_SMOKE)


PAYLOAD_CODECS = ("int8", "int4", "sign1", "half2")


def _payloads() -> Slice:
    """Issue 40's GPU figures: one exchange's tensor work per codec at 135M against a device
    copy of the model (target: at most 5x, as int8's kernels reach), and the CUDA tests of the
    streamed payloads (int8 through its kernels, int4 through the eager passes)."""
    arms = (Arm("CUDA tests: tests/test_streamed.py", {"tests": ["tests/test_streamed.py"]}),
            *(Arm(f"{codec} exchange at 135M", {"codec": codec, "numel": 135_000_000})
              for codec in PAYLOAD_CODECS))
    return Slice("payloads", "payloads", "Payload codecs on the GPU: one exchange's tensor work "
                 "against a device copy, and the streamed payloads' CUDA tests", "engine", 2.0,
                 "estimated: 4 processes of about 20 s, the tests a minute", arms, 0,
                 {"numel": 100_000, "device": "cpu"})


THROUGHPUT = {
    "throughput-135m": ("llama-135m", [("eager, micro-batch 8 x 512", 8, 512, False),
                                       ("--compile, micro-batch 8 x 512", 8, 512, True),
                                       ("--compile, micro-batch 16 x 512", 16, 512, True)]),
    "throughput-1b": ("llama-1b", [("--compile, micro-batch 1 x 2048, activation "
                                    "checkpointing", 1, 2048, True),
                                   ("--compile, micro-batch 2 x 2048, activation "
                                    "checkpointing", 2, 2048, True)]),
}


def _throughput(name: str) -> Slice:
    model, settings = THROUGHPUT[name]
    arms = tuple(Arm(label, {"model": model, "micro_batch": mb, "seq_len": seq,
                             "compile": comp, "steps": 60, "warmup": 8})
                 for label, mb, seq, comp in settings)
    return Slice(name, "throughput", f"Tokens/s and MFU of a {model} node, fastest settings",
                 "throughput", 4.5 if name.endswith("135m") else 5.5,
                 "estimated: one compile a minute (1B: 2.5)", arms, 0,
                 {"model": "llama-tiny", "steps": 3, "warmup": 1, "compile": False})


QUEUE: tuple[Slice, ...] = (
    _concurrency(),
    _ladder("ladder-5m", 0),
    _ladder("ladder-25m", 0),
    _payloads(),
    *(_swarm(arm) for arm in SWARM_ARMS),
    _ring16(1),
    _ring16(5),
    _throughput("throughput-135m"),
    _throughput("throughput-1b"),
    *(_ladder(part, seed) for seed in (1, 2, 3, 4) for part in ("ladder-5m", "ladder-25m")),
)
