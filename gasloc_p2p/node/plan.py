"""``gasloc-node plan``: the memory a node will need, per buffer, on the device and the host.

The model is built on PyTorch's meta device (shapes, no storage), so a 1B-parameter plan takes
a second. The model-sized buffers come from :func:`model_buffers`, which decides what exists by
the rules the node allocates with (the outer optimizer's ``reads_anchor`` and named buffers,
the mode's ``keeps_anchor``); ``tests/test_plan.py`` checks those figures against
what a CPU node actually holds (:meth:`Trainer.placement`). Activations, the loss and the
exchange's transient buffers are estimates, stated as such:

- activations per layer and token, ``20 h + 6 f`` values (attention and MLP inputs and
  intermediates, SDPA attention without the sequence-squared term), in the forward's precision;
  with ``--activation-checkpointing`` only each layer's input is kept, plus one layer's full set
  during its recomputation;
- the loss: the logits of the whole micro-batch (in the forward's precision, their float32
  upcast, log-softmax and gradients),
  or of one chunk of ``hf.LOSS_CHUNK_TOKENS`` tokens where the loss is chunked (Hugging Face models, vocabulary >= 32k);
- an exchange (gossip): with payloads that stream on a GPU (int8, int4, fp4:
  :mod:`gasloc_p2p.protocol.payloads`) chunk-sized staging, at most
  ``payloads.STAGING_BYTES`` (6) bytes per element of one chunk through int8's fused Triton
  kernels (data of both payloads and theta_0's chunk, or the correction), about
  ``payloads.EAGER_STAGING_BYTES`` (20) through the eager passes; otherwise (sign1, half2)
  both payloads on the device from the check to the commit and the engine's scratch (8 bytes
  per element of one chunk);
- the vocabulary's gradients on their way into ``.grad`` (8 bytes per embedding entry);
- CUDA's context and the allocator's slack: 0.75 GiB;
- activation checkpointing keeps each layer's input in float32 (the residual stream of a
  Hugging Face decoder stays float32 under autocast: 4 bytes per token and hidden unit, which
  an H100 measured, 0.017 GiB per layer at 2048 x 2048);
- with activation checkpointing, what an H100 measured beyond all of the above and is not
  attributed yet: 4.1 GiB at the Llama-3.2-1B shape, 1 x 2048 tokens (65 bytes per token and
  hidden unit per layer: :data:`UNATTRIBUTED_PER_LAYER`; docs/results/gpu.md). Not the
  autocast weight cache (off since: 0.10 GiB a layer, measured) nor the layers' activations
  (0.017 GiB a layer with the cache off); it may belong to the vocabulary's gradients.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from typing import Any

import torch

from gasloc_p2p.core.async_state import AsyncConfig
from gasloc_p2p.core.codecs import CodecSpec
from gasloc_p2p.core.links import LinkCache
from gasloc_p2p.core.wire import RESIDUAL_CODECS
from gasloc_p2p.node.config import GATHER_PLANNED, NodeConfig
from gasloc_p2p.node.runtime.trainer import Placed
from gasloc_p2p.protocol import payloads
from gasloc_p2p.protocol.engine import ON_CPU_CHUNK, ON_DEVICE_CHUNK
from gasloc_p2p.train.optim import gradients_at_once

UNATTRIBUTED_PER_LAYER = 65  # bytes per token x hidden unit per layer (H100, see estimates)

GiB = 1 << 30
CUDA_OVERHEAD = int(0.75 * GiB)


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a model: parameters, the largest tensor, layers and widths."""

    numel: int
    largest: int
    n_layer: int
    hidden: int
    ffn: int
    vocab: int
    chunked_loss: bool


