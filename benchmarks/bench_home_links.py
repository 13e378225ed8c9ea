"""Bytes and link time per node on home uplinks: gossip (int8, and half2 or sign1 against a copy
each pair keeps: half the parameters at 2 bits, or all at 1) against DiLoCo's all-reduce (fp32) and its sparse all-gather (top-k 3% at 2 bits
with error feedback), at n = 8, 16 and 64 (issue 40, item 5). Arithmetic on the payloads' exact
wire sizes (the codecs' own ``wire_bytes``) and the traffic patterns the daemon runs; no
training, a second.

Per node and per event, bytes uploaded (downloads are the same by symmetry):

- gossip: one pairwise exchange, each side sends one payload (``bytes``);
- DiLoCo fp32: hivemind's butterfly all-reduce, a part of ``1/n`` to each of ``n - 1`` reducers
  and its averaged part back to each: ``2 (n - 1) / n * bytes``;
- DiLoCo sparse: the all-gather through hivemind's reducers (``node/averaging/uniform.py``):
  ``(n - 1) / n`` of its own message to the reducers, then as a reducer ``1/n`` of every
  member's message to ``n - 1`` members: ``(n - 1) (n + 1) / n * message``.

Time: the upload over the uplink (the slower direction at home), latency left out; a gossip
exchange runs beside training (the daemon's exchanges overlap compute), a DiLoCo sync blocks
the group once per round (Streaming DiLoCo spreads it over the round).
"""

from __future__ import annotations

import argparse

from gasloc_p2p.core.codecs import get_codec
from gasloc_p2p.core.sparse import SparseSpec

MODELS = {"135M": 134_515_008, "1.24B": 1_235_814_400}  # SmolLM2-135M, Llama-3.2-1B
GROUPS = (8, 16, 64)
LINKS_MBIT = (20.0, 100.0)


def payloads(numel: int) -> dict[str, int]:
    """Wire bytes of one message of ``numel`` parameters in each scheme."""
    return {
        "int8": get_codec("int8").wire_bytes(numel),
        "half2": get_codec("half2").wire_bytes(numel),
        "sign1": get_codec("sign1").wire_bytes(numel),
        "fp32": get_codec("fp32").wire_bytes(numel),
        "topk2:123": SparseSpec.parse("topk2:123").wire_bytes(numel),
    }


def upload_bytes(scheme: str, message: int, n: int) -> float:
    """Bytes one node uploads per exchange (gossip) or per sync (DiLoCo) in a group of ``n``."""
    if scheme.startswith("gossip"):
        return float(message)
    if scheme == "diloco fp32":
        return 2 * (n - 1) / n * message
    return (n - 1) * (n + 1) / n * message


def rows(numel: int) -> list[tuple[str, int, float]]:
    """(scheme, n, bytes uploaded per node per event)."""
    sizes = payloads(numel)
    out = []
    for n in GROUPS:
        for scheme, key in (("gossip int8", "int8"), ("gossip half2", "half2"),
                            ("gossip sign1", "sign1"),
                            ("diloco fp32", "fp32"), ("diloco topk2:123", "topk2:123")):
            out.append((scheme, n, upload_bytes(scheme, sizes[key], n)))
    return out


def table(model: str, numel: int) -> list[str]:
    head = ["scheme", "n", "MB up per node per event", "vs fp32 DiLoCo"]
    head += [f"s at {mbit:g} Mbit/s" for mbit in LINKS_MBIT]
    lines = [f"### {model} ({numel:,} parameters)", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    by_n = {n: b for s, n, b in rows(numel) if s == "diloco fp32"}
    for scheme, n, nbytes in rows(numel):
        cells = [scheme, str(n), f"{nbytes / 1e6:,.1f}", f"{by_n[n] / nbytes:.1f}x"]
        cells += [f"{nbytes * 8 / (mbit * 1e6):,.0f}" for mbit in LINKS_MBIT]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=0,
                        help="one model of this many parameters instead of 135M and 1.24B")
    args = parser.parse_args(argv)
    models = {f"{args.params:,}": args.params} if args.params else MODELS
    for name, numel in models.items():
        print("\n".join(table(name, numel)) + "\n", flush=True)


if __name__ == "__main__":
    main()
