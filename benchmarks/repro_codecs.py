"""The codec study of issue 24 ("100x fewer bytes"): parts ``codecs-8`` and ``codecs-16`` of
benchmarks/reproduce.py.

Every row runs the same 1000 inner steps per worker (equal steps and tokens), H = 10, sync
rounds, 1-peer random matchings on the complete graph (gossip) or an all-reduce / all-gather
(DiLoCo, eta 1 gamma 0: the outer step this project found best at this scale). Gossip rows
differ only in the payload: int8 plain (the default), sparse codecs against theta_0 (no state)
or per-pair references (``link``), dense low-bit; DiLoCo rows in the outer-gradient payload
(uncompressed fp32; sparse and dense low-bit with SparseLoCo's error feedback). ``local`` (no
communication) is the control: what zero bytes buy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.sim.analysis import mean_ci, paired_ci, time_to_target
from gasloc_p2p.sim.config import SimConfig

Row = tuple[str, SimConfig]
REFERENCE = "gossip int8 plain (default)"
DILOCO_REFERENCE = "diloco fp32 (uncompressed)"
TITLES = {
    "codecs-8": "n = 8: sparse and low-bit payloads in gossip and DiLoCo at equal steps",
    "codecs-16": "n = 16: sparse and low-bit payloads in gossip and DiLoCo at equal steps",
    "home-8": "n = 8: gossip payloads 8x below int8 (issue 40), at equal steps",
    "home-8-deciding": "n = 8: int8 against the link-reference payloads, 10 seeds",
    "home-links-8": "n = 8, async, 1 Mbit/s links (an int8 exchange: 2 rounds of compute)",
    "home-links-8-uneven": "n = 8, async, 1 Mbit/s links and one of 0.1 Mbit/s",
    "home-links-8-deciding": "n = 8, async, 1 Mbit/s links: int8 against int4 and the "
                             "link payloads, 10 seeds",
    "home-links-8-bound": "n = 8, async, 1 Mbit/s links: what free bytes would buy, and "
                          "payloads 16x and 32x below int8",
    "home-links-16": "n = 16, async, 1 Mbit/s links: int8 against the daemon's half2",
}
HOME_LINK_MBPS = 1.0  # 121,048 int8 bytes: 0.97 s on the link + 0.02 latency, a round is 0.5 s


def rows(base: SimConfig, n: int) -> list[Row]:
    """The study's rows at ``n`` workers, reference first (n = 16: the rows that decide)."""
    b = dataclasses.replace(base, workers=n, H=10, graph="complete")
    g = dataclasses.replace(b, algorithm="gasloc")
    d = dataclasses.replace(b, algorithm="diloco", eta=1.0, gamma=0.0)
    r = dataclasses.replace
    every: list[Row] = [
        (REFERENCE, r(g, codec="int8")),
        ("gossip int4 plain", r(g, codec="int4")),
        ("gossip dense2, theta0", r(g, codec="dense2")),
        ("gossip randk2 50%, theta0", r(g, codec="randk2:2048")),
        ("gossip randk2 25%, theta0", r(g, codec="randk2:1024")),
        ("gossip randk2 12.5%, theta0", r(g, codec="randk2:512")),
        ("gossip randk1 25%, theta0", r(g, codec="randk1:1024")),
        ("gossip randk2 4%, theta0", r(g, codec="randk2:160")),
        ("gossip topk2 1%, link references", r(g, codec="topk2:41", reference="link")),
        ("local (no communication)", r(b, algorithm="local")),
        (DILOCO_REFERENCE, r(d, codec="none")),
        ("diloco topk1 1%, error feedback", r(d, codec="topk1:41")),
        ("diloco topk2 3%, error feedback", r(d, codec="topk2:123")),
        ("diloco dense2, error feedback", r(d, codec="dense2")),
    ]
    if n <= 8:
        return every
    keep = (REFERENCE, "gossip dense2, theta0", "gossip randk2 12.5%, theta0",
            DILOCO_REFERENCE, "diloco topk1 1%, error feedback",
            "diloco topk2 3%, error feedback")
    return [row for row in every if row[0] in keep]


