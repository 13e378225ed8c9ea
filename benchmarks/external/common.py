"""What every system of the external benchmark shares: the run's shape (:class:`Spec`), the
generated corpus, the project's model/data/optimizer pieces, eval records and RSS sampling.

Every system trains the same model (the project's built-in GPT), on the same generated corpus,
with the same AdamW inner optimizer and schedule (``gasloc_p2p.train``), the same number of
tokens per node, one torch thread per process, and evaluates its own current parameters with
``gasloc_p2p.train.evaluate`` on the same fixed validation batches every ``eval_every`` steps.
Only the outer algorithm and its transport differ.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import threading
import time
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Any

from gasloc_p2p.tools.procs import group_members

EVAL_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*eval step (\d+) tokens (\d+) "
                       r"val_loss (\S+)$", re.M)
SENT_LINE = re.compile(r"\| sent ([\d.]+) MB recv ([\d.]+) MB")
UTIL_LINE = re.compile(r"\| util ([\d.]+|nan)")


@dataclass(frozen=True)
class Spec:
    """The shape of one run, the same for every system (``steps`` inner steps per node)."""

    nodes: int = 4
    steps: int = 300
    inner_steps: int = 20  # H: DiLoCo's sync period, GASLoC's round
    eval_every: int = 20
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    seq_len: int = 64
    batch_size: int = 8
    eval_batches: int = 8
    lr: float = 3e-3
    warmup_steps: int = 30
    seed: int = 0
    diloco_eta: float = 0.7  # DiLoCo's Nesterov outer step (torchft's and gasloc_p2p's)
    diloco_gamma: float = 0.9
    corpus_mb: float = 2.0
    # the GPU queue's swarm (benchmarks/gpu_plan.py): a Hugging Face config.json instead of
    # the built-in GPT (n_layer, n_embd, n_head then unused), on a GPU, for a wall-clock time
    model: str = "gpt"
    tokenizer: str = ""  # "": the node's default
    device: str = "cpu"
    precision: str = "fp32"
    compile: bool = False
    max_time_s: float = 0.0  # 0: train `steps` steps
    extra_flags: tuple[str, ...] = ()  # more `gasloc-node join` flags (advanced settings too)

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError("Spec: at least 1 node")
        if self.steps % self.eval_every or self.steps % self.inner_steps:
            raise ValueError(f"Spec: steps ({self.steps}) must be a multiple of eval_every "
                             f"({self.eval_every}) and inner_steps ({self.inner_steps})")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def train_keys(self, data: str, data_seed: int) -> dict[str, Any]:
        """The node config keys (``--flag`` names with underscores) of this run's training."""
        shape = ({"n_layer": self.n_layer, "n_embd": self.n_embd, "n_head": self.n_head}
                 if self.model == "gpt" else {})
        extra: dict[str, Any] = {k: v for k, v in (
            ("tokenizer", self.tokenizer), ("precision", self.precision),
            ("compile", self.compile), ("max_time_s", self.max_time_s)) if v}
        return {"model": self.model, "data": data, **shape, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "eval_batches": self.eval_batches, "lr": self.lr,
                "warmup_steps": self.warmup_steps, "lr_horizon_steps": self.steps,
                "inner_steps": self.inner_steps, "eval_interval_steps": self.eval_every,
                "max_steps": self.steps, "seed": self.seed, "data_seed": data_seed,
                "torch_threads": 1, "device": self.device, **extra}

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Spec:
        known = {f.name for f in fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v
                      for k, v in json.loads(text).items() if k in known})


def flag_list(keys: dict[str, Any]) -> list[str]:
    """``--flag value`` pairs of config keys (booleans: ``--flag`` / ``--no-flag``)."""
    out: list[str] = []
    for key, value in keys.items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            out.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            out += [f"--{flag}", str(value)]
    return out


