"""The runners of the GPU queue's slices (:mod:`benchmarks.gpu_queue`), one per kind.

Each takes a slice, the seconds left in the window, whether to run at smoke size (a CPU) and
a scratch folder, and returns one record body per arm: ``arm``, ``status`` ("ok", "too long",
"failed", "blocked"), ``why`` when not ok, ``config`` and ``figures``.

- ``sim``: every arm a ``benchmarks.gpu_arm`` process, all at once on the one GPU;
- ``concurrency``: the first arm alone, then every arm at once (the first among them);
- ``swarm``: real ``gasloc-node join`` processes (``benchmarks.external``), each in its own
  network namespace behind a tbf-shaped link (loopback, unshaped, at smoke size);
- ``throughput``: every arm a ``benchmarks.gpu_throughput`` process, one after another (each
  needs the whole GPU).
- ``engine``: every arm a process, one after another: ``benchmarks.bench_engine`` timing one
  codec's exchange, or pytest on the CUDA tests it names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_queue import ROOT, Arm, Slice, projection_in

START_S = 30.0  # a process's start (torch, CUDA, data) before its first step, on an H100
CORPUS = ROOT / "runs" / "corpus"  # the ladder's BPE corpus (make corpus), built when missing
Row = dict[str, Any]


def run_slice(sl: Slice, left_s: float, smoke: bool, scratch: Path) -> list[Row]:
    work = scratch / "work" / sl.id
    work.mkdir(parents=True, exist_ok=True)
    runner = {"sim": _sim_slice, "concurrency": _concurrency, "swarm": _swarm,
              "throughput": _throughput, "engine": _engine}[sl.kind]
    return runner(sl, left_s, smoke, work)


# ------------------------------------------------------------------------------ data
def corpus_built() -> bool:
    from gasloc_p2p.data import registry

    return registry.is_built(str(CORPUS))


def corpus(smoke: bool, scratch: Path) -> Path:
    """The token corpus of the simulator slices: at smoke size a small byte-level one in the
    scratch folder, else ``runs/corpus`` (built here when missing: the installed packages'
    text, a 16k BPE; about a minute on 16 cores; its SHA-256 goes into every record)."""
    from gasloc_p2p.data import registry

    if smoke:
        path = scratch / "smoke-corpus"
        if not registry.is_built(str(path)):
            registry.build(path, ["pip"], size_mb=0.2, val_every=5, tokenizer_kind="byte")
        return path
    if not registry.is_built(str(CORPUS)):
        t0 = time.monotonic()
        print("gpu-next: building runs/corpus (200 MB of the installed packages' text, a 16k "
              "BPE)", flush=True)
        registry.build(CORPUS)
        print(f"gpu-next: corpus built in {time.monotonic() - t0:.0f} s", flush=True)
    return CORPUS


def corpus_facts(path: Path) -> dict[str, Any]:
    meta = json.loads((path / "meta.json").read_text())
    return {"corpus_sha256": meta["corpus_sha256"][:16],
            "tokenizer_sha256": meta.get("tokenizer_sha256", "")[:16],
            "corpus_train_tokens": meta["train_tokens"]}


# ------------------------------------------------------------------------------ sim
def _sim_config(arm: Arm, smoke: dict[str, Any] | None, data: Path) -> dict[str, Any]:
    cfg = dict(arm.config)
    if smoke is not None:
        cfg.update({k: v for k, v in smoke.items() if k != "arms"})
        cfg["H"] = min(cfg["H"], 2)  # at least two rounds in four steps
    cfg["data"] = str(data)
    return cfg


def run_arms(arms: list[Arm], sl: Slice, left_s: float, smoke: bool, work: Path,
             tag: str = "", inline: bool = False) -> list[Row]:
    """Every arm at once, a process each; their rows when all ended (or were stopped at the
    deadline: ``left_s`` less a margin). ``inline``: one after another in this process (the
    smoke run of most slices: a process's start costs more than a smoke-size arm)."""
    t0 = time.monotonic()
    data = corpus(smoke, work.parent.parent)
    deadline = max(30.0, left_s - (time.monotonic() - t0) - 20.0)  # the corpus's build counts
    if inline:
        return [{**_inline(arm, sl, work / f"arm{tag}{k}", data), **corpus_facts(data)}
                for k, arm in enumerate(arms)]
    procs = []
    for k, arm in enumerate(arms):
        cfg = _sim_config(arm, sl.smoke if smoke else None, data)
        out = work / f"arm{tag}{k}.json"
        argv = [sys.executable, "-m", "benchmarks.gpu_arm", "--config", json.dumps(cfg),
                "--out", str(out), "--deadline-s", "0" if smoke else f"{deadline:.0f}",
                "--calibrate-s", "30"]
        log = (work / f"arm{tag}{k}.log").open("w")
        procs.append((arm, cfg, out, log, subprocess.Popen(
            argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=_env())))
    stop = time.monotonic() + deadline + 30
    rows = []
    for arm, cfg, out, log, proc in procs:
        try:
            code = proc.wait(timeout=max(1.0, stop - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        log.close()
        rows.append(_sim_row(arm, cfg, out, code, Path(log.name)))
    facts = corpus_facts(data)
    return [{**r, **facts} for r in rows]


def _inline(arm: Arm, sl: Slice, base: Path, data: Path) -> Row:
    from benchmarks import gpu_arm

    cfg = _sim_config(arm, sl.smoke, data)
    out, lines = base.with_suffix(".json"), []
    code = gpu_arm.run_arm(cfg, out, 0.0, 30.0, lines.append)
    base.with_suffix(".log").write_text("\n".join(lines))
    return _sim_row(arm, cfg, out, code, base.with_suffix(".log"))


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def _sim_row(arm: Arm, cfg: dict[str, Any], out: Path, code: int, log: Path) -> Row:
    row: Row = {"arm": arm.label, "config": cfg}
    lines = log.read_text(errors="replace").strip().splitlines()
    if code == 0 and out.exists():
        return {**row, "status": "ok", "figures": sim_figures(json.loads(out.read_text()))}
    last = lines[-1] if lines else f"exit {code}"
    status = "too long" if code == 3 else "failed"
    if status == "too long":
        last = json.loads(last).get("too_long", last)
        row["projected_s"] = projection_in(last)
    return {**row, "status": status, "why": last[-300:]}


def sim_figures(res: dict[str, Any], points: int = 60) -> dict[str, Any]:
    """What a record keeps of a simulated run: the final evaluation, the evaluations, the
    round-end trace (at most ``points`` of it), size and time."""
    final = res["final"]
    trace = res.get("trace", [])
    step = max(1, len(trace) // points)
    keep = ("steps", "tokens", "loss", "consensus", "bytes_per_worker")
    return {"val_loss": final["val_loss"], "consensus": final["consensus"],
            "bytes_per_worker": final["bytes_per_worker"], "tokens": final["tokens"],
            "params": res["params"], "wall_s": round(res["wall_seconds"], 1),
            "tokens_per_s": final["tokens"] / max(res["wall_seconds"], 1e-9),
            "peak_device_bytes": res.get("peak_device_bytes", 0),
            "history": [{k: p[k] for k in ("steps", "tokens", "val_loss", "consensus")}
                        for p in res["history"]],
            "trace": [{k: p[k] for k in keep if k in p}
                      for p in [*trace[::step], *trace[-1:]]] if trace else []}


def _sim_slice(sl: Slice, left_s: float, smoke: bool, work: Path) -> list[Row]:
    return run_arms(list(sl.arms), sl, left_s, smoke, work, inline=smoke)


def _concurrency(sl: Slice, left_s: float, smoke: bool, work: Path) -> list[Row]:
    """The first arm alone (its rows labelled ``[alone]``), then all arms at once."""
    t0, arms = time.monotonic(), list(sl.arms_at(smoke))
    alone = run_arms(arms[:1], sl, left_s / 2, smoke, work, "a")
    for row in alone:
        row["arm"] += " [alone]"
    together = run_arms(arms, sl, left_s - (time.monotonic() - t0), smoke, work, "b")
    return alone + together


# ------------------------------------------------------------------------------ swarm
def _swarm(sl: Slice, left_s: float, smoke: bool, work: Path) -> list[Row]:
    """One arm: ``nodes`` real processes, each in its own namespace behind a link of
    ``rate_mbit`` (tbf); at smoke size on loopback, unshaped."""
    from benchmarks.external.runners import LoopbackHost, run_system
    from benchmarks.tools.netns import NetnsError, ShapedNetwork, netns_unavailable

    (arm,) = sl.arms
    cfg = {**arm.config, **(sl.smoke if smoke else {})}
    spec, data = _swarm_spec(cfg, smoke, work)
    row: Row = {"arm": arm.label, "config": cfg}
    timeout = max(60.0, left_s - 30.0)
    if not cfg["rate_mbit"]:
        run = run_system(cfg["system"], [LoopbackHost() for _ in range(cfg["nodes"])], spec,
                         data, work / "logs", timeout_s=timeout)
    else:
        reason = netns_unavailable()
        if reason is not None:
            return [{**row, "status": "blocked", "why": f"shaped links: {reason}"}]
        try:
            with ShapedNetwork([cfg["rate_mbit"]] * cfg["nodes"]) as net:
                run = run_system(cfg["system"], net.hosts, spec, data, work / "logs",
                                 gateway=net.gateway, timeout_s=timeout)
        except NetnsError as exc:
            return [{**row, "status": "blocked", "why": f"shaped links: {exc}"}]
    nodes = run["nodes"]
    ok = nodes and all(n["exit_code"] == 0 and n["evals"] for n in nodes)
    figures = swarm_figures(run, cfg)
    if not ok:
        tail = sorted((work / "logs").glob("*-n*.err"))  # the nodes' logs, not the DHT's
        why = "; ".join(f"{p.name}: {p.read_text(errors='replace').strip()[-200:]}"
                        for p in tail[:2])
        return [{**row, "status": "failed", "why": why[-600:], "figures": figures}]
    return [{**row, "status": "ok", "figures": figures}]


def _swarm_spec(cfg: dict[str, Any], smoke: bool, work: Path) -> tuple[Any, Path]:
    from benchmarks.external.common import Spec

    data = work / "corpus.txt"
    text_corpus(data, cfg["corpus_mb"])
    model = cfg["model"]
    if model != "gpt":
        from benchmarks.gpu_check import LLAMA_135M

        model_dir = work / model
        model_dir.mkdir(exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(LLAMA_135M))
        model = str(model_dir / "config.json")
    steps = cfg.get("max_steps") or 2000  # timed runs: the cosine's horizon, about the run
    spec = Spec(nodes=cfg["nodes"], steps=steps, inner_steps=cfg["inner_steps"],
                eval_every=cfg["eval_every"], seq_len=cfg["seq_len"],
                batch_size=cfg["batch_size"], eval_batches=cfg["eval_batches"],
                n_layer=1 if smoke else 2, n_embd=32 if smoke else 128, model=model,
                tokenizer="byte", device="cpu" if smoke else "cuda",
                precision=cfg["precision"], compile=cfg["compile"],
                max_time_s=cfg["max_time_s"], warmup_steps=min(30, steps // 4),
                extra_flags=tuple(cfg.get("extra_flags", ())))
    return spec, data


def text_corpus(path: Path, mb: float) -> None:
    """``mb`` megabytes of the installed packages' text in one file (byte-level tokens)."""
    from gasloc_p2p.data.registry import PACKAGES, _installed, sources

    if path.exists():
        return
    chosen, _ = sources([p for p in PACKAGES if _installed(p)], int(mb * 1e6))
    with path.open("w") as f:
        for src in chosen:
            f.write(src.path.read_text(encoding="utf-8", errors="replace") + "\n")


def swarm_figures(run: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Per node: its evaluations (wall seconds from its start, step, tokens, loss), bytes at
    its link, exit code; per arm: the mean final loss, bytes per node, and the int8 payload's
    time on the link against a round of this run's measured compute."""
    nodes = []
    for n in run["nodes"]:
        evals = n["evals"]
        t0 = evals[0]["t"] if evals and "t" in evals[0] else 0.0
        nodes.append({"name": n["name"], "exit_code": n["exit_code"],
                      "evals": [{"s": round(e.get("t", 0.0) - t0, 1), "step": e["step"],
                                 "tokens": e["tokens"], "loss": e["val_loss"]} for e in evals],
                      "link_tx_bytes": n.get("veth_tx_bytes"),
                      "program_bytes_sent": n.get("program_bytes_sent")})
    finals = [n["evals"][-1]["loss"] for n in nodes if n["evals"]]
    steps_s = [n["evals"][-1]["step"] / n["evals"][-1]["s"] for n in nodes
               if n["evals"] and n["evals"][-1]["s"] > 0]
    out: dict[str, Any] = {"nodes": nodes, "wall_s": run.get("wall_s"),
                           "final_loss": sum(finals) / len(finals) if finals else None}
    if steps_s and cfg.get("rate_mbit"):
        round_s = cfg["inner_steps"] / (sum(steps_s) / len(steps_s))
        payload_s = 136.6e6 * 8 / (cfg["rate_mbit"] * 1e6)  # 135M int8 codes and scales
        out.update(round_s=round_s, payload_s=payload_s, rounds_per_exchange=payload_s / round_s)
    return out


# ------------------------------------------------------------------------------ throughput
def _throughput(sl: Slice, left_s: float, smoke: bool, work: Path) -> list[Row]:
    """Every arm a process, one after another; at smoke size in this process."""
    rows, t0 = [], time.monotonic()
    for arm in sl.arms:
        cfg = {**arm.config, **(sl.smoke if smoke else {})}
        if smoke:
            from benchmarks.gpu_throughput import measure

            root = work / f"{len(rows)}"
            root.mkdir(exist_ok=True)
            rows.append({"arm": arm.label, "config": cfg, "status": "ok",
                         "figures": measure(cfg, root)})
            continue
        out = work / f"{len(rows)}.json"
        code, last = _process([sys.executable, "-m", "benchmarks.gpu_throughput", "--config",
                               json.dumps(cfg), "--out", str(out)],
                              left_s - (time.monotonic() - t0))
        row: Row = {"arm": arm.label, "config": cfg}
        if code == 0 and out.exists():
            rows.append({**row, "status": "ok", "figures": json.loads(out.read_text())})
        else:
            rows.append({**row, "status": "failed", "why": last})
    return rows


def _process(argv: list[str], left_s: float) -> tuple[int, str]:
    """Run ``argv`` in the repository within what is left of the slice (10 s kept): its exit
    code (-1: stopped at the deadline) and the last line it printed."""
    try:
        done = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True,
                              timeout=max(30.0, left_s - 10))
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        code, text = -1, "stopped at the window's deadline"
    return code, (text.strip().splitlines() or ["?"])[-1][-300:]


def _engine(sl: Slice, left_s: float, smoke: bool, work: Path) -> list[Row]:
    """Every arm a process, one after another: an exchange timed by ``bench_engine`` (at smoke
    size on this CPU) or pytest on the named tests (at smoke size: collected only)."""
    rows, t0 = [], time.monotonic()
    for k, arm in enumerate(sl.arms):
        cfg = {**arm.config, **({} if "tests" in arm.config or not smoke else sl.smoke)}
        out = work / f"{k}.json"
        if "tests" in cfg:
            argv = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                    *(["--collect-only"] if smoke else []), *cfg["tests"]]
        else:
            argv = [sys.executable, "-m", "benchmarks.bench_engine", "--sizes", "",
                    "--device", cfg.get("device", "cuda"), "--time-sizes", str(cfg["numel"]),
                    "--codecs", cfg["codec"], "--alone", "--json", str(out)]
        code, last = _process(argv, left_s - (time.monotonic() - t0))
        row: Row = {"arm": arm.label, "config": cfg}
        if "tests" in cfg:
            rows.append({**row, "status": "ok" if code == 0 else "failed",
                         "figures": {"summary": last, "returncode": code}})
        elif code == 0 and out.exists():
            rows.append({**row, "status": "ok",
                         "figures": json.loads(out.read_text())["times"][0]})
        else:
            rows.append({**row, "status": "failed", "why": last})
    return rows
