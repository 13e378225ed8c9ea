"""`gasloc-node sim`: flags for every SimConfig field, several algorithms and seeds per call."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from gasloc_p2p.data.corpus import DataError, check_data_path
from gasloc_p2p.flags import Option, add_flags, given, options
from gasloc_p2p.sim.config import ALGORITHMS, SimConfig

SKIP = ("algorithm", "seed")  # the command takes lists: --algorithms, --seeds


def add_sim_parser(sub: Any) -> None:
    p = sub.add_parser("sim", help="simulate a swarm in one process (no sockets)",
                       description="Simulate N workers on one machine and compare algorithms on "
                       "the same seed and data. Writes JSON results and a PNG plot.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithms", default="gasloc,diloco",
                   help=f"comma-separated, compared on one plot: {', '.join(ALGORITHMS)}")
    p.add_argument("--seeds", default="0", help="comma-separated seeds; each algorithm per seed")
    p.add_argument("--out", type=Path, default=Path("runs/sim"), help="output directory")
    p.add_argument("--name", default="sim", help="base name of the JSON and PNG files")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_flags(p, sim_options(), skip=SKIP)
    p.set_defaults(func=run_sim)


def sim_options() -> dict[str, Option]:
    return options({"sim": SimConfig})


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


# Flags that only some algorithms or modes read. In a comparison (--algorithms gasloc,diloco)
# each run takes the ones that apply to it; a single run is refused a flag it would ignore.
ASYNC_ONLY = ("participations_per_round", "starts_per_round")
GOSSIP_ONLY = ("w", "graph", "matching", "momentum", "reference")


def applicable(flags: dict[str, Any], algo: str, mode: str) -> dict[str, Any]:
    """The flags of ``flags`` that run ``algo`` in ``mode`` reads."""
    drop = set(ASYNC_ONLY) if mode == "sync" else {"matching"}
    if algo not in ("gasloc", "gossip-sgd"):
        drop |= set(GOSSIP_ONLY)
    if algo not in ("diloco", "streaming-diloco"):
        drop.add("ef_beta")
    if algo != "streaming-diloco":
        drop |= {"tau", "alpha"}
        if not (algo == "gasloc" and mode == "async"):
            drop.add("fragments")
    return {k: v for k, v in flags.items() if k not in drop}


def configs_from_args(args: argparse.Namespace) -> list[SimConfig]:
    base = given(args, sim_options())
    base.pop("mode", None)
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    seeds = _int_list(args.seeds)
    cfgs = []
    for seed in seeds:
        for algo in algorithms:
            mode = (getattr(args, "mode", "sync") if algo in ("gasloc", "gossip-sgd", "local")
                    else "sync")
            flags = applicable(base, algo, mode) if len(algorithms) > 1 else base
            cfg = SimConfig(**flags, mode=mode, algorithm=algo, seed=seed)
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
    try:
        for cfg in cfgs:
            if cfg.data:
                check_data_path(cfg.data)
        for cfg in cfgs:
            results.append(run(cfg, progress=None if args.no_progress else _bar(cfg)))
            _print_final(results[-1], cfg)
    except DataError as exc:  # one line naming the flag, as for a bad flag
        print(f"gasloc-node sim: error: {exc}", file=sys.stderr)
        return 2
    path = write_results(results, args.out, args.name)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


def _print_final(result: dict[str, Any], cfg: SimConfig) -> None:
    final = result["final"]
    print(f"{result['label']:<40} seed {cfg.seed}: val loss {final['val_loss']:.3f} "
          f"(worst worker {final['worst_val_loss']:.3f}), consensus "
          f"{final['consensus']:.2e}, {final['sim_seconds']:.0f} sim s, "
          f"{final['bytes_per_worker'] / 1e6:.1f} MB/worker, "
          f"{result['wall_seconds']:.0f} s wall")


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
