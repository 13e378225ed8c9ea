"""Step throughput of a node of K ranks against a node of one rank, side by side in one run.

``python -m benchmarks.bench_ranks [--ranks 2] [--steps 40]`` (``make bench-ranks``) times the
node's own trainer (:class:`Trainer` with DDP over real ``torch.distributed`` ranks, gloo on a
CPU, NCCL on GPUs) on the same model and the same node batch, split over the ranks:

- 1 rank with ``--threads`` torch threads per rank (one device's worth),
- K ranks with as many threads each, DDP (replicas), then FSDP2 (``--sharding fsdp``: each
  rank holds 1/K of the model),
- 1 rank with K x ``--threads`` threads (the whole machine to one process: what a CPU user
  could run instead),

each after ``--warmup`` steps, in this order, and prints tokens per second, the step time and
the ratios; then what each rank holds, counted tensor by tensor after the timed steps
(parameters, the gradients present at an optimizer step, AdamW moments: the training device's
model-sized memory, activations apart; on a GPU also the allocator's peak) and what rank 0
keeps in host memory (its full copy of the parameters when sharded, the outer state, theta_0,
the rollback copy), in bytes per parameter of the model. Then (``--exchanges N``, 0 to skip) the gossip traffic: a node of K ranks and a
node of one rank in one swarm of real ``gasloc-node join`` processes, until each has committed
N exchanges; it prints each node's payload bytes sent per committed exchange (one payload per
exchange whatever the ranks: the two are the same). The issue's target is K ranks >= 1.7x one rank at K=2; on a CPU the ranks share
the machine's memory bandwidth and cores with the gradient all-reduce (gloo, one bucket set
per step), which is what limits it here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gasloc_p2p.core.async_state import AsyncConfig
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.node.config import TrainConfig
from gasloc_p2p.node.launch import free_port, rank_env
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.runtime.ranks import RankGroup, distributed_env, follow
from gasloc_p2p.node.runtime.trainer import Trainer, follower_replica
from gasloc_p2p.node.stats import TrainStats

ROOT = Path(__file__).resolve().parents[1]


def _config(args: argparse.Namespace, threads: int, world: int,
            sharding: str = "ddp") -> TrainConfig:
    """The measured node: the built-in GPT on a corpus of this Python's own sources."""
    corpus = Path(args.workdir) / "corpus.txt"
    if not corpus.exists():
        sources = sorted(Path(argparse.__file__).parent.glob("*.py"))[:40]
        corpus.write_text("\n".join(f.read_text(errors="replace") for f in sources))
    gpus = torch.cuda.device_count()
    return TrainConfig(data=str(corpus), device="auto" if gpus >= args.ranks else "cpu", n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                       seq_len=args.seq_len, batch_size=args.batch_size, torch_threads=threads,
                       nproc_per_node=world, inner_steps=1000, warmup_steps=10, eval_batches=1,
                       sharding=sharding)


def worker(args: argparse.Namespace) -> int:
    """One process of a measurement (a single rank, or one of K)."""
    found = distributed_env()
    group = RankGroup(*found) if found is not None else None
    try:
        return _measure_here(args, group)
    finally:
        if group is not None:  # before the interpreter's teardown (gloo's threads)
            group.close()


def _measure_here(args: argparse.Namespace, group: RankGroup | None) -> int:
    if group is not None and not group.leader:
        held: list[Any] = []

        def build(got: Any, ranks: RankGroup) -> Any:
            replica = follower_replica(got, ranks)
            held.append(_Counted(replica.inner.model, replica.inner.optimizer))
            return replica

        code = follow(group, build)
        Path(f"{args.out}.rank{group.rank}").write_text(json.dumps(held[0].figures()))
        return code
    cfg = _config(args, args.threads, group.world if group else 1, args.sharding)
    trainer = Trainer(cfg, AsyncConfig(), 1, TrainingLock(), TrainStats(), ranks=group)
    counted = _Counted(trainer.model, trainer.optimizer)
    trainer.load_data(1)
    torch.set_num_threads(cfg.torch_threads)
    for _ in range(args.warmup):
        trainer.step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        trainer.step()
    dt = time.perf_counter() - t0
    costs = _exchange_costs(trainer)
    trainer.stop_ranks()
    tokens = args.steps * cfg.batch_size * cfg.grad_accum * cfg.seq_len
    host = {p.name: p.nbytes for p in trainer.placement() if p.where == "host"}
    Path(args.out).write_text(json.dumps({
        "tokens_per_s": tokens / dt, "step_s": dt / args.steps, "numel": trainer.flat.numel,
        "ranks": [counted.figures()], "host": host, **costs}))
    return 0