# ---------------------------------------------------------------------------- corpus
def make_corpus(path: Path, mb: float, seed: int = 0) -> Path:
    """A generated English-like text of about ``mb`` megabytes (written once, then reused).

    Words are random letter strings with Zipf-distributed frequencies; each word has a few
    preferred successors, so a model can learn spelling, then word transitions: the loss keeps
    falling for a long time and no download is needed.
    """
    if path.exists() and path.stat().st_size >= mb * 1e6 * 0.95:
        return path
    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    weights = [1.0 / (i + 1) for i in range(len(letters))]
    vocab = sorted({"".join(rng.choices(letters, weights, k=rng.randint(2, 8)))
                    for _ in range(2500)})
    rng.shuffle(vocab)
    zipf = [1.0 / (i + 1) ** 1.1 for i in range(len(vocab))]
    successors = [rng.choices(range(len(vocab)), zipf, k=6) for _ in vocab]
    target, parts, size = int(mb * 1e6), [], 0
    word = 0
    while size < target:
        n = rng.randint(5, 14)
        sentence = []
        for _ in range(n):
            word = (rng.choice(successors[word]) if rng.random() < 0.8
                    else rng.choices(range(len(vocab)), zipf)[0])
            sentence.append(vocab[word])
        line = " ".join(sentence).capitalize() + (". " if rng.random() < 0.85 else ".\n")
        parts.append(line)
        size += len(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(parts))
    return path


# ---------------------------------------------------------------------------- project pieces
def project_pieces(spec: Spec, data: str, data_seed: int) -> tuple[Any, Any, Any]:
    """(train config, training data, built model) exactly as a gasloc node builds them."""
    from gasloc_p2p.node.runtime.trainer import build_node_model, load_data
    from gasloc_p2p.node.settings import build_config

    cfg = build_config(argparse.Namespace(**spec.train_keys(data, data_seed)), environ={}).train
    training = load_data(cfg, cfg.seed)
    built = build_node_model(cfg, training.tokenizer.vocab_size)
    return cfg, training, built


def eval_record(step: int, tokens: int, loss: float, t: float | None = None) -> str:
    """One JSON line of a runner's curve: wall time (s since the epoch), step, tokens, loss."""
    return json.dumps({"event": "eval", "t": time.time() if t is None else t, "step": step,
                       "tokens": tokens, "val_loss": loss})


def read_records(text: str) -> list[dict[str, Any]]:
    """The JSON event lines of a runner's stdout (other lines are ignored)."""
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def gasloc_evals(log_text: str) -> list[dict[str, Any]]:
    """Eval records from a gasloc node's log (``eval step N tokens T val_loss L`` lines)."""
    out = []
    for m in EVAL_LINE.finditer(log_text):
        t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        loss = float(m.group(4))
        out.append({"event": "eval", "t": t, "step": int(m.group(2)),
                    "tokens": int(m.group(3)), "val_loss": loss if math.isfinite(loss) else None})
    return out


def gasloc_sent_bytes(log_text: str) -> int | None:
    """Payload bytes sent per the node's last progress line (gossip mode), None if absent."""
    found = SENT_LINE.findall(log_text)
    return int(float(found[-1][0]) * 1e6) if found else None


def gasloc_utilization(log_text: str) -> dict[str, float | None]:
    """The node's own compute-utilization estimate, per its last progress line (gossip mode;
    None if absent or not measured yet)."""
    found = [float(u) for u in UTIL_LINE.findall(log_text)]
    found = [f for f in found if math.isfinite(f)]
    return {"utilization_est": found[-1] if found else None}


# ---------------------------------------------------------------------------- memory
def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


class RssSampler:
    """Peak of the summed resident memory of each process group (a node with its DHT
    process and p2pd counts as one), sampled every ``period_s`` in a thread."""

    def __init__(self, pgids: dict[str, int], period_s: float = 0.5) -> None:
        self.pgids = dict(pgids)
        self.peak = {name: 0 for name in pgids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)

    def _run(self, period_s: float) -> None:
        while not self._stop.is_set():
            for name, pgid in self.pgids.items():
                self.peak[name] = max(self.peak[name], rss_bytes(group_members(pgid)))
            self._stop.wait(period_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
