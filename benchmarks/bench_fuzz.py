"""Fuzz a live node: thousands of generated hostile Exchange streams, and where each stopped.

Usage: python -m benchmarks.bench_fuzz [--streams 5000] [--concurrency 2] [--seed 0]
                                       [--member-share 0.8]

Starts one real `gasloc-node join` process (tiny model, short timeouts) and sends it seeded,
generated streams (gasloc_p2p/tools/fuzz_streams.py, fuzz_member.py): a share from an outsider
(raw bytes, unsigned or badly signed Headers, bad orders), the rest from an authenticated member
with its own key, whose signed Header and proof pass and whose payload, framing or Commit is
mutated (codecs and block sizes, chunk sizes, CRC, NaN/Inf/huge values, truncation, oversize,
reordered and duplicated messages, bad proofs, bad or missing Commits, valid Commits sent
early, replayed from another stream, or after both Ready messages: only these commit).

Prints the count of streams, crashes (the node died or stopped answering Info), hangs (a stream
the node did not end within its own timeouts plus a margin), accepted-bad (the node sent Ready
to a payload or framing it must refuse), how many streams got past the header checks, where
each was stopped (per check), the exchanges the node committed (must equal the valid Commits
sent after both Ready messages: each applied once, nothing else) and whether its parameters are
finite afterwards. Exit code 1 if any of these fails.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks.tools.fuzz_member import fuzz_node
from benchmarks.tools.fuzz_streams import STAGES, Counts


def report(r: dict[str, object], seed: int) -> bool:
    """Print the figures; True if the node passed."""
    c = r["counts"]
    assert isinstance(c, Counts)
    past = c.past_header()
    print(f"fuzz: {c.streams} streams in {r['took']:.0f} s against a live node "
          f"({r['numel']:,} params), seed {seed}")
    print(f"crashes {int(bool(r['crashed']))}  hangs {c.hangs}  accepted-bad {c.accepted_bad}")
    print(f"past the header and signature checks: {past} ({100 * past / max(c.streams, 1):.0f}%)")
    print("stopped at: " + ", ".join(f"{s} {c.stages[s]}" for s in STAGES if c.stages[s]))
    print("Ready sent to: " + (", ".join(f"{k} {v}" for k, v in sorted(c.ready_to.items()))
                               or "nothing"))
    if c.notes:
        print("notes: " + ", ".join(f"{k} {v}" for k, v in sorted(c.notes.items())))
    valid = c.notes["valid-commit-sent"]
    print(f"node trained {r['steps']} steps meanwhile; committed exchanges {r['committed']} "
          f"(valid Commits sent after both Ready: {valid}); parameters finite {r['finite']}; "
          f"tracebacks in its log {r['tracebacks']}; forged log lines {r['forged']}")
    return not (r["crashed"] or c.hangs or c.accepted_bad or r["committed"] != valid
                or r["tracebacks"] or r["forged"] or not r["finite"])


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--streams", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=2,
                   help="streams in flight (the node admits 3 per address)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--member-share", type=float, default=0.8,
                   help="share of streams from an authenticated member (the rest: outsider)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        r = fuzz_node(Path(tmp), args.streams, args.concurrency, args.seed, args.member_share,
                      progress_every=500)
    sys.exit(0 if report(r, args.seed) else 1)


if __name__ == "__main__":
    main()
