"""Gossip codecs on home-scaled links, real processes: time to int8's loss and bytes per node.

Usage (root, iproute2): python -m benchmarks.bench_home_gossip [--nodes 4] [--rate-mbit 0.3]
        [--slow-factor 1] [--codecs int8 half2] [--reps 3] [--minutes 8] [-- more join flags]

Issue 40, item 4: the regime where bytes set the wall clock. Every node runs ``gasloc-node
join`` (gossip, the test model) in its own network namespace (:mod:`benchmarks.tools.netns`);
once all are up (the joiners download the first node's state on unshaped links), every node's
egress to its peers is shaped (HTB, :meth:`benchmarks.tools.netns.Host.shape`) to
``--rate-mbit`` (``--slow-factor K``: node 0's to 1/K of it, the uneven case) and the run goes
on for ``--minutes``. Pick the rate so that one int8 exchange takes 1-4 rounds of compute: the
table prints each codec's payload time on the shaped link and the nodes' steps per second.
Each repetition runs every codec once, one after the other, on the same network; rows of one run are compared (shared 2-core machines vary by about 30%).

Every few seconds the bench reads each node's Info: its validation loss (its own periodic
evaluation), bytes sent and exchanges. Per codec and repetition: the nodes' mean final loss,
bytes per node, exchanges per node and the time until the nodes' mean loss first reached the
target, the int8 run's final mean loss of the same repetition (``--codecs`` starts with the
reference). Printed as a table; ``--out FILE`` keeps every sample as JSON.

A codec named ``NAME@free`` runs on unshaped links: ``int8@free`` is the bound of any payload
(an exchange then costs its compute and latency, not its bytes), so ``--codecs int8 half2
int8@free`` says how much of what bytes cost a codec won back.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from benchmarks.bench_streaming_link import NsNode, say, start_nodes
from benchmarks.tools.netns import ShapedNetwork, netns_unavailable
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.data import ensure_shakespeare

FLAGS = ["--torch-threads", "1", "--log-interval-s", "30", "--n-layer", "4", "--seq-len", "64",
         "--batch-size", "4", "--warmup-steps", "10"]
POLL_S = 5.0
FREE = "@free"  # a codec on unshaped links: what free bytes would buy


def codec_name(arm: str) -> str:
    """The ``--codec`` of an arm (``int8@free``: int8, on unshaped links)."""
    return arm.removesuffix(FREE)


def run_codec(net: ShapedNetwork, codec: str, flags: list[str], args: argparse.Namespace,
              log_dir: Path) -> list[dict[str, float]]:
    """One swarm with ``--codec codec``: samples of (t, mean loss, bytes/node, exchanges/node)
    from the moment the links are shaped."""
    hosts = net.hosts
    nodes: list[NsNode] = []
    samples: list[dict[str, float]] = []
    try:
        start_nodes(hosts, log_dir, [*flags, "--codec", codec_name(codec)], nodes)
        free = codec.endswith(FREE)
        for k, h in enumerate(hosts):  # the bench's Info calls unshaped
            if not free:
                h.shape(args.rate_mbit / (args.slow_factor if k == 0 else 1.0), net.gateway)
        say(f"{codec}: {len(nodes)} nodes up, links {'unshaped' if free else 'shaped'}; "
            f"running {args.minutes:g} min")
        t0 = time.monotonic()
        first = [n.info() for n in nodes]
        while time.monotonic() - t0 < args.minutes * 60:
            time.sleep(POLL_S)
            try:
                infos = [n.info() for n in nodes]
            except (grpc.RpcError, OSError) as exc:  # a late reply: the next poll reads it
                say(f"{codec}: an Info call failed ({type(exc).__name__}); sample skipped")
                continue
            losses = [i.val_loss for i in infos if i.val_loss > 0]
            samples.append({
                "t": time.monotonic() - t0,
                "loss": statistics.fmean(losses) if len(losses) == len(infos) else float("nan"),
                "bytes_per_node": statistics.fmean(b.bytes_sent - a.bytes_sent
                                                   for a, b in zip(first, infos, strict=True)),
                "exchanges_per_node": statistics.fmean(
                    b.exchanges_ok_initiator + b.exchanges_ok_responder
                    - a.exchanges_ok_initiator - a.exchanges_ok_responder
                    for a, b in zip(first, infos, strict=True)),
                "steps": statistics.fmean(i.step for i in infos),
            })
    finally:
        for n in nodes:
            n.stop(30)
        for h in hosts:
            h.shape(None)
    return samples


CLIPPED = re.compile(r"exchange (?:to|from) \S+ clipped: .* weight x([0-9.e+-]+)")


def guard_weights(log_dir: Path) -> dict[str, float]:
    """From the nodes' logs: how many committed exchanges the update guard clipped (from the
    start, a few before the links were shaped) and the mean factor it left on their weight
    (its trust ramp for keys with few exchanges, its budgets, its distance limit:
    protocol/guard.py)."""
    factors = []
    for path in sorted(log_dir.glob("n*.err")):
        factors += [float(f) for f in CLIPPED.findall(path.read_text(errors="replace"))]
    return {"clipped": len(factors), "clip_factor": statistics.fmean(factors) if factors else 1.0}


def time_to(samples: list[dict[str, float]], target: float) -> float | None:
    for s in samples:
        if s["loss"] <= target:  # NaN (a node not evaluated yet) never counts
            return s["t"]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rate-mbit", type=float, default=0.3, help="egress of every node")
    parser.add_argument("--slow-factor", type=float, default=1.0,
                        help="node 0's egress is --rate-mbit / this (the uneven case: 10)")
    parser.add_argument("--codecs", nargs="+", default=["int8", "half2"],
                        help="--codec of every node, one swarm each (the first is the "
                             "reference; NAME@free: on unshaped links, the bound)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--minutes", type=float, default=8.0, help="per swarm, shaped")
    parser.add_argument("--eval-interval-steps", type=int, default=50)
    parser.add_argument("--data", default="", help="corpus (default: Shakespeare, fetched here "
                        "once: the namespaces reach nothing but each other)")
    parser.add_argument("--log-dir", default="", help="keep the nodes' logs here")
    parser.add_argument("--out", default="", help="write every sample here (JSON)")
    parser.add_argument("--report", default="", metavar="FILE",
                        help="print the table of an earlier run's --out file; run nothing")
    parser.add_argument("extra", nargs="*", help="more gasloc-node join flags (after --)")
    args = parser.parse_args()
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        print("\n".join(table(saved["runs"], saved.get("guard", {}), saved["args"])))
        return
    reason = netns_unavailable()
    if reason is not None:
        sys.exit(f"bench_home_gossip: {reason}")
    for codec in args.codecs:
        CodecSpec.of(codec_name(codec))  # a bad name fails here, not in the nodes
    data = args.data or str(ensure_shakespeare())
    # deadlines follow the slowest link a node plans for (--min-link-mbps, default 10): here
    # the shaped one, or every payload would time out (a user on such a link sets it too)
    slowest = args.rate_mbit / args.slow_factor
    flags = [*FLAGS, "--data", data, "--eval-interval-steps", str(args.eval_interval_steps),
             "--min-link-mbps", f"{slowest:g}", *args.extra]
    print(f"{args.nodes} nodes, each in its own namespace, egress to peers {args.rate_mbit:g} Mbit/s"
          + (f" (node 0: 1/{args.slow_factor:g} of it)" if args.slow_factor != 1 else "")
          + f"; codecs {' '.join(args.codecs)}; {args.reps} repetitions of {args.minutes:g} min",
          flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("bench_home_gossip: terminated"))
    runs: dict[str, list[list[dict[str, float]]]] = {c: [] for c in args.codecs}
    guard: dict[str, list[dict[str, float]]] = {c: [] for c in args.codecs}
    with ShapedNetwork([None] * args.nodes) as net, tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for codec in args.codecs:
                log_dir = (Path(args.log_dir) if args.log_dir else Path(tmp)) / f"{codec}-{rep}"
                log_dir.mkdir(parents=True, exist_ok=True)
                runs[codec].append(run_codec(net, codec, flags, args, log_dir))
                guard[codec].append(guard_weights(log_dir))
                last = runs[codec][-1][-1] if runs[codec][-1] else {}
                say(f"{codec} repetition {rep}: final loss {last.get('loss', float('nan')):.3f}, "
                    f"{last.get('bytes_per_node', 0) / 1e6:.1f} MB and "
                    f"{last.get('exchanges_per_node', 0):.0f} exchanges per node")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs,
                                              "guard": guard}))
    print("\n" + "\n".join(table(runs, guard, vars(args))))


def table(runs: dict[str, list[list[dict[str, float]]]], guard: dict[str, list[dict[str, float]]],
          args: dict[str, Any]) -> list[str]:
    """The printed table (markdown) of ``runs`` (per codec, per repetition, the samples),
    ``guard`` (per codec, per repetition, :func:`guard_weights`) and the run's arguments.
    Besides the final loss, the loss at the most steps every run reached: runs on a shared
    machine differ in speed, and a faster run's final loss is lower for its steps alone."""
    codecs = list(runs)
    ref = codecs[0]
    every = [r for reps in runs.values() for r in reps if r]
    common = min((r[-1]["steps"] for r in every), default=0.0)
    lines = [f"| codec | final loss (mean over repetitions) | loss at step {common:.0f} | MB sent "
             f"per node | exchanges per node | payload s on the link | steps/s per node | s to "
             f"{ref}'s final loss (reached) | time vs {ref} | clipped by the guard | mean "
             "factor when clipped |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for codec in codecs:
        finals = [r[-1] for r in runs[codec] if r]
        times, base = [], []
        for rep, samples in enumerate(runs[codec]):
            ref_samples = runs[ref][rep]
            if not ref_samples or not samples:
                continue
            target = ref_samples[-1]["loss"]
            times.append(time_to(samples, target))
            base.append(time_to(ref_samples, target))
        got = [t for t in times if t is not None]
        ratio = (f"{sum(got) / sum(b for b in base if b is not None):.2f}x"
                 if got and len(got) == len(times) and None not in base else "n/a")
        sent = statistics.fmean(f["bytes_per_node"] for f in finals)
        count = statistics.fmean(f["exchanges_per_node"] for f in finals)
        payload_s = (sent / max(count, 1) * 8 / (args["rate_mbit"] * 1e6)
                     if not codec.endswith(FREE) else 0.0)  # (unshaped: not the link's)
        rate = statistics.fmean(f["steps"] / f["t"] for f in finals)
        at = statistics.fmean(loss_at(r, common) for r in runs[codec] if r)
        lines.append(
            f"| {codec} | {statistics.fmean(f['loss'] for f in finals):.3f} | {at:.3f} | "
            f"{sent / 1e6:.1f} | {count:.0f} | {payload_s:.1f} | {rate:.2f} | "
            f"{statistics.fmean(got) if got else float('nan'):.0f} ({len(got)}/{len(times)})"
            f" | {ratio} | {clipped(guard.get(codec), count * args['nodes'] * len(finals))} |")
    return lines


def loss_at(samples: list[dict[str, float]], step: float) -> float:
    """The first evaluated loss once the nodes' mean step reached ``step`` (NaN: never)."""
    for s in samples:
        if s["steps"] >= step and s["loss"] == s["loss"]:
            return s["loss"]
    return float("nan")


def clipped(rows: list[dict[str, float]] | None, sides: float) -> str:
    """The guard's clipped exchange sides per committed side (each exchange counts once on
    either node) and their mean factor, over the repetitions (n/a: not recorded)."""
    if not rows:
        return "n/a | n/a"
    cut = sum(r["clipped"] for r in rows)
    mean = (sum(r["clip_factor"] * r["clipped"] for r in rows) / cut) if cut else 1.0
    return f"{cut / max(sides, 1):.0%} | {mean:.2f}"


if __name__ == "__main__":
    main()
