"""Project compute utilization past one machine: GASLoC, DiLoCo and Streaming DiLoCo at
n = 64 and 256 against link speed, from the profile measured on real nodes, and for a
1B-parameter model (``benchmarks.projection``; timing only, no training).

The measured profile comes from a ``bench_external.py`` run with the no-gossip control
(``make bench-pacing`` writes ``docs/results/pacing.json``): the step time is the control's
(``gasloc-solo``) tokens/s per node; the work one exchange takes from training is what the
default GASLoC lost against the control, divided by its exchanges per node per round (payload
bytes it sent / bytes of one payload). The 1B profile's numbers are assumptions, printed with
the table. Writes ``docs/results/projection.{json,md,png}``; about a minute.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.projection import Profile, min_link_for, project
from gasloc_p2p.core.codecs import get_codec

ROOT = Path(__file__).resolve().parents[1]

METHODS = ("gasloc", "gasloc-paced", "diloco", "streaming-diloco")
LINKS_MBIT = (1.0, 5.0, 10.0, 100.0, 1000.0)
UTILIZATIONS = (0.5, 0.8, 0.9, 0.95, 0.99)
MBIT = 1e6 / 8  # bytes/s per Mbit/s


def suite_numel() -> int:
    """Parameters of the external suite's GPT (2 layers x 128, vocabulary 256, context 64)."""
    from benchmarks.external.common import Spec
    from gasloc_p2p.model import GPTConfig, build_model
    s = Spec()
    cfg = GPTConfig(vocab_size=256, seq_len=s.seq_len, n_layer=s.n_layer, n_embd=s.n_embd,
                    n_head=s.n_head)
    return sum(p.numel() for p in build_model(cfg, 0).parameters())


def measured_profile(path: Path, name: str = "measured") -> tuple[dict[str, Any], str]:
    """Step time, payload and exchange work from a bench_external run with gasloc-solo."""
    from benchmarks.external.aggregate import summarize
    results = json.loads(path.read_text())
    spec = results["spec"]
    numel = suite_numel()
    payload = get_codec("int8").wire_bytes(numel)
    steps_s, works, rates = [], [], []
    for runs in results["runs"].values():
        rows = {r["system"]: r for r in summarize(runs)["rows"]}
        solo, gossip = rows.get("gasloc-solo"), rows.get("gasloc")
        if not solo or not gossip:
            continue
        tokens_per_step = spec["batch_size"] * spec["seq_len"]
        step_s = tokens_per_step / solo["tokens_per_s_per_node"]
        u = gossip["tokens_per_s_per_node"] / solo["tokens_per_s_per_node"]
        rounds = spec["steps"] / spec["inner_steps"]
        per_round = gossip["program_mb_per_node"] * 1e6 / payload / rounds
        steps_s.append(step_s)
        rates.append(per_round)
        works.append(max(0.0, 1 / u - 1) * step_s * spec["inner_steps"] / per_round)
    if not steps_s:
        raise SystemExit(f"{path}: no repetition with both gasloc and gasloc-solo")
    mean = sum(steps_s) / len(steps_s), sum(works) / len(works), sum(rates) / len(rates)
    prof = {"name": name, "numel": numel, "step_s": mean[0], "inner_steps":
            spec["inner_steps"], "payload_bytes": payload, "work_s": mean[1],
            "measured_participations_per_round": mean[2]}
    how = (f"from {path.name} ({len(steps_s)} repetitions, {spec['nodes']} real nodes, uneven "
           f"links): GPT {numel:,} parameters, int8 payload {payload / 1e6:.3f} MB, step "
           f"{mean[0] * 1e3:.1f} ms (no-gossip control), H = {spec['inner_steps']}, exchange "
           f"work {mean[1] * 1e3:.1f} ms of training time per participation (default GASLoC: "
           f"{mean[2]:.2f} participations per node per round)")
    return prof, how


