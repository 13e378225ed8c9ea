"""One peer of hivemind's ``Optimizer`` with local updates (the OpenDiLoCo way): the second
external anchor.

Usage (the suite starts it): python -m benchmarks.external.hivemind_node --spec JSON
    --data FILE --index I --addr ADDR [--peers MADDR ...]

Each peer takes AdamW steps locally (the project's model, data, optimizer groups and schedule)
and, every time the swarm has accumulated ``nodes * H * batch_size`` samples (one hivemind
epoch: H steps of every peer), all-reduces its parameters with the others (plain parameter
averaging: outer lr 1, no momentum; ``delay_state_averaging=False`` so it averages at epoch
ends, not every step). A DHT barrier makes every peer start together (otherwise the first one
trains alone until the others arrive). Prints JSON eval records on stdout; the first peer
prints its DHT multiaddrs for the others.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.external.common import Spec, eval_record, project_pieces
from gasloc_p2p.node.runtime.trainer import inner_settings
from gasloc_p2p.train import evaluate, param_groups

BARRIER_KEY = "bench_external_barrier"


def barrier(dht: object, index: int, nodes: int, timeout_s: float) -> None:
    """Announce this peer in the DHT and wait until all ``nodes`` peers have."""
    from hivemind.utils import get_dht_time

    deadline = time.monotonic() + timeout_s
    while True:
        dht.store(BARRIER_KEY, subkey=f"p{index}", value=True,  # type: ignore[attr-defined]
                  expiration_time=get_dht_time() + 600)
        found = dht.get(BARRIER_KEY, latest=True)  # type: ignore[attr-defined]
        here = len(found.value) if found is not None else 0
        if here >= nodes:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier: {here} of {nodes} peers after {timeout_s:g} s")
        time.sleep(0.3)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--addr", required=True)
    p.add_argument("--peers", nargs="*", default=[])
    p.add_argument("--timeout-s", type=float, default=300.0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    spec = Spec.from_json(args.spec)

    import hivemind

    cfg, training, built = project_pieces(spec, args.data, args.index)
    model = built.module
    schedule, adamw = inner_settings(cfg)
    numel = sum(t.numel() for t in model.parameters())
    dht = hivemind.DHT(initial_peers=args.peers, host_maddrs=[f"/ip4/{args.addr}/tcp/0"],
                       start=True)
    print(json.dumps({"event": "dht", "maddrs": [str(a) for a in dht.get_visible_maddrs()]}),
          flush=True)
    opt = hivemind.Optimizer(
        dht=dht, run_id="bench_external", batch_size_per_step=spec.batch_size,
        target_batch_size=spec.nodes * spec.inner_steps * spec.batch_size,
        optimizer=lambda groups: torch.optim.AdamW(groups, lr=schedule.lr, betas=adamw.betas),
        params=param_groups(model, adamw), use_local_updates=True,
        delay_state_averaging=False, matchmaking_time=5.0, averaging_timeout=60.0,
        load_state_timeout=60.0,
        verbose=False)
    barrier(dht, args.index, spec.nodes, args.timeout_s)
    gen = torch.Generator()
    gen.manual_seed(args.index)
    val = training.val
    print(eval_record(0, 0, evaluate(model, val)), flush=True)
    tokens = 0
    inner = opt.state_averager.optimizer  # the local AdamW: its lr follows the schedule
    for step in range(spec.steps):
        x, y = training.train.batch(spec.batch_size, spec.seq_len, gen)
        for group in inner.param_groups:
            group["lr"] = schedule.at(step)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        tokens += y.numel()
        if (step + 1) % spec.eval_every == 0:
            print(eval_record(step + 1, tokens, evaluate(model, val)), flush=True)
    epochs = opt.local_epoch
    n = spec.nodes
    print(json.dumps({"event": "done", "numel": numel, "epochs": epochs,
                      "program_bytes_sent": int(epochs * numel * 4 * 2 * (n - 1) / n),
                      "program_bytes_kind": "estimate: epochs x 2(n-1)/n x fp32 model"}),
          flush=True)
    opt.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
