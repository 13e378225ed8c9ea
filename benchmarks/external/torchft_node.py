"""One torchft DiLoCo replica group (one process, gloo on CPU): the external DiLoCo anchor.

Usage (the suite starts it; a lighthouse must run): python -m benchmarks.external.torchft_node
    --spec JSON --data FILE --index I --addr ADDR --store-port P --lighthouse http://HOST:PORT

The model, data, inner AdamW and schedule are the project's (``project_pieces``, ``InnerLoop``);
torchft's ``DiLoCo`` wraps the inner optimizer (its step hook all-reduces the outer gradient
every H steps through the ``Manager`` and applies the Nesterov outer step). ``init_sync=False``:
every replica starts from the same seeded ``theta_0``. Prints JSON eval records on stdout.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from typing import Any

import torch

from benchmarks.external.common import Spec, eval_record, project_pieces
from gasloc_p2p.node.runtime.trainer import inner_settings
from gasloc_p2p.train import InnerLoop, evaluate


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--addr", required=True, help="this replica's address (its namespace's)")
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--timeout-s", type=float, default=300.0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    spec = Spec.from_json(args.spec)

    import torch.distributed as dist
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    cfg, training, built = project_pieces(spec, args.data, args.index)
    model = built.module
    inner = InnerLoop(model, *inner_settings(cfg))
    numel = sum(t.numel() for t in model.parameters())
    timeout = timedelta(seconds=args.timeout_s)
    # This replica group's store: the Manager connects to it as a client; keep it referenced.
    store = dist.TCPStore(args.addr, args.store_port, is_master=True, wait_for_workers=False)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner": inner.optimizer.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.optimizer.load_state_dict(sd["inner"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict,
                      state_dict=state_dict, min_replica_size=spec.nodes,
                      use_async_quorum=False, replica_id=f"r{args.index}",
                      store_addr=args.addr, store_port=args.store_port, rank=0, world_size=1,
                      lighthouse_addr=args.lighthouse, hostname=args.addr, init_sync=False,
                      timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout)
    outer = torch.optim.SGD(model.parameters(), lr=spec.diloco_eta, momentum=spec.diloco_gamma,
                            nesterov=True)
    gen = torch.Generator()
    gen.manual_seed(args.index)
    val = training.val
    print(eval_record(0, 0, evaluate(model, val)), flush=True)
    tokens, sync_s = 0, 0.0
    with DiLoCo(manager, [model], inner.optimizer, outer, sync_every=spec.inner_steps):
        for step in range(spec.steps):
            x, y = training.train.batch(spec.batch_size, spec.seq_len, gen)
            t0 = time.perf_counter()
            inner.step(x, y, step)  # the H-th step's optimizer hook syncs (blocking)
            if (step + 1) % spec.inner_steps == 0:
                sync_s += time.perf_counter() - t0
            tokens += y.numel()
            if (step + 1) % spec.eval_every == 0:
                print(eval_record(step + 1, tokens, evaluate(model, val)), flush=True)
    syncs = spec.steps // spec.inner_steps
    n = spec.nodes
    print(json.dumps({"event": "done", "numel": numel, "syncs": syncs,
                      "manager_step": manager.current_step(), "sync_step_s": sync_s,
                      # a ring all-reduce of the fp32 outer gradient: 2 (n-1)/n of it out
                      "program_bytes_sent": int(syncs * numel * 4 * 2 * (n - 1) / n),
                      "program_bytes_kind": "estimate: syncs x 2(n-1)/n x fp32 model"}),
          flush=True)
    manager.shutdown(wait=False)
    del store


if __name__ == "__main__":
    main()
