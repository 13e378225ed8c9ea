"""A quick screen of gossip and DiLoCo payloads (issue 24) before the full study
(benchmarks/repro_codecs.py): one seed, short runs, one line per configuration.

Usage: ``python -m benchmarks.screen_codecs [--steps 300] [--workers 8] [--seed 0]
[--only NAME,NAME]``. A screen ranks candidates roughly (one seed differs from another by
about 0.1 nats at 300 steps); only the study's paired runs decide.
"""

from __future__ import annotations

import argparse
import time

from gasloc_p2p.sim.config import SimConfig
from gasloc_p2p.sim.run import run

DILOCO = {"algorithm": "diloco", "eta": 1.0, "gamma": 0.0}
ROWS: list[tuple[str, dict[str, object]]] = [
    ("int8", {"codec": "int8"}),
    ("int4", {"codec": "int4"}),
    ("local", {"algorithm": "local"}),
    ("randk8:123 theta0", {"codec": "randk8:123"}),
    ("randk8:41 theta0", {"codec": "randk8:41"}),
    ("randk8:410 theta0", {"codec": "randk8:410"}),
    ("randk2:160 theta0", {"codec": "randk2:160"}),
    ("randk2:410 theta0", {"codec": "randk2:410"}),
    ("randk2:512 theta0", {"codec": "randk2:512"}),
    ("randk2:64:512 theta0", {"codec": "randk2:64:512"}),
    ("randk2:1229 theta0", {"codec": "randk2:1229"}),
    ("randk1:1024 theta0", {"codec": "randk1:1024"}),
    ("topk8:41 theta0", {"codec": "topk8:41"}),
    ("dense2 theta0", {"codec": "dense2"}),
    ("topk2:41 link", {"codec": "topk2:41", "reference": "link"}),
    ("randk8:123 link", {"codec": "randk8:123", "reference": "link"}),
    ("randk2:512 link", {"codec": "randk2:512", "reference": "link"}),
    ("randk1:1024 link", {"codec": "randk1:1024", "reference": "link"}),
    ("dense2 link", {"codec": "dense2", "reference": "link"}),
    ("diloco none", {**DILOCO, "codec": "none"}),
    ("diloco topk2:41", {**DILOCO, "codec": "topk2:41"}),
    ("diloco topk1:41", {**DILOCO, "codec": "topk1:41"}),
    ("diloco topk2:123", {**DILOCO, "codec": "topk2:123"}),
    ("diloco dense2", {**DILOCO, "codec": "dense2"}),
    ("diloco dense2:256", {**DILOCO, "codec": "dense2:256"}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="comma-separated row names")
    args = parser.parse_args()
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    for name, kw in ROWS:
        if only and name not in only:
            continue
        cfg = SimConfig(**{"algorithm": "gasloc", **kw}, workers=args.workers,  # type: ignore[arg-type]
                        steps=args.steps, H=10, seed=args.seed,
                        eval_every=max(1, args.steps // 2), eval_batches=32, trace_batches=0,
                        eval_workers=False, threads=1)
        started = time.time()
        final = run(cfg)["final"]
        print(f"{name:22s} loss {final['val_loss']:.3f} consensus {final['consensus']:.3g} "
              f"MB/worker {final['bytes_per_worker'] / 1e6:.3f} ({time.time() - started:.0f} s)",
              flush=True)


if __name__ == "__main__":
    main()
