"""gasloc_p2p against what users would pick instead, on real shaped links (`make bench-external`).

Usage: python -m benchmarks.bench_external [--cases uneven,uniform] [--systems all]
           [--steps 300] [--nodes 4] [--out docs/results] [--quick]

For each link case, each system runs ``--nodes`` real processes, one per network namespace
(``benchmarks.tools.netns``: veth pairs on a bridge, each host's egress shaped with tc tbf):
``uneven`` = three hosts at ``--fast-mbit`` (100) and one at ``--slow-mbit`` (5), ``uniform`` =
all at ``--fast-mbit``. Systems: gasloc_p2p's GASLoC (the defaults), gasloc_p2p's DiLoCo mode,
torchft's DiLoCo (lighthouse + gloo; skipped if torchft is not installed) and hivemind's
Optimizer with local updates. Same model, generated corpus, AdamW schedule, steps per node,
eval batches and routine for all (``benchmarks/external/common.py``). Then one GASLoC exchange
over a ``--slow-mbit`` link against payload / rate. Writes ``NAME.json``, ``NAME.md``
and ``NAME.png`` into ``--out`` (``--name``, default external); prints the tables. Needs root, ``ip`` and ``tc``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.external.aggregate import markdown, summarize
from benchmarks.external.common import Spec, make_corpus
from benchmarks.external.exchange import measure_exchange
from benchmarks.external.runners import OPTIONAL_SYSTEMS, SYSTEMS, run_system
from benchmarks.tools.netns import ShapedNetwork, netns_unavailable
from gasloc_p2p.sim.analysis import mean_ci


def case_rates(case: str, nodes: int, fast: float, slow: float) -> list[float]:
    case = case.split("#")[0]  # "uneven#2": the second repetition of "uneven"
    if case == "uneven":
        return [fast] * (nodes - 1) + [slow]
    if case == "uniform":
        return [fast] * nodes
    raise ValueError(f"unknown case {case!r}: uneven | uniform")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="uneven,uniform")
    p.add_argument("--systems", default="all",
                   help=f"comma list of {SYSTEMS + OPTIONAL_SYSTEMS} or all (= {SYSTEMS})")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--steps", type=int, default=300, help="inner steps per node")
    p.add_argument("--inner-steps", type=int, default=20, help="H (DiLoCo's sync period)")
    p.add_argument("--fast-mbit", type=float, default=100.0)
    p.add_argument("--slow-mbit", type=float, default=5.0)
    p.add_argument("--no-exchange-check", action="store_true")
    p.add_argument("--quick", action="store_true", help="60 steps (a check, not a result)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per system and case")
    p.add_argument("--out", default="docs/results")
    p.add_argument("--name", default="external", help="output files NAME.json|md|png")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every case this many times (case#1, case#2, ...; the systems' "
                        "order reversed every other time) and print paired differences")
    p.add_argument("--logs", default="", help="keep the nodes' logs here (default: deleted)")
    p.add_argument("--rebuild", action="store_true",
                   help="rewrite the table and plots from --out's external.json (no runs)")
    args = p.parse_args(argv)
    args.systems = list(SYSTEMS) if args.systems == "all" else args.systems.split(",")
    unknown = set(args.systems) - set(SYSTEMS + OPTIONAL_SYSTEMS)
    if unknown:
        p.error(f"--systems: unknown {sorted(unknown)}; choose from {SYSTEMS + OPTIONAL_SYSTEMS}")
    args.cases = args.cases.split(",")
    for case in args.cases:
        case_rates(case, 2, 1.0, 1.0)
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    if args.repeat > 1:
        args.cases = [f"{c}#{r}" for r in range(1, args.repeat + 1) for c in args.cases]
    if args.quick:
        args.steps = 60
    return args


def plot(cases: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(cases), 2, figsize=(11, 4 * len(cases)), squeeze=False)
    # one color per system in every row (repetitions run the systems in rotated order)
    names = [*SYSTEMS, *OPTIONAL_SYSTEMS]
    color = {name: f"C{k % 10}" for k, name in enumerate(names)}
    for row, (case, summary) in enumerate(cases.items()):
        for system in sorted(summary["curves"], key=lambda s: names.index(s) if s in names
                             else len(names)):
            pts = summary["curves"][system]
            if not pts:
                continue
            style = {"label": system, "color": color.get(system)}
            axes[row][0].plot([p["t"] for p in pts], [p["loss"] for p in pts], **style)
            axes[row][1].plot([p["tokens"] / 1e3 for p in pts], [p["loss"] for p in pts], **style)
        for col, xlabel in enumerate(("wall time, s (slowest node)", "thousand tokens per node")):
            ax = axes[row][col]
            if summary["target_loss"]:
                ax.axhline(summary["target_loss"], color="grey", lw=0.8, ls="--")
            first = [p["loss"] for c in summary["curves"].values() for p in c[:1]]
            if first:  # DiLoCo's first outer steps overshoot: keep the rest readable
                ax.set_ylim(top=max(first) * 1.05)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("val loss (mean over nodes)")
            ax.set_title(f"{case}")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.rebuild:
        rebuild(Path(args.out), args)
        return
    reason = netns_unavailable()
    if reason:
        sys.exit(f"bench_external: shaped links unavailable: {reason}")
    spec = Spec(nodes=args.nodes, steps=args.steps, inner_steps=args.inner_steps,
                eval_every=args.inner_steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.bench_external " + " ".join(argv or sys.argv[1:])
    started = time.monotonic()
    results: dict[str, Any] = {"command": command.strip(), "spec": json.loads(spec.to_json()),
                               "cases": {}, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="bench_external_") as tmp_dir:
        tmp = Path(args.logs or tmp_dir)
        data = make_corpus(tmp / "corpus.txt", spec.corpus_mb, spec.seed)
        summaries = {}
        for case in args.cases:
            rates = case_rates(case, args.nodes, args.fast_mbit, args.slow_mbit)
            runs = []
            rep = int(case.split("#")[1]) if "#" in case else 1
            order = args.systems[::-1] if rep % 2 == 0 else args.systems
            for system in order:
                print(f"[{time.monotonic() - started:6.0f} s] {case}: {system} on "
                      f"{rates} Mbit/s", flush=True)
                with ShapedNetwork(rates) as net:
                    run = run_system(system, net.hosts, spec, data, tmp / case / system,
                                     gateway=net.gateway, timeout_s=args.timeout_s)
                runs.append(run)
                if run.get("skipped"):
                    print(f"    skipped: {run['skipped']}", flush=True)
                elif not run["finished"]:
                    print(f"    timed out; logs: {run['log_dir']}", flush=True)
            summaries[case] = summarize(runs)
            results["runs"][case] = runs
            results["cases"][case] = {k: v for k, v in summaries[case].items() if k != "curves"}
            results["cases"][case]["curves"] = summaries[case]["curves"]
            print(markdown(f"{case} ({', '.join(f'{r:g}' for r in rates)} Mbit/s)",
                           summaries[case]), flush=True)
        if not args.no_exchange_check:
            print(f"[{time.monotonic() - started:6.0f} s] one exchange over "
                  f"{args.slow_mbit:g} Mbit/s", flush=True)
            ex_spec = Spec(nodes=2, steps=4000, inner_steps=20, eval_every=1000)
            results["exchange"] = measure_exchange(args.slow_mbit, ex_spec, data,
                                                   tmp / "exchange")
            print(json.dumps(results["exchange"]), flush=True)
    results["wall_s"] = time.monotonic() - started
    write(out, results, summaries, args)


def paired(summaries: dict[str, Any]) -> list[str]:
    """Over the repetitions of each case: the final loss of every other system minus the
    default GASLoC's (mean, 95% t half-width, each repetition's difference)."""
    by_case: dict[str, list[dict[str, Any]]] = {}
    for case, summary in summaries.items():
        if "#" in case:
            by_case.setdefault(case.split("#")[0], []).append(summary)
    lines = []
    for case, reps in by_case.items():
        finals = [{r["system"]: r.get("final_loss") for r in s["rows"]} for s in reps]
        systems = [r["system"] for r in reps[0]["rows"]]
        base = "gasloc" if "gasloc" in systems else systems[0]
        for other in (s for s in systems if s != base):
            diffs = [f[other] - f[base] for f in finals
                     if f.get(other) is not None and f.get(base) is not None]
            if len(diffs) < 2:
                continue
            mean, half = mean_ci(diffs)
            lines.append(f"- {case}, {len(diffs)} repetitions: final val loss {other} minus "
                         f"{base} {mean:+.4f} ± {half:.4f} (95% t; per repetition "
                         f"{', '.join(f'{d:+.3f}' for d in diffs)})")
        lines += _throughput_ratios(case, reps, systems)
    return ["**Paired over repetitions**\n", *lines, ""] if lines else []


def _throughput_ratios(case: str, reps: list[dict[str, Any]], systems: list[str]) -> list[str]:
    """With the no-gossip control in the run: each system's tokens/s per node as a share of
    the control's, paired by repetition (the compute utilization seen from outside)."""
    if "gasloc-solo" not in systems:
        return []
    lines = []
    rates = [{r["system"]: r.get("tokens_per_s_per_node") for r in s["rows"]} for s in reps]
    for other in (s for s in systems if s != "gasloc-solo"):
        shares = [f[other] / f["gasloc-solo"] for f in rates
                  if f.get(other) and f.get("gasloc-solo")]
        if len(shares) < 2:
            continue
        mean, half = mean_ci(shares)
        lines.append(f"- {case}, {len(shares)} repetitions: tokens/s per node {other} / "
                     f"gasloc-solo {mean:.3f} ± {half:.3f} (95% t; per repetition "
                     f"{', '.join(f'{x:.3f}' for x in shares)})")
    return lines