def model_shape(model: str, train: Any, vocab: int = 256) -> Shape:
    """The shape of ``--model`` (a built-in GPT with the flags' sizes, or a Hugging Face
    config), built on the meta device."""
    from gasloc_p2p.model_spec import BUILTIN, ModelSource

    if model in BUILTIN:
        from gasloc_p2p.model import GPT

        cfg = replace(train, model=model).gpt(vocab)
        with torch.device("meta"):
            module: torch.nn.Module = GPT(cfg)
        return _shape(module, cfg.n_layer, cfg.n_embd, 4 * cfg.n_embd, vocab, False)
    from gasloc_p2p import hf

    source = ModelSource.parse(model)
    if source.kind == "hub":
        raise ValueError(f"--model {model}: plan needs a config.json or a local directory")
    config = hf.read_config(source.where)
    with torch.device("meta"):
        module = hf.transformers_module().AutoModelForCausalLM.from_config(config)
    hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0))
    ffn = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    layers = int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 1))
    vocab = int(config.vocab_size)
    return _shape(module, layers, hidden, ffn, vocab, vocab >= hf.CHUNKED_LOSS_VOCAB)


def _shape(module: torch.nn.Module, layers: int, hidden: int, ffn: int, vocab: int,
           chunked: bool) -> Shape:
    sizes = [p.numel() for p in module.parameters() if p.requires_grad]
    return Shape(sum(sizes), max(sizes), layers, hidden, ffn, vocab, chunked)