def home_rows(base: SimConfig, n: int, deciding: bool = False) -> list[Row]:
    """Issue 40's gossip payloads for home links, each 8x below int8, reference first:
    CHOCO-style residuals against a copy each pair holds (``link``), and a modulo payload
    (Moniqua: no state, decoded next to the receiver's own state; 3 bits on a third of the
    coordinates). ``deciding``: int8 and the two candidates whose paired intervals included 0
    at 5 seeds (the link references), for more seeds."""
    g = dataclasses.replace(base, workers=n, H=10, graph="complete", algorithm="gasloc")
    r = dataclasses.replace
    rows = [
        (REFERENCE, r(g, codec="int8")),
        ("gossip dense1, link references", r(g, codec="dense1", reference="link")),
        ("gossip randk2 50%, link references", r(g, codec="randk2:2048", reference="link")),
        ("gossip mod3 33% (modulo, no state)", r(g, codec="mod3:1365")),
    ]
    return rows[:3] if deciding else rows


def home_link_rows(base: SimConfig, n: int, uneven: bool = False,
                   deciding: bool = False) -> list[Row]:
    """Issue 40 where bytes set the wall clock: async gossip (the daemon's schedule, 2
    participations per round asked, a worker in one exchange at a time) on links where an
    int8 exchange takes about 2 rounds of compute, so every row runs for the same simulated
    time and its codec decides how many exchanges fit. Control: int8 with stale exchanges at
    full weight (the daemon divides an exchange's weight by 1 + the round ends it spans beyond
    one; is what int8 loses its bytes or that rule?). ``uneven``: worker 0's link is 10x slower
    (an int8 exchange with it spans 20 rounds). ``deciding``: int8 and the 1-bit link
    payloads (1 bit on every coordinate: the daemon's sign1; 2 bits on half of them) and int4,
    for more seeds."""
    g = dataclasses.replace(base, workers=n, H=10, graph="complete", algorithm="gasloc",
                            mode="async", eta=1.0, gamma=0.0, bandwidth_mbps=HOME_LINK_MBPS,
                            **(dict(slow_workers=1, slow_link_factor=10.0) if uneven else {}))
    r = dataclasses.replace
    rows = [
        (REFERENCE, r(g, codec="int8")),
        ("gossip int8, stale exchanges at full weight", r(g, codec="int8", max_staleness=1000)),
        ("gossip dense1, link references", r(g, codec="dense1", reference="link")),
        ("gossip randk2 50%, link references", r(g, codec="randk2:2048", reference="link")),
        ("gossip int4 plain", r(g, codec="int4")),
    ]
    if deciding:
        return rows[:1] + rows[2:]
    if n > 8:  # the daemon's recommended payload on slow uplinks (half2: randk2 50%)
        return [rows[0], rows[3]]
    return rows[:3] if uneven else rows


def home_link_bound_rows(base: SimConfig) -> list[Row]:
    """How far any payload can take time to int8's loss on home links: int8 on links 10,000x
    faster (exchanges cost their latency only: the bound of a payload of no bytes at all),
    against int8 and half2 on 1 Mbit/s links and payloads 16x and 32x below int8 (2 bits on a
    quarter and an eighth of the coordinates, against link references)."""
    rows = home_link_rows(base, 8)
    r = dataclasses.replace
    int8, half2 = rows[0], rows[3]
    return [int8,
            ("gossip int8, free links (10,000 Mbit/s)", r(int8[1], bandwidth_mbps=1e4)),
            half2,
            ("gossip randk2 25%, link references", r(half2[1], codec="randk2:1024")),
            ("gossip randk2 12.5%, link references", r(half2[1], codec="randk2:512"))]


def _final(res: dict[str, Any]) -> float:
    return float(res["final"]["val_loss"])


def _tokens_per_worker(res: dict[str, Any]) -> float:
    c = res["config"]
    return float(c["steps"] * c["batch_size"] * c["seq_len"])


def _versus(runs: list[dict[str, Any]], ref: list[dict[str, Any]]) -> str:
    by_seed = {r["config"]["seed"]: r for r in ref}
    paired = [r for r in runs if r["config"]["seed"] in by_seed]
    if len(paired) < 2:
        return "n/a"
    mean, half = paired_ci([_final(r) for r in paired],
                           [_final(by_seed[r["config"]["seed"]]) for r in paired])
    return f"{mean:+.3f} ± {half:.3f}"


