"""`gasloc-node`: the command-line entry point (logging is configured only here)."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import signal
import sys

# gRPC's C core logs every failed TLS handshake (a peer that is gone, a wrong certificate, a
# port scan) and every corrupted TLS record (someone on the path) on stderr, outside Python's
# logging, several lines each: a peer must not be able to write to our terminal. The node
# reports what matters itself (the call fails). Set before grpc is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")
from collections.abc import Sequence
from typing import Any, NoReturn

from gasloc_p2p import __version__
from gasloc_p2p.safelog import OneLineFormatter


class Parser(argparse.ArgumentParser):
    """argparse with a one-line actionable error (exit code 2) instead of the usage dump. An
    unknown flag is reported before anything else, with the closest known flag ("did you
    mean"), for the top level and every subcommand; a mistyped command gets the closest too."""

    # the parser that flags after `--` go to (`swarm -- --data X`: `join`'s)
    passes_through: argparse.ArgumentParser | None = None

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        argv = list(sys.argv[1:] if args is None else args)
        self._check_flags(argv)
        parsed, extras = self.parse_known_args(argv, namespace)
        if extras:  # argparse collects a subcommand's leftovers up here: blame the subcommand
            command = self._commands().get(getattr(parsed, "command", None) or "", self)
            command.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def _commands(self) -> dict[str, Parser]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}

    def _check_flags(self, argv: Sequence[str]) -> None:
        """Fail on the first unknown ``--flag`` (before argparse would report, say, a missing
        required flag that is only misspelled)."""
        parser, commands = self, self._commands()
        for token in argv:
            if token == "--":  # what follows is passed on (swarm) or positional
                return
            if parser is self and token in commands:
                parser = commands[token]
            elif token.startswith("--") and not _known(parser, token.split("=", 1)[0]):
                flag = token.split("=", 1)[0]
                hint = parser.flag_hint(flag, top=self)
                parser.error(f"unrecognized arguments: {flag}" + (f"; {hint}" if hint else ""))

    def flag_hint(self, flag: str, top: argparse.ArgumentParser) -> str:
        """What to type instead of the unknown ``flag``, or ""."""
        if self is not top and _known(top, flag):
            return f"{flag} is an option of {top.prog} itself: put it before the command"
        if self.passes_through is not None and _known(self.passes_through, flag):
            return f"{flag} is a node flag: put node flags after '--' ({self.prog} -- {flag} ...)"
        if self is top:
            owner = next((n for n, p in self._commands().items() if _known(p, flag)), "")
            if owner:
                return f"{flag} is an option of a command: put it after one ({self.prog} " \
                       f"{owner} {flag} ...)"
        names = {f.removeprefix("--"): f for f in _long_flags(self)}
        spelled = flag.removeprefix("--").replace("_", "-").lower()
        close = [spelled] if spelled in names else difflib.get_close_matches(
            spelled, list(names), n=1, cutoff=0.6)
        return f"did you mean {names[close[0]]}?" if close else ""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as exc:
            close = difflib.get_close_matches(str(value), [str(c) for c in action.choices or ()],
                                              n=1, cutoff=0.6)
            if not close:
                raise
            raise argparse.ArgumentError(action, f"{exc.message}; did you mean {close[0]!r}?"
                                         ) from None


def _long_flags(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--")]


def _known(parser: argparse.ArgumentParser, flag: str) -> bool:
    """A flag argparse accepts: exact, or a prefix of one (an ambiguous prefix argparse
    reports itself)."""
    return any(f.startswith(flag) for f in _long_flags(parser))


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
    from gasloc_p2p.node import cli_run

    cli_run.add_init_parser(sub)
    from gasloc_p2p.node import cli_members

    cli_members.add_member_parsers(sub)
    from gasloc_p2p.node import export

    export.add_export_parser(sub)
    from gasloc_p2p.node import plan

    plan.add_plan_parser(sub)
    from gasloc_p2p.data import registry

    registry.add_corpus_parser(sub)
    from gasloc_p2p.tools import cli_swarm

    cli_swarm.add_swarm_parser(sub)
    cli_swarm.add_dashboard_parser(sub)
    sub.choices["swarm"].passes_through = sub.choices["join"]
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl+C before a command handles signals itself
        print("gasloc-node: interrupted", file=sys.stderr, flush=True)
        return 130


def _interrupted(signum: int, frame: Any) -> None:
    # os.write, not print: the signal may land inside a write to stderr, whose buffer's lock
    # a print here would meet again
    os.write(2, b"gasloc-node: interrupted\n")
    os._exit(130)


def _main(argv: Sequence[str] | None) -> int:
    # Ctrl+C while the heavy modules load (torch, hivemind: seconds) ends the process at once:
    # nothing runs yet that needs a stop, and a KeyboardInterrupt raised inside an import was
    # seen swallowed by a library, leaving a half-imported module that failed the start later.
    # `join` restores Python's handler after its own imports, the other commands here.
    interactive = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if interactive:
        signal.signal(signal.SIGINT, _interrupted)
    parser = build_parser()
    args = parser.parse_args(argv)
    if interactive and args.command != "join":
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if getattr(args, "func", None) is not None and args.command == "join":
        # a multi-rank node starts its ranks with the same command line
        args.launch_argv = list(sys.argv[1:] if argv is None else argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=args.log_level, handlers=[handler])
    code = int(args.func(args) or 0)
    if argv is None and getattr(args, "exit_at_once", False):
        # a one-shot client of the swarm (status, revoke) has closed all it opened: skip the
        # interpreter's teardown of torch's and gRPC's native state, 1 to 2 s of a 5 s
        # `status` on a loaded machine (docs/running.md)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