def model_buffers(numel: int, outer: AsyncConfig, keep_anchor: bool, device: str,
                  grad_numel: int | None = None, shards: int = 1,
                  layer_numel: int = 0) -> list[Placed]:
    """Every model-sized buffer of a node and where it lives: the training state on the
    device, the outer state, theta_0 and the rollback copy on the host (pinned beside a GPU).
    The same rules the node allocates by (:class:`AsyncGaslocState`, :class:`Trainer`).
    ``grad_numel``: the gradient elements that exist at once (:func:`gradients_at_once`),
    else all of them. ``shards`` K > 1: FSDP2 over K ranks (``--sharding fsdp``): a rank holds
    1/K of the parameters, gradients and moments, plus the full parameters of the layer it
    computes and the one it prefetches (``layer_numel`` each); rank 0 keeps a full copy of
    the parameters on the host."""
    dev = "device"  # the training device, whichever it is (a CPU node's host)
    if shards > 1:
        rows = -(-numel // shards)
        out = [Placed("parameters (a rank's rows)", 4 * rows, dev),
               Placed("gradients (a rank's rows)", 4 * rows, dev),
               Placed("adamw moments (a rank's rows)", 8 * rows, dev),
               Placed("layers gathered (computed + prefetched)", 2 * 4 * layer_numel, dev),
               Placed("parameters, full copy (rank 0)", 4 * numel, "host")]
    else:
        out = [Placed("parameters", 4 * numel, dev),
               Placed("gradients (during a step)", 4 * (grad_numel or numel), dev),
               Placed("adamw moments", 8 * numel, dev)]
    optimizer = outer.outer()  # its settings: which buffers it keeps
    if keep_anchor or optimizer.reads_anchor:
        out.append(Placed("anchor", 4 * numel, "host"))
    out += [Placed(f"outer {name}", 4 * numel, "host") for name in optimizer.buffers]
    out.append(Placed("theta_0 (bfloat16)", 2 * numel, "host"))
    out.append(Placed("rollback copy", 4 * numel, "host"))
    out += [Placed(f"rollback {name}", 4 * numel, "host") for name in optimizer.buffers]
    return out


def estimates(shape: Shape, cfg: NodeConfig, device: str) -> list[Placed]:
    """Activations, loss, exchange buffers and overheads: estimates (module docstring)."""
    t = cfg.train
    width = 2 if t.precision == "bf16" else 4
    tokens = t.batch_size // t.nproc_per_node * t.seq_len  # one rank's share of a micro-batch
    per_layer = tokens * (20 * shape.hidden + 6 * shape.ffn) * width
    if t.activation_checkpointing:  # each layer's input (float32), one layer's full set
        acts = shape.n_layer * tokens * shape.hidden * 4 + per_layer
    else:
        acts = shape.n_layer * per_layer
    # measured on an H100 and not yet attributed (module docstring): counted so that the
    # plan does not promise what a card cannot hold
    unexplained = (UNATTRIBUTED_PER_LAYER * shape.n_layer * tokens * shape.hidden
                   if t.activation_checkpointing else 0)
    from gasloc_p2p.hf import LOSS_CHUNK_TOKENS

    loss_tokens = min(tokens, LOSS_CHUNK_TOKENS) if shape.chunked_loss else tokens
    # logits in the forward's precision, their float32 upcast, log-softmax, the gradients
    logits = loss_tokens * shape.vocab * (width + 4 + 4 + 4 + width)
    dev = "device"
    out = [Placed("activations (estimate)", acts, dev), Placed("logits and loss", logits, dev),
           Placed("measured, unattributed", unexplained, dev),
           # the head's and the embedding's gradients on their way into .grad: the
           # bfloat16 product, its float32 cast and the embedding's dense gradient
           Placed("vocabulary gradients in flight", 8 * shape.vocab * shape.hidden, dev)]
    if cfg.outer.algorithm == "gasloc" and t.sharding == "fsdp" and t.nproc_per_node > 1:
        # sharded: the engine works on rank 0's full copy, on the host
        wire = cfg.gossip.codec_spec.codec().wire_bytes(shape.numel)
        out.append(Placed("exchange: payloads + scratch", 4 * wire + 8 * ON_CPU_CHUNK, "host"))
    elif cfg.outer.algorithm == "gasloc":
        spec = cfg.gossip.codec_spec
        wire = spec.codec().wire_bytes(shape.numel)
        chunk = min(shape.numel, ON_DEVICE_CHUNK if device != "cpu" else ON_CPU_CHUNK)
        room = payloads.room(spec.name)
        if room is not None and device != "cpu":  # streamed payloads: staging only
            per = payloads.STAGING_BYTES if room.kernels else payloads.EAGER_STAGING_BYTES
            out.append(Placed("exchange: chunk staging", per * chunk, dev))
        else:
            out.append(Placed("exchange: both payloads + scratch", 2 * wire + 8 * chunk, dev))
        out.append(Placed("exchange: payload buffers", 2 * wire, "host"))
        if spec.name in RESIDUAL_CODECS:  # one float32 reference per link (core/links.py)
            out.append(Placed(f"links: {cfg.gossip.links} references",
                              LinkCache.nbytes(cfg.gossip.links, shape.numel), "host"))
    else:  # the DiLoCo modes: hivemind's shared vector (the outer gradient, or the message)
        sparse = cfg.diloco.sparse_spec()
        if sparse is None:
            out.append(Placed("averaging: the shared outer gradient", 4 * shape.numel, "host"))
        else:
            message = sparse.wire_bytes(shape.numel)
            out += [Placed("error feedback (sparse payload)", 4 * shape.numel, "host"),
                    Placed(f"averaging: the message and {GATHER_PLANNED - 1} members' "
                           "(all-gather)", GATHER_PLANNED * message, "host")]
    if device != "cpu":
        out.append(Placed("CUDA context, allocator slack", CUDA_OVERHEAD, "device"))
    return out


def transients(shape: Shape, buffers: list[Placed], ranks: int = 1,
               sharded: bool = False) -> list[Placed]:
    """Host memory that comes and goes: building the model (its parameters, the flat copy and
    the seeded init's int32 sums of the largest tensor; ``ranks`` of a node build it whole
    before they move it: all of them under DDP, rank 0 alone when sharded) and a checkpoint's
    host copies (sharded, the AdamW state is not among them: each rank writes its rows, a
    tensor at a time)."""
    numel = shape.numel
    outer = sum(b.nbytes for b in buffers if b.name == "anchor" or b.name.startswith("outer "))
    saved = (Placed("checkpoint: parameters, outer state (AdamW: the ranks' files)",
                    4 * numel + outer, "host") if sharded else
             Placed("checkpoint: parameters, AdamW, outer state", 12 * numel + outer, "host"))
    return [Placed("start-up: model + flat copy + init sums, per rank",
                   ranks * (8 * numel + 4 * shape.largest), "host"), saved]


def plan(cfg: NodeConfig, device: str, shape: Shape, keep_anchor: bool = False
         ) -> dict[str, Any]:
    """The node's memory budget: buffers and their totals per place."""
    outer = (cfg.diloco.async_config() if cfg.outer.algorithm != "gasloc"
             else cfg.outer.async_config())
    keep = keep_anchor or cfg.outer.algorithm != "gasloc"
    # AdamW steps in the backward pass on CUDA with one micro-batch a step (BackwardAdamW);
    # not under DDP (several ranks): the gradients live in its buckets, all at once
    grads = gradients_at_once(shape.numel, shape.largest, shape.n_layer,
                              device != "cpu" and cfg.train.grad_accum == 1
                              and cfg.train.nproc_per_node == 1)
    shards = cfg.train.nproc_per_node if cfg.train.sharding == "fsdp" else 1
    layer = max(shape.largest, shape.numel // max(shape.n_layer, 1))
    buffers = (model_buffers(shape.numel, outer, keep, device, grads, shards, layer)
               + estimates(shape, cfg, device))
    steady = {where: sum(b.nbytes for b in buffers if b.where == where)
              for where in ("device", "host")}
    peaks = transients(shape, buffers, 1 if shards > 1 else cfg.train.nproc_per_node,
                       sharded=shards > 1)
    return {"shape": shape, "buffers": buffers, "steady": steady,
            "ranks": cfg.train.nproc_per_node, "sharding": cfg.train.sharding,
            "host_peak": steady["host"] + max(p.nbytes for p in peaks), "transients": peaks}


def parse_size(text: str) -> int:
    """``24GiB``, ``24GB``, ``24000000000``: bytes."""
    units = {"gib": GiB, "gb": 10**9, "mib": 1 << 20, "mb": 10**6, "": 1}
    t = text.strip().lower()
    number = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(number):]
    if unit not in units or not number:
        raise ValueError(f"--device-memory {text!r}: expected a size such as 24GiB or 80GB")
    return int(float(number) * units[unit])


def report(result: dict[str, Any], device_memory: int | None, assumptions: str = "") -> str:
    """The plan as printed: the model, ``assumptions`` (:func:`assumed`), the buffers, the
    totals and, given ``device_memory``, whether it fits."""
    shape: Shape = result["shape"]
    lines = [f"model: {shape.numel / 1e6:,.1f}M parameters, {shape.n_layer} layers, hidden "
             f"{shape.hidden}, vocabulary {shape.vocab}", *([assumptions] if assumptions else []),
             "",
             f"{'buffer':<40} {'where':<7} {'GiB':>7} {'B/param':>8}"]
    for b in result["buffers"]:
        if not b.nbytes:
            continue
        lines.append(f"{b.name:<40} {b.where:<7} {b.nbytes / GiB:7.2f} "
                     f"{b.nbytes / max(shape.numel, 1):8.2f}")
    dev, host = result["steady"]["device"], result["steady"]["host"]
    ranks = result.get("ranks", 1)
    if ranks > 1 and result.get("sharding") == "fsdp":
        where = f"per GPU of {ranks} (FSDP2: each holds 1/{ranks} of the model)"
    elif ranks > 1:
        where = (f"per GPU of {ranks} (DDP: each holds the model; rank 0's exchange staging "
                 "counted)")
    else:
        where = "device"
    lines += ["", f"{where} total {dev / GiB:.2f} GiB ({dev / shape.numel:.1f} B/param); "
                  f"host total {host / GiB:.2f} GiB, at most {result['host_peak'] / GiB:.2f} "
                  "GiB while building the model or writing a checkpoint"]
    if device_memory and dev <= device_memory:
        lines.append(f"fits in {device_memory / GiB:.1f} GiB of device memory "
                     f"({(device_memory - dev) / GiB:+.2f} GiB to spare)")
    elif device_memory:
        lines.append(f"does NOT fit in {device_memory / GiB:.1f} GiB of device memory: "
                     f"{(dev - device_memory) / GiB:.2f} GiB short")
    return "\n".join(lines)


def assumed(cfg: NodeConfig, device: str) -> str:
    """The training shape a plan assumes, as the flags that set it."""
    t = cfg.train
    flags = [f"--precision {t.precision}", f"--micro-batch {t.batch_size}",
             f"--seq-len {t.seq_len}", "--activation-checkpointing"
             if t.activation_checkpointing else "--no-activation-checkpointing"]
    if t.nproc_per_node > 1:
        flags += [f"--nproc-per-node {t.nproc_per_node}", f"--sharding {t.sharding}"]
    return (f"assumed: {' '.join(flags)}, on "
            f"{'a CPU (--cpu)' if device == 'cpu' else 'a GPU (--cpu: a CPU node)'}")


def fixes(cfg: NodeConfig, device: str, shape: Shape, memory: int) -> list[str]:
    """Changes of one setting that make a plan fit ``memory`` bytes of device memory, each
    with the device total it gives (the largest micro-batch and sequence length that fit, the
    fewest GPUs that fit with FSDP2): what a plan that does not fit suggests."""
    t = cfg.train

    def total(**train: Any) -> int:
        return int(plan(replace(cfg, train=replace(t, **train)), device, shape)["steady"][
            "device"])

    def fit(flags: str, **train: Any) -> str | None:
        need = total(**train)
        return f"{flags} ({need / GiB:.2f} GiB)" if need <= memory else None

    tries = []
    if not t.activation_checkpointing:
        tries.append(fit("--activation-checkpointing", activation_checkpointing=True))
    if t.precision != "bf16":
        tries.append(fit("--precision bf16", precision="bf16"))
    per_rank = t.batch_size // t.nproc_per_node
    for k in _halvings(per_rank):  # the largest micro-batch that fits
        if (found := fit(f"--micro-batch {k * t.nproc_per_node}",
                         batch_size=k * t.nproc_per_node)) is not None:
            tries.append(found)
            break
    for length in _halvings(t.seq_len, 128):
        if (found := fit(f"--seq-len {length}", seq_len=length)) is not None:
            tries.append(found)
            break
    if device != "cpu":
        for k in (2, 4, 8, 16, 32, 64):  # the fewest GPUs that hold it sharded
            if k <= t.nproc_per_node and t.sharding == "fsdp":
                continue
            batch = max(t.batch_size, k) // k * k
            if (found := fit(f"--nproc-per-node {k} --sharding fsdp --micro-batch {batch}",
                             nproc_per_node=k, sharding="fsdp", batch_size=batch)) is not None:
                tries.append(found)
                break
    return [f for f in tries if f is not None]


def _halvings(start: int, floor: int = 1) -> list[int]:
    """``start // 2``, ``start // 4``, ... down to ``floor``."""
    out, n = [], start // 2
    while n >= floor:
        out.append(n)
        n //= 2
    return out


def host_need(cfg: NodeConfig, device: str, vocab: int, keep_anchor: bool = False
              ) -> tuple[Shape, int, int]:
    """(shape, steady bytes, peak bytes) of host memory a node of ``cfg`` training on
    ``device`` ("cpu" or a GPU) needs; the peak while it builds the model or writes a
    checkpoint. ValueError if the model's shape cannot be known without downloading it."""
    shape = model_shape(cfg.train.model, cfg.train, vocab)
    result = plan(cfg, device, shape, keep_anchor)
    trained_here = result["steady"]["device"] if device == "cpu" else 0
    return shape, result["steady"]["host"] + trained_here, result["host_peak"] + trained_here


def add_plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="the memory a node will need, per buffer (no training)",
                       description="Print the device and host memory a node needs for a model "
                                   "and training shape, per buffer, and whether it fits. The "
                                   "model is built on the meta device: no weights, seconds.")
    p.add_argument("--model", required=True, help="gpt, a preset, a config.json or a directory")
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--device-memory", default="", help="e.g. 24GiB: say whether it fits")
    p.add_argument("--micro-batch", type=_positive, default=1, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=_positive, default=2048, help="tokens per sequence")
    p.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction,
                   default=True)
    p.add_argument("--algorithm", default="gasloc", choices=("gasloc", "diloco",
                                                             "streaming-diloco"))
    p.add_argument("--gamma", type=float, default=0.0, help="outer momentum (a buffer if > 0)")
    p.add_argument("--codec", default="int8")
    p.add_argument("--links", type=_positive, default=4,
                   help="--codec half2 or sign1: links kept (a float32 model copy each, host)")
    p.add_argument("--diloco-codec", default="fp32",
                   help="DiLoCo modes' payload (a sparse one keeps an error feedback)")
    p.add_argument("--cpu", action="store_true", help="plan a CPU node (everything on the host)")
    p.add_argument("--nproc-per-node", type=_positive, default=1,
                   help="GPUs of the node: the figures are per GPU, the micro-batch split "
                        "over them")
    p.add_argument("--min-link-mbps", type=float, default=10.0,
                   help="the slowest link to plan the transfers for")
    p.add_argument("--sharding", default="ddp", choices=("ddp", "fsdp"),
                   help="a node of several GPUs: ddp (each holds the model) or fsdp (each "
                        "holds 1/K of it)")
    p.set_defaults(func=run_plan)