def _ratio(base: float, mine: float) -> str:
    if not mine:
        return "(none sent)"
    ratio = base / mine
    return f"{ratio:.1f}x" if ratio < 100 else f"{ratio:.0f}x"


def _time_to(run: dict[str, Any], target: float) -> float | None:
    return time_to_target(run["trace"], target)


def _times(runs: list[dict[str, Any]], ref: list[dict[str, Any]]) -> str:
    """Simulated seconds until the row's quick loss reaches the int8 run's final quick loss of
    the same seed (mean over seeds, how many reached), and the ratio of mean times to int8's
    own (all paired seeds reached)."""
    by_seed = {r["config"]["seed"]: r for r in ref}
    mine, base = [], []
    for r in runs:
        other = by_seed.get(r["config"]["seed"])
        if other is None:
            continue
        target = other["trace"][-1]["loss"]
        mine.append(_time_to(r, target))
        base.append(_time_to(other, target))
    got = [t for t in mine if t is not None]
    if not got:
        return f"not reached (0/{len(mine)}) | n/a"
    ratio = (f"{sum(t for t in mine if t is not None) / sum(b for b in base if b is not None):.2f}x"
             if len(got) == len(mine) and all(b is not None for b in base) else "n/a")
    return f"{sum(got) / len(got):.1f} ({len(got)}/{len(mine)}) | {ratio}"