def rebuild(out: Path, args: argparse.Namespace) -> None:
    """Tables and plots again from a finished run's JSON (its runs hold every eval record)."""
    results = json.loads((out / f"{args.name}.json").read_text())
    summaries = {case: summarize(runs) for case, runs in results["runs"].items()}
    write(out, results, summaries, args)


def write(out: Path, results: dict[str, Any], summaries: dict[str, Any],
          args: argparse.Namespace) -> None:
    (out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    plot(summaries, out / f"{args.name}.png")
    spec = results["spec"]
    text = [f"# External baselines on shaped links\n\n`{results['command']}` "
            f"({results['wall_s'] / 60:.1f} min). {spec['nodes']} nodes, one process and one "
            f"torch thread each, each in its own network namespace with tc tbf on its egress; "
            f"GPT {spec['n_layer']} layers x {spec['n_embd']}, seq {spec['seq_len']}, batch "
            f"{spec['batch_size']}, {spec['steps']} steps per node, H = {spec['inner_steps']}, "
            f"generated corpus; val loss = mean over nodes of each node's own parameters on "
            f"the same {spec['eval_batches']} batches; time = when the slowest node got "
            f"there, from when the last node started training. veth bytes are the kernel's counters "
            f"(Ethernet frames, every protocol of the run); program bytes are counted "
            f"(gasloc gossip) or estimated from the syncs (torchft, hivemind).\n"]
    for case, summary in summaries.items():
        text.append(markdown(case, summary))
    text += paired(summaries)
    ex = results.get("exchange")
    if ex and ex.get("exchanges"):
        text.append(f"One GASLoC exchange over {ex['rate_mbit']:g} Mbit/s: "
                    f"{ex['mean_exchange_s']:.3f} s mean over {ex['exchanges']} exchanges, "
                    f"payload {ex['payload_bytes'] / 1e6:.3f} MB / rate = "
                    f"{ex['payload_over_rate_s']:.3f} s: ratio {ex['ratio']:.2f} (goal <= 1.2)\n")
    elif ex is not None:
        text.append("One exchange over the slow link: no exchange completed.\n")
    text.append(f"![curves]({args.name}.png)\n")
    (out / f"{args.name}.md").write_text("\n".join(text))
    print(f"wrote {out / args.name}.json|md|png")


if __name__ == "__main__":
    main()