def _positive(text: str) -> int:
    value = int(text) if text.strip().lstrip("-").isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def run_plan(args: argparse.Namespace) -> int:
    try:
        cfg = NodeConfig()
        cfg = replace(cfg, train=replace(cfg.train, model=args.model, precision=args.precision,
                                         batch_size=args.micro_batch, seq_len=args.seq_len,
                                         activation_checkpointing=args.activation_checkpointing,
                                         nproc_per_node=args.nproc_per_node,
                                         sharding=args.sharding),
                      outer=replace(cfg.outer, algorithm=args.algorithm, gamma=args.gamma),
                      diloco=replace(cfg.diloco, diloco_codec=args.diloco_codec),
                      gossip=replace(cfg.gossip, codec=CodecSpec.parse(args.codec).name,
                                     min_link_mbps=args.min_link_mbps, links=args.links))
        cfg.diloco.validate()
        cfg.gossip.validate()
        if args.micro_batch % args.nproc_per_node:
            raise ValueError(f"--micro-batch={args.micro_batch} does not split over "
                             f"--nproc-per-node={args.nproc_per_node} GPUs")
        memory = parse_size(args.device_memory) if args.device_memory else None
        shape = model_shape(args.model, cfg.train)
    except (ValueError, ImportError, OSError) as exc:
        print(f"gasloc-node plan: error: {exc}", file=sys.stderr)
        return 2
    device = "cpu" if args.cpu else "cuda"
    result = plan(cfg, device, shape)
    print(report(result, memory, assumed(cfg, device)))
    short = memory is not None and result["steady"]["device"] > memory
    if short:
        assert memory is not None
        found = fixes(cfg, device, shape, memory)
        print("it fits with " + "; or ".join(found) if found else
              "no one change of precision, micro-batch, sequence length or GPUs makes it fit: "
              "combine them, or plan a smaller model")
    print(network(cfg, shape.numel))
    return 1 if short else 0