def table(group: dict[str, list[dict[str, Any]]], times: bool = False) -> list[str]:
    """Markdown rows: final loss, paired differences, consensus distance, bytes; ``times``:
    also the simulated time to int8's final loss and the exchanges' staleness (async parts)."""
    head = ["config", "codec", "seeds", "final loss", "Δ vs int8 plain (paired)",
            "Δ vs uncompressed DiLoCo (paired)", "consensus", "bytes/node/token",
            "fewer bytes than int8 plain gossip", "than fp32 plain gossip",
            "than fp32 DiLoCo"]
    if times:
        head += ["sim s to int8's final loss (reached)", "time vs int8",
                 "participations/round", "stale exchanges"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ref = group.get(REFERENCE, [])

    def bytes_per_token(runs: list[dict[str, Any]]) -> float:
        return mean_ci([r["final"]["bytes_per_worker"] / _tokens_per_worker(r)
                        for r in runs])[0] if runs else math.nan

    ref_bpt = bytes_per_token(ref)
    diloco_bpt = bytes_per_token(group.get(DILOCO_REFERENCE, []))
    params = next(iter(group.values()))[0]["params"]
    fp32_over_int8 = 4 * params / CodecSpec.of("int8").codec().wire_bytes(params)
    for name, runs in group.items():
        runs = sorted(runs, key=lambda r: r["config"]["seed"])
        loss, half = mean_ci([_final(r) for r in runs])
        bpt = bytes_per_token(runs)
        diloco = runs[0]["config"]["algorithm"] == "diloco"
        cells = [name, runs[0]["config"]["codec"] if runs[0]["config"]["algorithm"] != "local"
                 else "-", str(len(runs)),
                 f"{loss:.3f}" + ("" if math.isnan(half) else f" ± {half:.3f}"),
                 "(reference)" if name == REFERENCE else _versus(runs, ref),
                 ("(reference)" if name == DILOCO_REFERENCE
                  else _versus(runs, group.get(DILOCO_REFERENCE, [])) if diloco else ""),
                 f"{mean_ci([r['final']['consensus'] for r in runs])[0]:.3g}",
                 f"{bpt:.3g}", _ratio(ref_bpt, bpt), _ratio(ref_bpt * fp32_over_int8, bpt),
                 _ratio(diloco_bpt, bpt) if diloco else ""]
        if times:
            stats = [r["stats"] for r in runs]
            cells += [*_times(runs, ref).split(" | "),
                      f"{mean_ci([s['participations_per_round'] for s in stats])[0]:.2f}",
                      f"{sum(s['stale'] for s in stats) / max(1, sum(s['exchanges'] for s in stats)):.0%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _async_regime(cfg: dict[str, Any]) -> str:
    slow = (f" Worker 0's link is {cfg['slow_link_factor']:g}x slower "
            f"({cfg['bandwidth_mbps'] / cfg['slow_link_factor']:g} Mbit/s)."
            if cfg["slow_workers"] else "")
    return (f"Gossip: async (the daemon's schedule): each worker asks for "
            f"{cfg['participations_per_round']:g} exchanges per own round with a free peer of "
            "the complete graph at exponential waiting times, takes part in one exchange at "
            f"a time, and an exchange lasts its bytes over the slower of the two links "
            f"({cfg['bandwidth_mbps']:g} Mbit/s) plus {cfg['latency_s'] * 1000:g} ms; a round "
            f"is {cfg['H']} steps of {cfg['step_time_s']:g} simulated s, so every row trains "
            "for the same simulated time and the codec decides how many exchanges fit. An "
            "exchange spanning more than one round end (both sides together) has its weight "
            "w = 1/2 divided by 1 + the excess (the daemon's rule), unless the row keeps "
            f"stale exchanges at full weight.{slow} eta 1, gamma 0. Time to int8's final "
            "loss: simulated seconds until the quick loss (first 4,096 validation tokens, "
            "logged every 10 steps of the mean worker) reaches the int8 run's last quick loss "
            "of the same seed; time vs int8: the ratio of mean times. Stale exchanges: the "
            "share whose weight was cut.")


def describe(part: str, group: dict[str, list[dict[str, Any]]], seeds: str,
             cpu_minutes: float) -> list[str]:
    """The page's header: command, regime, how to read the table."""
    runs = [r for rs in group.values() for r in rs]
    cfg = runs[0]["config"]
    return [f"## {part}: {TITLES[part]}", "",
            f"`python -m benchmarks.reproduce --only {part} --seeds {seeds} --jobs 1`: "
            f"{len(runs)} runs of n = {cfg['workers']} workers x {cfg['steps']} inner steps "
            f"(H = {cfg['H']}, {cfg['batch_size'] * cfg['seq_len']} tokens per step), "
            f"{runs[0]['params']:,} parameters, {cpu_minutes:.0f} CPU-minutes (1 thread per "
            "run).", "",
            (_async_regime(cfg) if cfg.get("mode") == "async" else
             "Gossip: sync rounds, a fresh random 1-peer matching of the complete graph every "
             "round, w = 1/2, eta 1, gamma 0.") + " DiLoCo: an all-reduce (fp32) or, for sparse "
            "codecs, an all-gather of each worker's message with SparseLoCo's error feedback "
            "(beta 1), eta 1, gamma 0. Codecs: `randkB:K` sends K of every 4096 coordinates, "
            "drawn from a seed both sides share (no indices), at B bits; `topkB:K` the K "
            "largest of every 4096 with 12-bit indices; `denseB` every coordinate at B bits; "
            "a float32 scale per 4096. theta0: messages are the public iterate minus theta_0 "
            "(no state); link: minus a reference each pair of workers keeps (one model copy "
            "per pair).", "",
            *([] if part not in ("home-8", "home-8-deciding") else [
                "Modulo `modB:K` (issue 40, gasloc_p2p/core/modulo.py): K of every 4096 "
                "coordinates "
                "(shared-seed positions) as the low B bits of a stochastically rounded lattice "
                "code, the receiver recovering the rest next to its own public iterate; the "
                "step per 4096 is 1.5x the largest distance the sender measured at its last "
                "exchange over 2^(B-1); a pair's first exchange is int8. No state beyond 4 "
                "bytes per 4096 per node.", ""]),
            "Final loss: the network-average model on 65,536 validation tokens (nats/byte), "
            "mean ± 95% t half-width over seeds; Δ: paired by seed (negative = better). "
            "Consensus: mean_i ||theta_i - mean(theta)||^2 at the end, mean over seeds. "
            "Bytes/node/token: bytes each worker sent over the run / tokens it trained on; "
            "the last three columns divide int8 plain gossip's (fp32 plain gossip's: 3.98x "
            "int8's; uncompressed DiLoCo's all-reduce) by the row's."]
