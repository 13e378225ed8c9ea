"""Command-line flags from config dataclasses: the one flag generator of ``join``, ``sim`` and
``swarm``.

Every field declared with :func:`gasloc_p2p.core.options.opt` becomes a flag ``--field-name``
(or the ``flag`` its metadata names) with its help text, default and choices. Unset flags stay
absent from the parsed namespace, so a caller can layer them over other sources (the node:
environment and TOML) and knows exactly what the user typed. Booleans get ``--x/--no-x``;
tuples take one or more values, each of which may be comma-separated.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from gasloc_p2p.core.options import ConfigError, flag_name

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclasses.dataclass(frozen=True)
class Option:
    """One config field: its section, name, kind (bool/int/float/str/tuple), default, help."""

    section: str
    name: str
    kind: type
    default: Any
    help: str
    item: type = str  # element kind of a tuple
    flag: str = ""
    choices: tuple[str, ...] = ()
    metavar: str = ""
    advanced: bool = False  # settable in TOML and the environment only
    group: str = ""  # --help group (default: the section)

    @property
    def cli(self) -> str:
        return self.flag or flag_name(self.name)


def options(sections: Mapping[str, type]) -> dict[str, Option]:
    """Every field of the section dataclasses by name, in declaration order.

    Field names must be unique across sections (the flat flag names cannot clash).
    """
    out: dict[str, Option] = {}
    for section, cls in sections.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind, item = _kind(hints[f.name])
            if f.name in out:
                raise RuntimeError(f"config field {f.name!r} is declared in two sections")
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
                else f.default
            meta = f.metadata
            out[f.name] = Option(section, f.name, kind, default, meta.get("help", ""), item,
                                 meta.get("flag", ""), tuple(meta.get("choices", ())),
                                 meta.get("metavar", ""), bool(meta.get("advanced", False)),
                                 meta.get("group", ""))
    return out


def _kind(hint: Any) -> tuple[type, type]:
    """(kind, tuple element kind) of an annotation; ``X | None`` is X."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        return tuple, (args[0] if args else str)
    return hint, str


def add_flags(parser: argparse.ArgumentParser, opts: Mapping[str, Option],
              env_prefix: str = "", groups: Sequence[str] = (),
              skip: Sequence[str] = (), advanced: bool = True) -> None:
    """One flag per option; unset flags stay absent. ``groups``: the ``--help`` groups in
    order (an option goes to its ``group``, else its section); none: no groups.
    ``advanced``: also the options marked advanced."""
    made = {name: parser.add_argument_group(name) for name in groups}
    for opt in opts.values():
        if opt.name in skip or (opt.advanced and not advanced):
            continue
        target: Any = made[opt.group or opt.section] if groups else parser
        notes = [] if "default" in opt.help else [f"default: {opt.default!r}"]
        if env_prefix:
            notes.append(f"env {env_prefix}{opt.name.upper()}")
        text = (f"{opt.help} ({'; '.join(notes)})" if notes else opt.help).replace("%", "%%")
        kw: dict[str, Any] = {"dest": opt.name, "default": argparse.SUPPRESS, "help": text}
        if opt.metavar:
            kw["metavar"] = opt.metavar
        if opt.kind is bool:
            target.add_argument(opt.cli, action=argparse.BooleanOptionalAction, **kw)
        elif opt.kind is tuple:
            kw.setdefault("metavar", "VALUE")
            target.add_argument(opt.cli, nargs="+", action=_Flatten,
                                type=_argparse_type(opt), **kw)
        else:  # choices are checked by the config's validate(), one error path for all sources
            if opt.choices and "metavar" not in kw:
                kw["metavar"] = "{" + ",".join(opt.choices) + "}"
            target.add_argument(opt.cli, type=_argparse_type(opt), **kw)


class _Flatten(argparse.Action):
    """``--x a,b c`` -> ``("a", "b", "c")``: each value was already split into a tuple."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None
                 ) -> None:
        setattr(namespace, self.dest, tuple(v for part in values for v in part))


def _argparse_type(opt: Option) -> Any:
    def convert(raw: str) -> Any:
        try:
            return parse_text(opt, raw)
        except ConfigError as exc:  # argparse names the flag itself
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{opt.cli}: ")) from None

    convert.__name__ = (opt.item if opt.kind is tuple else opt.kind).__name__
    return convert


def parse_text(opt: Option, raw: str) -> Any:
    """A value from text (a flag or an environment variable)."""
    text = raw.strip()
    if opt.kind is bool:
        if text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
        raise ConfigError(f"{opt.cli}: expected true/false, got {raw!r}")
    if opt.kind is tuple:
        parts = [p for p in re.split(r"[,\s]+", text) if p]
        try:
            return tuple(opt.item(p) for p in parts)
        except ValueError:
            raise ConfigError(f"{opt.cli}: expected {opt.item.__name__} values, got "
                              f"{raw!r}") from None
    try:
        return opt.kind(text)
    except ValueError:
        raise ConfigError(f"{opt.cli}: expected {opt.kind.__name__}, got {raw!r}") from None


def given(args: argparse.Namespace, opts: Mapping[str, Option]) -> dict[str, Any]:
    """The option values the user set on the command line."""
    return {k: v for k, v in vars(args).items() if k in opts}