def _exchange_costs(trainer: Trainer, repeats: int = 5) -> dict[str, float]:
    """What an exchange costs the node's training beyond a one-rank node's, medians of
    ``repeats``: reading the parameters after a step (sharded: every rank's rows gathered into
    rank 0's copy; else nothing), and a write's hand-back (the step after a write minus a plain
    step: sharded, rank 0's copy scattered into the rows; DDP, the parameters broadcast)."""
    fill, plain, after_write = [], [], []
    for _ in range(repeats):
        trainer.step()
        t0 = time.perf_counter()
        with trainer.lock.urgent(writes=False):  # a reader: an exchange's prepare
            pass
        fill.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        trainer.step()
        plain.append(time.perf_counter() - t0)
        with trainer.lock.urgent():  # a writer: a commit
            pass
        t0 = time.perf_counter()
        trainer.step()
        after_write.append(time.perf_counter() - t0)
    return {"fill_s": statistics.median(fill),
            "handback_s": statistics.median(after_write) - statistics.median(plain)}


class _Counted:
    """One rank's model-sized device tensors: its parameters (its rows, when sharded), the
    gradients present when AdamW steps (largest seen), the AdamW moments."""

    def __init__(self, model: torch.nn.Module, optimizer: Any) -> None:
        self.model, self.optimizer, self.grads = model, optimizer, 0
        step = optimizer.step

        def counting_step(*a: Any, **kw: Any) -> Any:
            self.grads = max(self.grads, sum(_local(p.grad).nbytes for p in model.parameters()
                                             if p.grad is not None))
            return step(*a, **kw)

        optimizer.step = counting_step

    def figures(self) -> dict[str, float]:
        moments = sum(_local(t).nbytes for st in self.optimizer.state.values()
                      for t in st.values() if isinstance(t, torch.Tensor) and t.numel() > 1)
        out = {"parameters": float(sum(_local(p).nbytes for p in self.model.parameters())),
               "gradients": float(self.grads), "moments": float(moments)}
        if torch.cuda.is_available():
            out["cuda_peak"] = float(torch.cuda.max_memory_allocated())
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local rows (this rank's), else the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def measure(args: argparse.Namespace, world: int, threads: int,
            sharding: str = "ddp") -> dict[str, Any]:
    out = Path(args.workdir) / f"r{world}-t{threads}-{sharding}.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_ranks", "--worker", "--out", str(out),
           "--threads", str(threads), "--sharding", sharding, *_shape(args)]
    base = dict(os.environ, PYTHONPATH=str(ROOT))
    port = free_port()
    envs = [base] if world == 1 else [rank_env(base, r, world, port) for r in range(world)]
    procs = [subprocess.Popen(cmd, env=env, cwd=ROOT) for env in envs]
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")
    found = json.loads(out.read_text())
    found["ranks"] += [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(1, world)]
    return found


def _shape(args: argparse.Namespace) -> list[str]:
    return ["--steps", str(args.steps), "--warmup", str(args.warmup), "--workdir", args.workdir,
            "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head",
            str(args.n_head), "--seq-len", str(args.seq_len), "--batch-size",
            str(args.batch_size)]


