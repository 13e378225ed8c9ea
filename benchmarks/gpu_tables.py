"""docs/results/gpu-queue.md from every record of the GPU queue so far (:mod:`benchmarks.gpu_queue`).

One section per experiment (a slice's group), in the queue's order; "not run yet" until a
window runs one of its slices. Seeds accumulate: a ladder row's loss is the mean over the seeds
run so far with its 95% t interval, and its difference to the first row is paired by seed.
Only records of a slice's present configuration count (a resized slice starts over), and
smoke-size records never reach this page.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.gpu_queue import RECORDS, is_done, records_of
from gasloc_p2p.sim.analysis import mean_ci, paired_ci

Rec = dict[str, Any]

HOW = """\
## Contributing a GPU window

On a machine with one NVIDIA GPU (an H100 or H200, 16 host cores; nothing needs the internet
there), from a clone of this repository with `make gpu-wheels` run where pip works:

```bash
GIT_COMMIT=$(git rev-parse --short=12 HEAD) bash scripts/gpu_next.sh --budget-min 9.5
python -m benchmarks.gpu_queue merge OUT/*.jsonl   # where pip works: the records, then commit
```

`scripts/gpu_next.sh` installs the wheels `make gpu-wheels` put in `.gpu/wheels` (hivemind and
what the machine lacks), then runs the pending slices in order within the budget (`make
gpu-plan` lists them) and copies the records to `$OUT` when it is set. Every record names its
commit, device, torch version, seed and configuration. A slice whose arms would outrun the
window stops itself after half a minute (its record says how long it would have taken) and
stays pending; from then on the plan budgets that projection for every seed of the slice (a
slice that does not fit what is left is skipped, not tried), and the next window goes on where
this one stopped.

