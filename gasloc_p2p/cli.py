"""`gasloc-node`: the command-line entry point (logging is configured only here)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

# gRPC's C core logs every failed TLS handshake (a peer that is gone, a wrong certificate, a
# port scan) and every corrupted TLS record (someone on the path) on stderr, outside Python's
# logging, several lines each: a peer must not be able to write to our terminal. The node
# reports what matters itself (the call fails). Set before grpc is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")
from collections.abc import Sequence
from typing import NoReturn

from gasloc_p2p import __version__
from gasloc_p2p.safelog import OneLineFormatter


class Parser(argparse.ArgumentParser):
    """argparse with a one-line actionable error (exit code 2) instead of the usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")



def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="gasloc-node", description="Peer-to-peer volunteer training with "
                    "GASLoC: gossip + DiLoCo-style local steps.")
    parser.add_argument("--version", action="version", version=f"gasloc-node {__version__}")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=Parser)
    from gasloc_p2p.sim.cli_sim import add_sim_parser

    add_sim_parser(sub)
    from gasloc_p2p.node import cli_node

    cli_node.add_join_parser(sub)
    cli_node.add_status_parser(sub)
    from gasloc_p2p.node import cli_members

    cli_members.add_member_parsers(sub)
    from gasloc_p2p.node import export

    export.add_export_parser(sub)
    from gasloc_p2p.node import plan

    plan.add_plan_parser(sub)
    from gasloc_p2p.tools import cli_swarm

    cli_swarm.add_swarm_parser(sub)
    cli_swarm.add_dashboard_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=args.log_level, handlers=[handler])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