def network(cfg: NodeConfig, numel: int) -> str:
    """What one exchange (GASLoC) or one sync (the DiLoCo modes) uploads, and how long that
    takes on the slowest link the node plans for (``--min-link-mbps``): the time its deadlines
    add (docs/running.md)."""
    g = cfg.gossip
    rate = f"at {g.min_link_mbps:g} Mbit/s (--min-link-mbps)"
    if cfg.outer.algorithm == "gasloc":
        sent = CodecSpec.parse(g.codec).codec().wire_bytes(numel)
        what = f"an exchange sends one {g.codec} payload of {_size(sent)} (and receives one)"
        tail = "; --fragments P sends about 1/P of it per exchange"
    else:
        sent = cfg.diloco.sync_upload_bytes(numel)
        if cfg.diloco.sparse_spec() is None:
            what = f"a sync uploads up to {_size(sent)} (an all-reduce of the fp32 vector)"
        else:
            what = (f"a sync uploads up to {_size(sent)} (an all-gather of "
                    f"{cfg.diloco.diloco_codec} messages in a group of {GATHER_PLANNED - 1})")
        tail = ""
    if g.min_link_mbps <= 0:
        return f"network: {what} (--min-link-mbps 0: fixed deadlines){tail}"
    took = g.transfer_s(sent)
    return f"network {rate}: {what}: {took:,.{1 if took < 10 else 0}f} s{tail}"


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:,.2f} GB" if nbytes >= 10**9 else f"{nbytes / 1e6:,.2f} MB"


def bytes_per_param(result: dict[str, Any], where: str = "device",
                    names: tuple[str, ...] = ()) -> float:
    """Bytes per parameter at ``where`` (only the buffers in ``names``, if given)."""
    numel = max(result["shape"].numel, 1)
    return sum(b.nbytes for b in result["buffers"]
               if b.where == where and (not names or b.name in names)) / numel


__all__ = ["Shape", "add_plan_parser", "assumed", "bytes_per_param", "fixes", "host_need",
           "model_buffers", "model_shape", "plan", "report"]
