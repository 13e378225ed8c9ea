"""The GPU check (issue 22): ``make gpu-check`` (``scripts/gpu_check.sh``) on a machine with CUDA.

Offline (byte tokenizer, a corpus of the standard library's sources written on the spot, Llama
configs written here), about 10 minutes on one H100. Each part prints its figures and adds a
JSON record to ``--records``; the last step writes ``docs/results/gpu.md`` from them.

- ``tests``: the CUDA tests (tests/test_cuda.py, test_device_paths.py, test_streamed.py,
  test_train.py);
- ``memory``: a node training a 135M Llama (SmolLM-135M shape) in bf16: device bytes per
  parameter at rest, a step's peak, what a checkpoint and a state snapshot add
  (``torch.cuda.max_memory_allocated``), the plan's figure beside; the same for the
  Llama-3.2-1B shape with activation checkpointing and micro-batch 1 x 2048, with one
  exchange's buffers on top;
- ``throughput``: tokens/s of the 135M node alone and with exchanges running at the daemon's
  default rate (2 per 20-step round) and back to back;
- ``engine``: one exchange's tensor work at 135M and 1.236B against a device-to-device copy of
  the model's float32 bytes, alone and while the GPU is busy (``bench_engine``);
- ``compile1b`` (on request): the 1B shape's tokens/s and step peak, eager and ``--compile``;
- ``nodes``: two ``gasloc-node join`` processes on the GPU over loopback train the 135M Llama,
  gossip, write checkpoints; ``gasloc-node export`` writes one and ``transformers`` loads it.

Run: ``python -m benchmarks.gpu_check [--parts tests,memory,...] [--records R.jsonl]
[--write docs/results/gpu.md]``. Without CUDA it says so in one line and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

GiB = 1 << 30
PARTS = ("tests", "memory", "throughput", "engine", "nodes", "ranks")
WINDOW = 100  # steps per throughput window (40 left the ratios within 7% noise on an H200)
EXTRA = ("trace", "profile", "compile1b")  # diagnostics, on request
LLAMA_135M = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
              "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
              "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 2048,
              "tie_word_embeddings": True, "rope_theta": 10000.0, "rms_norm_eps": 1e-5}
LLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
            "max_position_embeddings": 131072, "tie_word_embeddings": True,
            "rope_theta": 500000.0, "rms_norm_eps": 1e-5}


def inputs(root: Path) -> dict[str, Path]:
    """Both configs and a corpus (the standard library's sources, about 8 MB)."""
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, cfg in (("135m", LLAMA_135M), ("1b", LLAMA_1B)):
        (root / name).mkdir(exist_ok=True)
        (root / name / "config.json").write_text(json.dumps(cfg))
        out[name] = root / name / "config.json"
    corpus = root / "corpus.txt"
    if not corpus.exists():
        texts, size = [], 0
        for src in sorted(Path(os.__file__).parent.glob("*.py")):
            texts.append(src.read_text(errors="replace"))
            size += len(texts[-1])
            if size > 8_000_000:
                break
        corpus.write_text("\n".join(texts))
    out["corpus"] = corpus
    return out


def trainer(config: Path, corpus: Path, **kw: Any) -> Any:
    from gasloc_p2p.core.async_state import AsyncConfig
    from gasloc_p2p.node.config_train import TrainConfig
    from gasloc_p2p.node.runtime.lock import TrainingLock
    from gasloc_p2p.node.runtime.trainer import Trainer
    from gasloc_p2p.node.stats import TrainStats

    base = {"model": str(config), "data": str(corpus), "tokenizer": "byte", "device": "cuda",
            "precision": "bf16", "seq_len": 512, "batch_size": 8, "eval_batches": 1,
            "warmup_steps": 5, "inner_steps": 20}
    node = Trainer(TrainConfig(**{**base, **kw}), AsyncConfig(), 1, TrainingLock(),
                   TrainStats())
    node.load_data(3)
    return node


def peak_of(fn: Any) -> tuple[Any, int]:
    """``fn()`` and the device bytes it added at its peak over what was allocated before."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def snapshot(node: Any) -> Any:
    """The gossip mode's state snapshot (what a late joiner downloads)."""
    from gasloc_p2p.node.modes.gossip import GossipMode

    mode = GossipMode()
    mode.ctx = SimpleNamespace(trainer=node, lock=node.lock, train_stats=node.stats)  # type: ignore[assignment]
    return mode.snapshot()


def exchange_once(node: Any) -> None:
    """One exchange's tensor work on this node against a payload of its own (the buffers an
    exchange holds: both payloads on the device, the engine's scratch)."""
    from gasloc_p2p.core.codecs import CodecSpec
    from gasloc_p2p.protocol.engine import ExchangeEngine

    spec = CodecSpec.parse("int8")
    engine = ExchangeEngine(node.state, node.theta0, node.fragments, node.lock)
    peer = engine.prepare("peer", 0, spec)
    mine = engine.prepare("me", 0, spec)
    got = engine.check(spec, node.flat.numel, peer.payload, peer.digest, mine)
    engine.commit(mine, got, 0.5)


def live_tensors(node: Any, top: int = 8) -> str:
    """The largest live CUDA tensors the garbage collector sees, apart from the parameters'
    buffer and the AdamW state, by storage (a diagnostic of memory at rest)."""
    import gc

    skip = {node.flat.buffer.untyped_storage().data_ptr()} | {
        t.untyped_storage().data_ptr() for st in node.optimizer.state.values()
        for t in st.values() if isinstance(t, torch.Tensor)}
    seen: dict[int, tuple[int, str]] = {}
    for obj in gc.get_objects():
        try:
            if not (isinstance(obj, torch.Tensor) and obj.is_cuda):
                continue
            ptr = obj.untyped_storage().data_ptr()
            if ptr in skip or ptr in seen:
                continue
            seen[ptr] = (obj.untyped_storage().nbytes(),
                         f"{tuple(obj.shape)} {str(obj.dtype).removeprefix('torch.')}")
        except Exception:  # noqa: BLE001, S112 (a diagnostic walks whatever it finds)
            continue
    total = sum(n for n, _ in seen.values())
    big = sorted(seen.values(), reverse=True)[:top]
    return (f"{len(seen)} tensors, {total / GiB:.3f} GiB: "
            + ", ".join(f"{n / 2**20:.0f} MiB {what}" for n, what in big))


def part_memory(paths: dict[str, Path]) -> list[dict[str, Any]]:
    import gc

    rows = []
    for name, kw in (("135m", {"seq_len": 512, "batch_size": 8}),
                     ("1b", {"seq_len": 2048, "batch_size": 1,
                             "activation_checkpointing": True})):
        rows.append(measure_node(name, paths, kw))
        gc.collect()  # the node's reference cycles: else it stays on the device (1.5 GiB at
        torch.cuda.empty_cache()  # 135M, counted in the 1B figures of earlier runs)
    return rows


def measure_node(name: str, paths: dict[str, Path], kw: dict[str, Any]) -> dict[str, Any]:
    from gasloc_p2p.node.config import NodeConfig
    from gasloc_p2p.node.plan import model_shape, plan

    t0 = time.monotonic()
    node = trainer(paths[name], paths["corpus"], **kw)
    built_s = time.monotonic() - t0
    n = node.flat.numel
    peak_of(lambda: [node.step() for _ in range(3)])
    rest = torch.cuda.memory_allocated()
    known = node.flat.buffer.nbytes + sum(
        t.nbytes for st in node.optimizer.state.values() for t in st.values()
        if isinstance(t, torch.Tensor) and t.is_cuda)
    print(f"memory {name}: at rest {rest / GiB:.2f} GiB, parameters and AdamW state "
          f"{known / GiB:.2f} GiB; the largest other live CUDA tensors: {live_tensors(node)}",
          flush=True)
    peak_total = torch.cuda.max_memory_allocated()
    _, ckpt = peak_of(node.state_for_checkpoint)
    _, snap = peak_of(lambda: snapshot(node))
    _, exch = peak_of(lambda: exchange_once(node))
    # the plan of the same node: its device total (estimates included)
    cfg = dataclasses.replace(NodeConfig(), train=node.cfg)
    planned = plan(cfg, "cuda", model_shape(str(paths[name]), node.cfg))["steady"]["device"]
    row = {"part": "memory", "model": name, "numel": n, "build_s": built_s,
           "seq_len": node.cfg.seq_len, "batch": node.cfg.batch_size,
           "act_ckpt": node.cfg.activation_checkpointing,
           "rest_b_per_param": rest / n,
           "step_peak_gib": peak_total / GiB, "checkpoint_extra_b_per_param": ckpt / n,
           "snapshot_extra_b_per_param": snap / n, "exchange_extra_gib": exch / GiB,
           "node_peak_gib": (peak_total + exch) / GiB, "plan_device_gib": planned / GiB}
    print(f"memory {name}: {n / 1e6:.1f}M params (built in {built_s:.0f} s), at rest "
          f"{row['rest_b_per_param']:.2f} B/param (gradients freed after each step), step peak {row['step_peak_gib']:.2f} GiB, checkpoint "
          f"+{row['checkpoint_extra_b_per_param']:.3f} B/param, snapshot "
          f"+{row['snapshot_extra_b_per_param']:.3f} B/param, exchange "
          f"+{row['exchange_extra_gib']:.2f} GiB; peak with an exchange "
          f"{row['node_peak_gib']:.2f} GiB (plan {row['plan_device_gib']:.2f} GiB)", flush=True)
    return row


def part_throughput(paths: dict[str, Path]) -> list[dict[str, Any]]:
    """Tokens/s alone, with exchanges at the daemon's rate and back to back (one process),
    eager and then with ``--compile`` (a compiled step leaves the GPU less idle time for
    the exchange's kernels to hide in)."""
    rows = []
    for compile_ in (False, True):
        rows += _throughput(paths, compile_)
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    return rows


def _throughput(paths: dict[str, Path], compile_: bool) -> list[dict[str, Any]]:
    from gasloc_p2p.core.codecs import CodecSpec
    from gasloc_p2p.protocol.engine import ExchangeEngine

    node = trainer(paths["135m"], paths["corpus"], compile=compile_)
    node.warm_up()
    spec = CodecSpec.parse("int8")
    engine = ExchangeEngine(node.state, node.theta0, node.fragments, node.lock)
    peer = engine.prepare("peer", 0, spec)
    received = engine.payload_buffer(len(peer.payload))  # as the session receives it
    received[:] = peer.payload
    digest = peer.digest
    for _ in range(5):
        node.step()

    def steps(count: int, every: int) -> tuple[float, int]:
        """Tokens/s over ``count`` steps while exchanges start every ``every`` steps (0:
        none, -1: back to back) in their own thread, as the daemon runs them."""
        stop, done = threading.Event(), [0]

        def exchanges() -> None:
            last = node.stats.step
            while not stop.is_set():
                if every > 0 and node.stats.step - last < every:
                    time.sleep(0.001)
                    continue
                last = node.stats.step
                prep = engine.prepare("peer", 0, spec)
                got = engine.check(spec, node.flat.numel, received, digest, prep, digest)
                engine.commit(prep, got, 0.0)  # weight 0: the parameters stay as they are
                done[0] += 1

        worker = threading.Thread(target=exchanges) if every else None
        if worker is not None:
            worker.start()
        torch.cuda.synchronize()
        t0, tokens0 = time.perf_counter(), node.stats.tokens
        for _ in range(count):
            node.step()
        torch.cuda.synchronize()
        rate = (node.stats.tokens - tokens0) / (time.perf_counter() - t0)
        stop.set()
        if worker is not None:
            worker.join()
        return rate, done[0]

    rows = []
    solo = [steps(WINDOW, 0)[0]]
    for label, every in (("2 per 20-step round", 10), ("back to back", -1)):
        rate, count = steps(WINDOW, every)
        solo.append(steps(WINDOW, 0)[0])  # solo again, interleaved: drift cancels
        ref = sum(solo[-2:]) / 2
        rows.append({"part": "throughput", "label": label, "tokens_per_s": rate,
                     "solo_tokens_per_s": ref, "ratio": rate / ref, "exchanges": count,
                     "compile": compile_})
        print(f"throughput 135M bf16{' compiled' if compile_ else ''}, exchanges {label}: "
              f"{rate:,.0f} tokens/s vs solo "
              f"{ref:,.0f} = {rate / ref:.3f} ({count} exchanges in {WINDOW} steps)", flush=True)
    return rows


def part_compile1b(paths: dict[str, Path], steps: int = 12) -> list[dict[str, Any]]:
    """The 1B Llama shape (bf16, micro-batch 1 x 2048, activation checkpointing) eager and
    with ``--compile``: tokens/s over ``steps`` steps after warm-up, the compilation's time
    and each step's peak device memory, one node after the other."""
    import gc

    rows = []
    for compile_ in (False, True):
        t0 = time.monotonic()
        row: dict[str, Any] = {"part": "compile1b", "compile": compile_}
        try:
            node = trainer(paths["1b"], paths["corpus"], seq_len=2048, batch_size=1,
                           activation_checkpointing=True, compile=compile_)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            node.warm_up()
            for _ in range(3):
                node.step()
            torch.cuda.synchronize()
            row["first_peak_gib"] = torch.cuda.max_memory_allocated() / GiB  # warm-up, 3 steps
            row["ready_s"] = time.monotonic() - t0
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t1, tokens0 = time.perf_counter(), node.stats.tokens
            for _ in range(steps):
                node.step()
            torch.cuda.synchronize()
            row["tokens_per_s"] = (node.stats.tokens - tokens0) / (time.perf_counter() - t1)
            row["peak_gib"] = torch.cuda.max_memory_allocated() / GiB
            row["numel"] = node.flat.numel
            print(f"compile1b: 1B bf16 1 x 2048, activation checkpointing"
                  f"{', --compile' if compile_ else ', eager'}: {row['tokens_per_s']:,.0f} "
                  f"tokens/s, peak {row['peak_gib']:.2f} GiB (the warm-up and first 3 steps: "
                  f"{row['first_peak_gib']:.2f} GiB), ready in {row['ready_s']:.0f} s",
                  flush=True)
        except Exception as e:  # noqa: BLE001 - a failed row is reported, the check goes on
            row["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"compile1b (compile={compile_}): failed: {row['failed']}", flush=True)
        rows.append(row)
        node = None
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def part_engine() -> list[dict[str, Any]]:
    """One exchange's tensor work: the fused Triton kernels (the engine's on a GPU) at 135M
    and 1.2B, alone and with the GPU busy, and the eager passes beside them at 1.2B."""
    from benchmarks.bench_engine import describe, time_exchange

    rows = []
    for n, busy, kernels in ((135_000_000, False, None), (1_236_000_000, False, None),
                             (1_236_000_000, False, False), (1_236_000_000, True, None)):
        try:
            r = time_exchange(n, "cuda", busy, kernels=kernels)
        except Exception as e:  # noqa: BLE001 - a failed row is reported, the check goes on
            print(f"engine {n / 1e6:.0f}M: failed: {type(e).__name__}: {e}", flush=True)
            rows.append({"part": "engine", "numel": n, "busy": busy, "failed": repr(e)[:300]})
            continue
        rows.append({"part": "engine", "numel": n, "busy": busy, **r})
        print(f"engine {n / 1e6:.0f}M{' (GPU busy)' if busy else ''}: {describe(r)}",
              flush=True)
        torch.cuda.empty_cache()
    return rows


def part_nodes(paths: dict[str, Path], root: Path) -> list[dict[str, Any]]:
    """Two real nodes on the GPU over loopback, one eager and one with ``--compile``: train,
    gossip, checkpoint; export; load."""
    from gasloc_p2p.tools.nodes import NodeChild

    flags = ["--model", str(paths["135m"]), "--data", str(paths["corpus"]), "--tokenizer",
             "byte", "--device", "cuda", "--precision", "bf16", "--seq-len", "256",
             "--batch-size", "8", "--inner-steps", "10", "--exchanges-per-round", "2",
             "--host", "127.0.0.1", "--eval-batches", "2", "--eval-interval-steps", "50",
             "--announce-interval-s", "1", "--announce-ttl-s", "4", "--refresh-interval-s",
             "1", "--log-interval-s", "10", "--no-init-from-swarm"]
    nodes: list[NodeChild] = []
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    infos: dict[str, Any] = {}
    try:
        seed = NodeChild("gpu0", root, [*flags, "--checkpoint-dir", str(root / "ckpt0")])
        nodes.append(seed)
        peers = seed.join_peers(180)
        nodes.append(NodeChild("gpu1", root, [*flags, "--checkpoint-dir", str(root / "ckpt1"),
                                              "--compile", "--peers", *peers]))
        for node in nodes:
            node.wait_up(180)
        deadline = time.monotonic() + 150  # until both exchanged a few times, at most this

        def exchanged(info: Any) -> int:
            return int(info.exchanges_ok_initiator + info.exchanges_ok_responder)

        while time.monotonic() < deadline:
            for node in nodes:
                with contextlib.suppress(Exception):
                    infos[node.name] = node.info()
            if len(infos) == 2 and all(exchanged(i) >= 6 for i in infos.values()):
                break
            time.sleep(2)
        for node in nodes:
            node.terminate()  # SIGTERM: each writes its checkpoint and exits
        codes = [n.proc.wait(timeout=120) for n in nodes]
    finally:
        for node in nodes:
            node.kill()
    took = time.monotonic() - t0
    out = root / "export"
    subprocess.run([sys.executable, "-m", "gasloc_p2p.cli", "export", "--checkpoint-dir",
                    str(root / "ckpt0"), str(root / "ckpt1"), "--which", "average", "--out",
                    str(out)], check=True)
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out).cuda().eval()
    text = paths["corpus"].read_bytes()[:257]
    ids = torch.tensor([list(text)], device="cuda")
    with torch.no_grad():
        loss = float(model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss)
    row = {"part": "nodes", "exit_codes": codes, "seconds": took,
           "steps": [int(i.step) for i in infos.values()],
           "exchanges": [int(i.exchanges_ok_initiator + i.exchanges_ok_responder)
                         for i in infos.values()],
           "tokens_per_s": [float(i.tokens_per_s) for i in infos.values()],
           "export_loss": loss, "shards": len(list(out.glob("*.safetensors")))}
    print(f"nodes: exit {codes} after {took:.0f} s, steps {row['steps']}, exchanges "
          f"{row['exchanges']}, tokens/s {[round(x) for x in row['tokens_per_s']]}; export "
          f"({row['shards']} safetensors file(s)) loads in transformers, loss {loss:.3f}",
          flush=True)
    return [row]


def part_trace(paths: dict[str, Path], layers: int = 2) -> list[dict[str, Any]]:
    """Where a step's device memory goes (the 1B shape cut to ``layers`` layers: the same
    vocabulary and widths): the live allocations at rest and at the step's peak, largest
    first, each with the innermost frames that made it; and whether every parameter's AdamW
    took one step per training step."""
    from collections import defaultdict

    cfg = {**LLAMA_1B, "num_hidden_layers": layers}
    (paths["1b"].parent.parent / "cut").mkdir(exist_ok=True)
    config = paths["1b"].parent.parent / "cut" / "config.json"
    config.write_text(json.dumps(cfg))
    node = trainer(config, paths["corpus"], seq_len=2048, batch_size=1,
                   activation_checkpointing=True)
    node.step()
    torch.cuda.synchronize()
    snap: dict[str, Any] = {}
    for stacks in ("python", None):  # Python frames, else sizes only
        try:
            if stacks is None:
                torch.cuda.memory._record_memory_history(max_entries=500_000, context=None)
            else:
                torch.cuda.memory._record_memory_history(max_entries=500_000, stacks=stacks)
            node.step()
            node.step()
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
            break
        except Exception as exc:  # noqa: BLE001 (a diagnostic: say what failed, go on)
            print(f"trace: recording with stacks={stacks} failed ({type(exc).__name__}: "
                  f"{exc}); again without", flush=True)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
    live: dict[int, tuple[int, str]] = {}
    peak, at_peak = 0, {}
    for event in snap["device_traces"][0]:
        if event["action"] == "alloc":
            frames = [f"{Path(f['filename']).name}:{f['line']}:{f['name']}"
                      for f in event.get("frames", [])
                      if "gasloc_p2p" in f["filename"] or "transformers" in f["filename"]]
            live[event["addr"]] = (event["size"], " < ".join(frames[:3])
                                   or f"{event['size'] / 2**20:.0f} MiB block")
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
        total = sum(size for size, _ in live.values())
        if total > peak:
            peak, at_peak = total, dict(live)

    def top(blocks: dict[int, tuple[int, str]]) -> list[str]:
        by: dict[str, int] = defaultdict(int)
        for size, where in blocks.values():
            by[where] += size
        return [f"{n / GiB:.2f} GiB {w or '(no project frame)'}"
                for w, n in sorted(by.items(), key=lambda kv: -kv[1])[:12]]

    steps = {int(st["step"]) for st in node.optimizer.state.values() if "step" in st}
    n = node.flat.numel
    print(f"trace: {n / 1e6:.0f}M parameters ({layers} layers), allocated at rest "
          f"{torch.cuda.memory_allocated() / GiB:.2f} GiB, traced peak above the trace's "
          f"start {peak / GiB:.2f} GiB; AdamW steps per parameter {sorted(steps)} (3 wanted)")
    print("  at the peak:\n    " + "\n    ".join(top(at_peak)))
    print("  left at the end:\n    " + "\n    ".join(top(live)))
    return [{"part": "trace", "numel": n, "peak_gib": peak / GiB, "steps": sorted(steps),
             "at_peak": top(at_peak), "left": top(live)}]


def part_profile(paths: dict[str, Path], device: str = "cuda", steps: int = 5,
                 compiled: bool = True) -> list[dict[str, Any]]:
    """Where a training step of the 135M node goes (the throughput part measured about 15k
    tokens/s on an H200, a few percent of its bf16 peak): the host's time per step against
    the kernels' (a host-bound step launches faster than the GPU runs, or not), the kernels
    per step, the ops that take the host's time and the kernels that take the GPU's, and
    the model-FLOP utilisation against a matrix product measured on the spot; then tokens/s
    with ``--compile`` beside eager."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    peak = 0.0
    if cuda:  # bf16 matrix products: this card's reachable peak
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        for _ in range(3):
            a @ a
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
        peak = 10 * 2 * 8192**3 / (time.perf_counter() - t0)
        del a
    rows = []
    for compile_ in ((False, True) if compiled else (False,)):
        node = trainer(paths["135m"], paths["corpus"], device=device, compile=compile_)
        for _ in range(5):  # warm-up (and compilation)
            node.step()
        if cuda:
            torch.cuda.synchronize()
        t0, tokens0 = time.perf_counter(), node.stats.tokens
        for _ in range(10):
            node.step()
        if cuda:
            torch.cuda.synchronize()
        rate = (node.stats.tokens - tokens0) / (time.perf_counter() - t0)
        row: dict[str, Any] = {"part": "profile", "compile": compile_, "tokens_per_s": rate,
                               "params": node.flat.numel,
                               "mfu": 6 * node.flat.numel * rate / peak if peak else 0.0,
                               "peak_tflops": peak / 1e12}
        print(f"profile 135M{' compiled' if compile_ else ''}: {rate:,.0f} tokens/s, "
              f"model FLOPs {6 * node.flat.numel * rate / 1e12:.1f} TFLOP/s"
              + (f" = {row['mfu']:.1%} of {peak / 1e12:.0f} (bf16 products here)"
                 if peak else ""), flush=True)
        if not compile_:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                t0 = time.perf_counter()
                for _ in range(steps):
                    node.step()
                if cuda:
                    torch.cuda.synchronize()
                host_s = (time.perf_counter() - t0) / steps
            kernels = [e for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA]
            busy = sum(e.device_time for e in kernels) / 1e6 / steps
            row.update({"step_s": host_s, "kernel_s_per_step": busy,
                        "kernels_per_step": len(kernels) / steps})
            print(f"profile 135M: a step {host_s * 1e3:.1f} ms, kernels {busy * 1e3:.1f} ms "
                  f"({len(kernels) / steps:.0f} launches): the GPU is busy "
                  f"{busy / host_s:.0%} of the step", flush=True)
            table = prof.key_averages()
            print(table.table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
            if cuda:
                print(table.table(sort_by="self_device_time_total", row_limit=12), flush=True)
        rows.append(row)
        del node
        import gc

        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return rows


def part_tests() -> list[dict[str, Any]]:
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_cuda.py", "tests/test_device_paths.py",
                           "tests/test_streamed.py", "tests/test_train.py"],
                          capture_output=True, text=True, env=env)
    summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    print(f"CUDA tests: {summary}", flush=True)
    if done.returncode:
        print(done.stdout[-6000:], done.stderr[-2000:], sep="\n", flush=True)
    return [{"part": "tests", "summary": summary, "returncode": done.returncode}]


def part_ranks() -> list[dict[str, Any]]:
    """A node of 2 GPU ranks (NCCL): its CUDA tests, then its step throughput against one
    rank on the same model and node batch (benchmarks/bench_ranks.py). Needs 2 GPUs."""
    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(f"ranks: skipped, this machine has {gpus} GPU (a node of 2 ranks needs 2)")
        return [{"part": "ranks", "gpus": gpus, "summary": "skipped: 1 GPU"}]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_ranks.py"], capture_output=True, text=True)
    summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    print(f"rank tests: {summary}", flush=True)
    bench = subprocess.run([sys.executable, "-m", "benchmarks.bench_ranks", "--n-layer", "8",
                            "--n-embd", "1024", "--n-head", "16", "--seq-len", "512",
                            "--batch-size", "16", "--steps", "30"],
                           capture_output=True, text=True)
    print(bench.stdout[-3000:], bench.stderr[-2000:] if bench.returncode else "", flush=True)
    rows = [ln for ln in bench.stdout.splitlines() if ln.startswith("| ") and "x |" in ln]
    return [{"part": "ranks", "gpus": gpus, "summary": summary, "returncode": done.returncode,
             "bench": rows}]


def write_table(records: list[dict[str, Any]], path: Path) -> None:
    """docs/results/gpu.md from the records."""
    gpu = next((r["gpu"] for r in records if "gpu" in r), "?")
    lines = ["# The GPU check", "",
             f"`make gpu-check` on {gpu} (issue 22). Rerun: `make gpu-check` (about 10 "
             "minutes on one H100; offline). Targets from the issue in the last column.", "",
             "| figure | measured | target |", "|---|---|---|"]
    for r in records:
        if r["part"] in ("trace", "profile"):
            continue  # a diagnostic: printed, not tabled
        if r["part"] == "compile1b":
            lines.append(f"| 1B Llama bf16, 1 x 2048, activation checkpointing, "
                         f"{'--compile' if r['compile'] else 'eager'}: tokens/s, step peak "
                         f"(first steps' peak), ready after | " + (r["failed"] if "failed" in r
                         else f"{r['tokens_per_s']:,.0f}, {r['peak_gib']:.2f} GiB "
                         f"({r.get('first_peak_gib', float('nan')):.2f} GiB), "
                         f"{r['ready_s']:.0f} s") + " | (diagnostic) |")
            continue
        if r["part"] == "tests":
            lines.append(f"| CUDA tests (test_cuda, test_device_paths, test_streamed, test_train) | {r['summary']} | "
                         "all pass |")
        elif r["part"] == "memory":
            what = (f"{r['model']} Llama bf16, micro-batch {r['batch']} x {r['seq_len']}"
                    + (", activation checkpointing" if r["act_ckpt"] else ""))
            lines += [
                f"| {what}: device B/param at rest (`memory_allocated`) | "
                f"{r['rest_b_per_param']:.2f} | <= 16.5 |",
                f"| {what}: a checkpoint / a state snapshot adds | "
                f"{r['checkpoint_extra_b_per_param']:.3f} / {r['snapshot_extra_b_per_param']:.3f}"
                " B/param | <= 17 in all |",
                f"| {what}: peak (steps), with an exchange on top; `plan` | "
                f"{r['step_peak_gib']:.2f} GiB, {r['node_peak_gib']:.2f} GiB; "
                f"{r['plan_device_gib']:.2f} GiB | 1B: fits 24 GiB |"]
        elif r["part"] == "throughput":
            lines.append(f"| 135M tokens/s{' (--compile)' if r.get('compile') else ''} "
                         f"with exchanges {r['label']} / solo | "
                         f"{r['tokens_per_s']:,.0f} / {r['solo_tokens_per_s']:,.0f} = "
                         f"{r['ratio']:.3f} | >= 0.95 |")
        elif r["part"] == "engine":
            if "failed" in r:
                lines.append(f"| one exchange at {r['numel'] / 1e6:,.0f}M | failed: "
                             f"{r['failed']} | <= 5x |")
                continue
            how = ("payloads on the device" if not r.get("streamed")
                   else "fused kernels" if r.get("fused") else "eager passes")
            if r["busy"]:  # the profiler counts the load's kernels too: only the wall time
                lines.append(f"| one exchange at {r['numel'] / 1e6:,.0f}M, {how}, the GPU busy "
                             f"with matrix products: wall time | {r['exchange_s'] * 1e3:.0f} ms "
                             "(alone: the row above) | |")
                continue
            lines.append(f"| one exchange at {r['numel'] / 1e6:,.0f}M, {how}"
                         f"{' (GPU busy)' if r['busy'] else ''}: kernels / device copy of the "
                         f"fp32 model | {r['kernels_s'] * 1e3:.2f} ms / {r['copy_s'] * 1e3:.2f} "
                         f"ms = {r['kernel_ratio']:.1f}x (wall {r['exchange_s'] * 1e3:.0f} ms: "
                         f"host<->device copies {r['copies_s'] * 1e3:.0f} ms, SHA-256 of our payload "
                         f"{r['digest_s'] * 1e3:.0f} ms) | <= 5x |")
        elif r["part"] == "ranks":
            lines.append(f"| a node of 2 GPU ranks (tests/test_ranks.py; bench_ranks) | "
                         f"{r['summary']}; {' / '.join(r.get('bench', []))} | pass, >= 1.7x |")
        elif r["part"] == "nodes":
            lines.append(f"| two `gasloc-node join` on one GPU, 135M bf16 (the second with "
                         f"`--compile`), steps {r['steps']} | "
                         f"exit {r['exit_codes']}, exchanges {r['exchanges']}, tokens/s "
                         f"{[round(x) for x in r['tokens_per_s']]}; export of the average "
                         f"loads in transformers (loss {r['export_loss']:.2f}) | train, gossip, "
                         "export |")
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--records", default="", help="append JSON lines here (default: a temp file)")
    p.add_argument("--write", default="docs/results/gpu.md", help="the table ('' : none)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine (torch.cuda.is_available() is False); "
              "nothing to check")
        return 0
    root = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    records_path = Path(args.records or root / "records.jsonl")
    paths = inputs(root / "inputs")
    gpu = f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    failed = False
    for part in args.parts.split(","):
        t0 = time.monotonic()
        if part == "tests":
            rows = part_tests()
            failed |= rows[0]["returncode"] != 0
        elif part == "memory":
            rows = part_memory(paths)
        elif part == "throughput":
            rows = part_throughput(paths)
        elif part == "engine":
            rows = part_engine()
        elif part == "nodes":
            rows = part_nodes(paths, root / "nodes")
        elif part == "trace":
            rows = part_trace(paths)
        elif part == "profile":
            rows = part_profile(paths)
        elif part == "compile1b":
            rows = part_compile1b(paths)
        elif part == "ranks":
            rows = part_ranks()
            failed |= rows[0].get("returncode", 0) != 0
        else:
            raise SystemExit(f"--parts: unknown part {part!r} (choose from {PARTS + EXTRA})")
        print(f"[{part}: {time.monotonic() - t0:.0f} s]", flush=True)
        with records_path.open("a") as f:
            for row in rows:
                f.write(json.dumps({**row, "gpu": gpu}) + "\n")
    if args.write:
        records = [json.loads(line) for line in records_path.read_text().splitlines()]
        write_table(records, Path(args.write))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