In the project's own sessions (the device tool: a bare H100 or H200, 10 minutes a command,
about 15 minutes a session, about 35 s of it the machine's start): `make gpu-wheels` here,
then one call `GIT_COMMIT=<HEAD> bash scripts/gpu_next.sh --budget-min 9.5` with `.gpu`
carried and a 590 s limit, and at once (the machine stays warm 30 s; the corpus built in the
first call is kept) a second with `--budget-min` the minutes left less one; merge the `.jsonl`
files they return and commit them with this page. A command killed at its limit brings back
nothing of the slice it was in: give the script its budget, not a shorter `timeout`.
"""


def page(where: Path = RECORDS, smoke: bool = False) -> str:
    """The page; ``smoke``: of smoke-size records (a CPU's check of the queue), else of the
    real ones only."""
    from benchmarks.gpu_plan import QUEUE

    lines = ["# The GPU queue: results so far" + (" (SMOKE SIZE: a check of the code, no "
                                                  "result)" if smoke else ""), "",
             "Written by `python -m benchmarks.gpu_queue tables` from the records in "
             "`docs/results/gpu-queue/` (one JSON line per arm and window). What each slice is: "
             "`benchmarks/gpu_plan.py`; `make gpu-plan` prints the queue with its expected "
             "minutes and what is done.", "", HOW]
    groups: dict[str, list[Any]] = {}
    for sl in QUEUE:
        groups.setdefault(sl.group, []).append(sl)
    for group, slices in groups.items():
        recs = [r for sl in slices for r in records_of(sl.id, where)
                if r.get("status") == "ok" and r.get("digest") == sl.digest()
                and bool(r.get("smoke")) == smoke]
        done = sum(is_done(sl, where, smoke) for sl in slices)
        lines += [f"## {group}: {slices[0].title.split(':')[0]}", "",
                  f"Slices: {', '.join(f'`{sl.id}`' for sl in slices)} ({done} of "
                  f"{len(slices)} run).", ""]
        tries = [r for sl in slices for r in records_of(sl.id, where)
                 if r.get("status") != "ok" and bool(r.get("smoke")) == smoke]
        if not recs:
            digests = {sl.id: sl.digest() for sl in slices}
            current = any(r.get("digest") == digests.get(r.get("slice")) for r in tries)
            lines += [_tried(tries, current) if tries else "Not run yet.", ""]
            continue
        lines += [_provenance(recs), "", *RENDER.get(slices[0].kind, _generic)(recs), ""]
        if tries:
            lines += [f"Attempts that did not finish: {len(tries)} (last: "
                      f"{tries[-1]['status']}: {tries[-1].get('why', '')[:160]}).", ""]
    return "\n".join(lines).rstrip() + "\n"


def _tried(tries: list[Rec], current: bool) -> str:
    """What the attempts of a group that never finished said: how long its arms would take."""
    from benchmarks.gpu_queue import projected_s

    projected = [p for p in map(projected_s, tries) if p is not None]
    devices = sorted({r.get("device", "?") for r in tries})
    text = (f"Not run yet: {len(tries)} arm(s) tried on {', '.join(devices)} "
            f"({tries[0].get('when', '?')[:10]} to {tries[-1].get('when', '?')[:10]}) stopped "
            "early")
    if projected:
        text += (f", projecting {min(projected):.0f}-{max(projected):.0f} s an arm; " +
                 ("the plan budgets that from now on" if current else
                  "the slice was resized since"))
    return text + f" (last: {tries[-1]['status']}: {tries[-1].get('why', '')[:120]})."


def _provenance(recs: list[Rec]) -> str:
    devices = sorted({f"{r['device']} (torch {r['torch']})" for r in recs})
    commits = sorted({r["commit"] + ("+changes" if r.get("dirty") else "") for r in recs})
    corpora = sorted({r["corpus_sha256"] for r in recs if r.get("corpus_sha256")})
    text = f"Ran on {', '.join(devices)}; commits {', '.join(commits)}"
    if corpora:
        text += f"; corpus {', '.join(corpora)}"
    return text + "."


def _fmt(mean_half: tuple[float, float], spec: str = ".3f") -> str:
    mean, half = mean_half
    return f"{mean:{spec}}" + ("" if math.isnan(half) else f" ± {half:{spec.lstrip('+')}}")


def _by_arm(recs: list[Rec]) -> dict[str, list[Rec]]:
    out: dict[str, list[Rec]] = {}
    for r in recs:
        out.setdefault(r["arm"], []).append(r)
    return out


def _sim(recs: list[Rec]) -> list[str]:
    """Loss (mean ± 95% t over seeds), paired difference to the first row, consensus,
    MB/worker, tokens, tokens/s per arm while side by side."""
    arms = _by_arm(recs)
    names = list(arms)
    ref = {r["seed"]: r["figures"]["val_loss"] for r in arms[names[0]]}
    lines = ["| arm | seeds | final val loss | Δ vs first row (paired) | consensus | "
             "MB/worker | tokens | tokens/s (side by side) |", "|---|---|---|---|---|---|---|---|"]
    for name in names:
        runs = sorted(arms[name], key=lambda r: r["seed"])
        losses = [r["figures"]["val_loss"] for r in runs]
        paired = [r for r in runs if r["seed"] in ref]
        if name == names[0]:
            delta = "(reference)"
        elif len(paired) >= 2:
            delta = _fmt(paired_ci([r["figures"]["val_loss"] for r in paired],
                                   [ref[r["seed"]] for r in paired]), "+.3f")
        elif paired:
            delta = f"{paired[0]['figures']['val_loss'] - ref[paired[0]['seed']]:+.3f} (1 seed)"
        else:
            delta = "n/a"
        f = runs[-1]["figures"]
        lines.append(f"| {name} | {len(runs)} | {_fmt(mean_ci(losses))} | {delta} | "
                     f"{f['consensus']:.3g} | {f['bytes_per_worker'] / 1e6:.1f} | "
                     f"{f['tokens'] / 1e6:.1f}M | {f['tokens_per_s']:,.0f} |")
    return lines


def _concurrency(recs: list[Rec]) -> list[str]:
    arms = _by_arm(recs)
    alone = next((v[-1] for k, v in arms.items() if k.endswith(" [alone]")), None)
    if alone is None:
        return _sim(recs)
    beside = arms.get(alone["arm"].removesuffix(" [alone]"), [None])[-1]
    lines = _sim(recs)
    if beside is not None:
        a, b = alone["figures"], beside["figures"]
        gaps = [abs(p["val_loss"] - q["val_loss"]) for p, q in zip(a["history"], b["history"],
                                                                    strict=False)]
        together = sum(v[-1]["figures"]["tokens_per_s"] for k, v in arms.items()
                       if not k.endswith(" [alone]"))
        lines += ["", f"The same arm and seed alone and beside {len(arms) - 2} others: final "
                  f"loss {a['val_loss']:.4f} and {b['val_loss']:.4f} (largest difference over "
                  f"its {len(gaps)} evaluations {max(gaps, default=0):.2e}); tokens/s "
                  f"{a['tokens_per_s']:,.0f} alone, {together:,.0f} for all arms together "
                  f"({together / a['tokens_per_s']:.2f}x)."]
    return lines


def _swarm(recs: list[Rec]) -> list[str]:
    lines = ["| arm | nodes | final loss (mean of nodes) | bytes sent per node at its link | "
             "round (s) | int8 payload at the link (s) | rounds per exchange |",
             "|---|---|---|---|---|---|---|"]
    for r in recs:
        f = r["figures"]
        sent = [n["link_tx_bytes"] for n in f["nodes"] if n.get("link_tx_bytes")]
        mb = f"{sum(sent) / len(sent) / 1e6:,.0f} MB" if sent else "n/a"
        lines.append(f"| {r['arm']} | {len(f['nodes'])} | {f['final_loss']:.3f} | {mb} | "
                     f"{f.get('round_s', math.nan):.1f} | {f.get('payload_s', math.nan):.1f} | "
                     f"{f.get('rounds_per_exchange', math.nan):.2f} |")
    return lines


def _throughput(recs: list[Rec]) -> list[str]:
    lines = ["| model and setting | parameters | tokens/s | MFU (reachable bf16 peak) | "
             "MFU (989 TFLOP/s) | step peak GiB | ready after (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in recs:
        f = r["figures"]
        mfu = f"{f['mfu_reachable']:.1%}" if f.get("mfu_reachable") else "n/a"
        sheet = f"{f['mfu_h100_sheet']:.1%}" if f.get("mfu_h100_sheet") else "n/a"
        peak = f"{f['step_peak_gib']:.1f}" if f.get("step_peak_gib") else "n/a"
        lines.append(f"| {r['config']['model']}: {r['arm']} | {f['params'] / 1e6:,.1f}M | "
                     f"{f['tokens_per_s']:,.0f} | {mfu} | {sheet} | {peak} | {f['ready_s']} |")
    return lines


def _engine(recs: list[Rec]) -> list[str]:
    lines = ["| arm | path | exchange (ms, wall) | kernels (ms) | device copy of the fp32 model "
             "(ms) | kernels / copy | wall / copy |", "|---|---|---|---|---|---|---|"]
    tests = []
    for r in recs:
        f = r["figures"]
        if "summary" in f:
            tests.append(f"- {r['arm']}: {f['summary']}")
            continue
        how = ("payloads on the device" if not f.get("streamed")
               else "streamed, fused kernels" if f.get("fused") else "streamed, eager passes")
        lines.append(f"| {r['arm']} | {how} | {f['exchange_s'] * 1e3:.1f} | "
                     f"{f['kernels_s'] * 1e3:.2f} | {f['copy_s'] * 1e3:.2f} | "
                     f"{f['kernel_ratio']:.1f}x | {f['ratio']:.1f}x |")
    return [*lines, "", *tests]


def _generic(recs: list[Rec]) -> list[str]:
    return [f"- {r['arm']}: {r['figures']}" for r in recs]


RENDER: dict[str, Callable[[list[Rec]], list[str]]] = {
    "sim": _sim, "concurrency": _concurrency, "swarm": _swarm, "throughput": _throughput,
    "engine": _engine}