def exchange_work_s(numel: int, repeats: int = 12) -> float:
    """Node time one participation's work takes on one thread of this machine, measured: the
    daemon's protocol and engine (``ProtocolExchanger``: snapshot, encode, guard, decode,
    fold, apply; int8 payloads) between two in-memory node states with the
    suite GPT's size, half of one exchange's time (each exchange is two participations)."""
    import torch

    from gasloc_p2p.core.async_state import AsyncConfig, AsyncGaslocState
    from gasloc_p2p.core.codecs import CodecSpec
    from gasloc_p2p.core.flat import whole
    from gasloc_p2p.sim.exchange import ProtocolExchanger

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    theta0 = torch.randn(numel, generator=gen) * 0.02
    cfg = AsyncConfig(eta=1.0, gamma=0.0)
    states = [AsyncGaslocState(theta0.clone(), theta0, cfg) for _ in range(2)]
    ex = ProtocolExchanger(states, theta0, [whole(numel)], CodecSpec.parse("int8"), cfg.w)
    times = []
    for k in range(repeats + 2):
        for st in states:  # some drift, as after inner steps
            st.theta.add_(torch.randn(numel, generator=gen) * 1e-3)
        started = time.perf_counter()
        ex.commit(ex.begin(k % 2, 1 - k % 2, 0))
        if k >= 2:  # two warm-up exchanges
            times.append(time.perf_counter() - started)
    times.sort()
    return times[len(times) // 2] / 2


def billion_profile(step_s: float, inner_steps: int, work_s: float) -> tuple[dict[str, Any], str]:
    numel = 10**9
    payload = get_codec("int8").wire_bytes(numel)
    prof = {"name": "1B", "numel": numel, "step_s": step_s, "inner_steps": inner_steps,
            "payload_bytes": payload, "work_s": work_s}
    how = (f"assumed: 1B parameters, int8 payload {payload / 1e9:.3f} GB for every method (torchft's "
           f"DiLoCo sends fp32: 4x), step {step_s:g} s (128k tokens per step at 6 N FLOPs per "
           f"token on one H100 at 40% MFU is about 2 s), H = {inner_steps}, exchange work "
           f"{work_s:g} s per participation (device codecs)")
    return prof, how


def profile_at(prof: dict[str, Any], nodes: int, links: tuple[float, ...]) -> Profile:
    return Profile(nodes=nodes, step_s=prof["step_s"], inner_steps=prof["inner_steps"],
                   payload_bytes=prof["payload_bytes"], allreduce_bytes=prof["payload_bytes"],
                   link_bps=links, work_s=prof["work_s"])


def link_cases(nodes: int) -> list[tuple[str, tuple[float, ...]]]:
    cases = [(f"{m:g}", (m * MBIT,) * nodes) for m in LINKS_MBIT]
    slow = nodes // 4  # the suite's uneven case: a quarter of the nodes at 5, the rest at 100
    cases.append(("uneven 100/5", (100 * MBIT,) * (nodes - slow) + (5 * MBIT,) * slow))
    return cases


def run(prof: dict[str, Any], sizes: list[int]) -> dict[str, Any]:
    rows, needed = [], []
    for n in sizes:
        for label, links in link_cases(n):
            p = profile_at(prof, n, links)
            row: dict[str, Any] = {"nodes": n, "links_mbit": label}
            for m in METHODS:
                q = project(m, p)
                row[m] = {"utilization": q.utilization, "exchange_s": q.exchange_s,
                          "participations_per_round": q.participations_per_round}
            rows.append(row)
        base = profile_at(prof, n, (MBIT,) * n)
        for u in UTILIZATIONS:
            # paced GASLoC holds utilization by gossiping less: "the link it needs" is not
            # a question it answers, its rows above show what it gives up instead
            need = {m: min_link_for(m, base, u) for m in METHODS if m != "gasloc-paced"}
            needed.append({"nodes": n, "utilization": u,
                           **{m: (b / MBIT if b else None) for m, b in need.items()}})
    return {"profile": prof, "rows": rows, "needed_mbit": needed}


def _f(v: float | None, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown(name: str, how: str, res: dict[str, Any]) -> str:
    lines = [f"### {name}", "", how, "",
             "| n | link Mbit/s | DiLoCo util | Streaming DiLoCo util | GASLoC util | GASLoC "
             "participations / node / round | GASLoC paced util | paced participations | "
             "GASLoC exchange s | DiLoCo sync s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        g, gp, d, s = r["gasloc"], r["gasloc-paced"], r["diloco"], r["streaming-diloco"]
        lines.append(f"| {r['nodes']} | {r['links_mbit']} | {_f(d['utilization'], '.1%')} | "
                     f"{_f(s['utilization'], '.1%')} | {_f(g['utilization'], '.1%')} | "
                     f"{_f(g['participations_per_round'], '.2f')} | "
                     f"{_f(gp['utilization'], '.1%')} | "
                     f"{_f(gp['participations_per_round'], '.2f')} | {_f(g['exchange_s'], '.3g')} | "
                     f"{_f(d['exchange_s'], '.3g')} |")
    lines += ["", "Uniform link rate (Mbit/s) needed for a compute utilization (GASLoC: and at "
              "least one participation per node per round; '-': not reached at any rate, the "
              "exchange work alone costs more):", "",
              "| n | utilization | DiLoCo | Streaming DiLoCo | GASLoC |", "|---|---|---|---|---|"]
    for r in res["needed_mbit"]:
        lines.append(f"| {r['nodes']} | {r['utilization']:.0%} | {_f(r['diloco'], '.3g')} | "
                     f"{_f(r['streaming-diloco'], '.3g')} | {_f(r['gasloc'], '.3g')} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Top: compute utilization against the link rate; bottom: what GASLoC's overlap pays
    for it, the gossip exchanges a node takes part in per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = len(results)
    fig, axes = plt.subplots(2, cols, figsize=(6 * cols, 7.5), squeeze=False, sharex=True)
    colors = dict(zip(METHODS, ("C0", "C3", "C1", "C2"), strict=True))
    for k, (name, res) in enumerate(results.items()):
        top, bottom = axes[0][k], axes[1][k]
        for n, style in ((64, "-"), (256, "--")):
            rows = [r for r in res["rows"] if r["nodes"] == n and r["links_mbit"] != "uneven 100/5"]
            x = [float(r["links_mbit"]) for r in rows]
            for m in METHODS:
                top.plot(x, [r[m]["utilization"] for r in rows], style, color=colors[m],
                         label=f"{m} n={n}")
            for m in ("gasloc", "gasloc-paced"):
                bottom.plot(x, [r[m]["participations_per_round"] for r in rows], style,
                            color=colors[m], label=f"{m} n={n}")
        top.set(xscale="log", ylabel="compute utilization", title=name)
        bottom.set(xscale="log", yscale="log", xlabel="link rate, Mbit/s (every node)",
                   ylabel="gossip participations / node / round")
        bottom.axhline(1.0, color="k", lw=0.5, ls=":")
        top.legend(fontsize=7)
        bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--measured", default="docs/results/pacing.json",
                   help="a bench_external run with gasloc and gasloc-solo")
    p.add_argument("--measured-dedicated", default="docs/results/pacing-2nodes.json",
                   help="the same with a core per node ('' to skip)")
    p.add_argument("--nodes", default="64,256")
    p.add_argument("--billion-step-s", type=float, default=2.0)
    p.add_argument("--billion-inner-steps", type=int, default=100)
    p.add_argument("--billion-work-s", type=float, default=0.2)
    p.add_argument("--out", default="docs/results")
    args = p.parse_args(argv)
    started = time.monotonic()
    sizes = [int(x) for x in args.nodes.split(",")]
    measured, how = measured_profile(ROOT / args.measured)
    work = exchange_work_s(measured["numel"])
    dedicated = {**measured, "name": "engine-only", "work_s": work}
    dedicated.pop("measured_participations_per_round")
    how_dedicated = (f"the same step time and payload, exchange work {work * 1e3:.1f} ms per "
                     f"participation: the daemon's engine alone (snapshot, encode, guard, "
                     f"decode, fold, apply) between two in-memory nodes on one thread, median "
                     f"of 12. A lower bound: gRPC, serialization and the event loop are not in "
                     f"it, nor contention; the measured profile above (everything gossip cost "
                     f"4 nodes sharing 2 cores) is the upper one")
    extra = []
    if args.measured_dedicated:
        own, how_own = measured_profile(ROOT / args.measured_dedicated, "core-per-node")
        own.pop("measured_participations_per_round")
        extra.append((own, how_own + ": each node with a core of its own, as volunteers' "
                      "machines are"))
    profiles = [(measured, how), *extra, (dedicated, how_dedicated),
                billion_profile(args.billion_step_s, args.billion_inner_steps,
                                args.billion_work_s)]
    results, text = {}, []
    for prof, how in profiles:
        res = run(prof, sizes)
        res["how"] = how
        results[prof["name"]] = res
        text.append(markdown(f"{prof['name']} profile", how, res))
    # the model against the run it was fitted on: 4 nodes, the suite's uneven links
    check = project("gasloc", profile_at(profiles[0][0], 4, (100 * MBIT,) * 3 + (5 * MBIT,)))
    measured = profiles[0][0]["measured_participations_per_round"]
    note = (f"Check at n = 4 on the measured uneven links: the model gives "
            f"{check.participations_per_round:.2f} participations per node per round at 2 "
            f"starts per round, the run measured {measured:.2f}.")
    command = "python -m benchmarks.bench_projection " + " ".join(argv or sys.argv[1:])
    header = ["# Projection past one machine", "", f"`{command.strip()}` "
              f"({time.monotonic() - started:.0f} s). Timing model: "
              "`benchmarks/projection.py` (GASLoC event-driven, 40 rounds after 5 of "
              "warm-up, seed 0, 2 starts per round; paced: the most starts per round, down to "
              "0.5, that keep 95% utilization; DiLoCo and Streaming DiLoCo (4 fragments, tau = 5) in closed "
              "form; latency 20 ms one way; every method sends the int8 payload). Utilization = "
              "compute time / wall time; loss is not projected.", "", note, ""]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "projection.json").write_text(json.dumps(results, indent=1))
    (out / "projection.md").write_text("\n".join(header + text) + "\n![projection]"
                                       "(projection.png)\n")
    plot(results, out / "projection.png")
    print("\n".join(header + text))
    print(f"wrote {out}/projection.json|md|png")


if __name__ == "__main__":
    main()