def counters(url: str) -> dict[str, float] | None:
    """A node's exchange outcomes (ok: applied with weight > 0; committed: with any weight;
    failed, busy, rejected) and payload bytes sent."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    out = {"sent": 0.0, "committed": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "gasloc_exchanges_total":
                out[s.labels["outcome"]] = s.value
            elif s.name == "gasloc_exchanges_by_role_total":
                out["committed"] += s.value
            elif s.name == "gasloc_sent_bytes_total":
                out["sent"] += s.value
    return out


def traffic(args: argparse.Namespace) -> list[tuple[str, dict[str, float]]]:
    """(node, its exchange counters and payload bytes sent) in a swarm of a K-rank node and a
    1-rank node (the model of the step measurements, a few minutes)."""
    from gasloc_p2p.tools.nodes import METRICS_LINE, NodeChild

    cfg = _config(args, args.threads, 1)
    flags = ["--data", cfg.data, "--device", "cpu", "--host", "127.0.0.1", "--n-layer",
             str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head", str(args.n_head),
             "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
             "--no-init-from-swarm", "--inner-steps", "20"]
    logs = Path(args.workdir)
    nodes = [NodeChild("ranks", logs, [*flags, "--nproc-per-node", str(args.ranks)])]
    try:
        peers = nodes[0].join_peers(120)
        nodes.append(NodeChild("single", logs, [*flags, "--peers", *peers]))
        urls = [n.wait_for(METRICS_LINE, 120).group(1) for n in nodes]
        deadline = time.monotonic() + 1200
        while True:
            views = [counters(u) for u in urls]
            if all(v is not None and v.get("ok", 0) >= args.exchanges for v in views):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"fewer than {args.exchanges} exchanges in 20 minutes")
            time.sleep(1.0)
        return [(name, v) for name, v in
                zip((f"{args.ranks} ranks", "1 rank"), views, strict=True) if v is not None]
    finally:
        for node in nodes:
            node.stop(30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workdir", default="runs/bench_ranks")
    p.add_argument("--exchanges", type=int, default=10,
                   help="committed exchanges per node in the traffic part (0: skip it)")
    p.add_argument("--sharding", default="ddp", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        code = worker(args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # as gasloc-node does: DDP's teardown aborted 1 exit in a few
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    k, t = args.ranks, args.threads
    one = measure(args, 1, t)
    many = measure(args, k, t)
    sharded = measure(args, k, t, "fsdp")
    gpu = torch.cuda.is_available()
    whole = None if gpu else measure(args, 1, k * t)
    numel = one["numel"]
    print(f"# bench_ranks: {numel:,} parameters, node batch {args.batch_size} x "
          f"{args.seq_len} tokens, {args.steps} timed steps, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}")
    print("| node | threads per rank | step (s) | tokens/s | vs 1 rank |")
    print("|---|---|---|---|---|")
    rows = [("1 rank", t, one), (f"{k} ranks (DDP)", t, many), (f"{k} ranks (FSDP2)", t, sharded)]
    if whole is not None:  # a CPU: the same cores as threads of one process
        rows.append(("1 rank, all threads", k * t, whole))
    for name, threads, r in rows:
        print(f"| {name} | {threads} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
              f"{r['tokens_per_s'] / one['tokens_per_s']:.2f}x |")
    print("\n# what each rank holds on its training device (bytes per parameter of the model, "
          "activations apart), and rank 0's host memory")
    print("| node | rank | parameters | gradients (at the step) | AdamW moments | device total "
          f"|{' allocator peak (GiB) |' if gpu else ''} rank 0's host: full copy + outer state "
          "+ theta_0 + rollback |")
    print("|---|---|---|---|---|---|" + ("---|" if gpu else "") + "---|")
    for name, _, r in rows[:3]:
        host = r["host"]
        full = host.get("parameters, full copy (rank 0)", 0)
        rest = sum(v for n, v in host.items() if n != "parameters, full copy (rank 0)")
        for rank, f in enumerate(r["ranks"]):
            dev = f["parameters"] + f["gradients"] + f["moments"]
            peak = f" {f['cuda_peak'] / 2**30:.2f} |" if gpu else ""
            print(f"| {name} | {rank} | {f['parameters'] / numel:.2f} | "
                  f"{f['gradients'] / numel:.2f} | {f['moments'] / numel:.2f} | "
                  f"{dev / numel:.2f} |{peak} "
                  + (f"{full / numel:.0f} + {rest / numel:.1f} |" if rank == 0 else "|"))
    payload = CodecSpec.parse("int8").codec().wire_bytes(numel)
    print("\n# what an exchange costs the node's training beyond its payload (medians of 5; "
          "a sharded node keeps one full copy of the parameters on rank 0's host: filled "
          "from the rows before an exchange reads it, handed back after a commit), against "
          "the int8 payload's time on a 100 Mbit/s link")
    print("| node | fill before a read (s) | hand-back after a write (s) | "
          "int8 payload at 100 Mbit/s (s) |")
    print("|---|---|---|---|")
    for name, _, r in rows[:3]:
        print(f"| {name} | {r['fill_s']:.4f} | {r['handback_s']:.4f} | "
              f"{payload * 8 / 1e8:.3f} |")
    if args.exchanges > 0:
        print(f"\n# gossip traffic: a swarm of a {k}-rank node and a 1-rank node, int8 payloads "
              f"of {payload:,} bytes, after {args.exchanges}+ applied exchanges each. "
              "Payloads sent: payload bytes sent / payload size. Every exchange of the swarm "
              "is between these two nodes, each sending one payload: equal counts mean one "
              "payload per exchange from the K-rank node too, not K.")
        print("| node | exchanges committed (applied: weight > 0) / failed | payloads sent |")
        print("|---|---|---|")
        for name, v in traffic(args):
            print(f"| {name} | {v['committed']:.0f} ({v.get('ok', 0):.0f}) / "
                  f"{v.get('failed', 0):.0f} | {v['sent'] / payload:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
