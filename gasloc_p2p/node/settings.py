"""Build a :class:`NodeConfig` from CLI flags, ``GASLOC_*`` variables and a TOML file.

Precedence: flags > environment > TOML (``--config``) > defaults. Each config field ``name`` of
section ``sec`` is the flag ``--name`` (dashes), the variable ``GASLOC_NAME`` and the TOML key
``[sec] name``. Unknown TOML keys are errors (a typo must not silently keep a default); unknown
``GASLOC_*`` variables are ignored because other parts of the project use the prefix too
(``GASLOC_CACHE``). Any bad value raises :class:`ConfigError` naming where it came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gasloc_p2p.node.config import SECTIONS, ConfigError, NodeConfig

ENV_PREFIX = "GASLOC_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclasses.dataclass(frozen=True)
class Option:
    """One config field: its section, name, Python kind (bool/int/float/str/tuple), default."""

    section: str
    name: str
    kind: type
    default: Any
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


def options() -> dict[str, Option]:
    """Every config field by name, in declaration order."""
    out: dict[str, Option] = {}
    hints = typing.get_type_hints(NodeConfig)
    for section in SECTIONS:
        cls = hints[section]
        kinds = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = kinds[f.name]
            kind = tuple if typing.get_origin(kind) is tuple else kind
            if f.name in out:
                raise RuntimeError(f"config field {f.name!r} is declared in two sections")
            out[f.name] = Option(section, f.name, kind, f.default, f.metadata.get("help", ""))
    return out


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field, grouped by section; unset flags stay absent from the args."""
    parser.add_argument("--config", metavar="TOML", default=argparse.SUPPRESS,
                        help="TOML file with [train], [gossip], [network], ... tables")
    groups: dict[str, Any] = {}
    for opt in options().values():
        group = groups.get(opt.section)
        if group is None:
            group = groups[opt.section] = parser.add_argument_group(opt.section)
        text = f"{opt.help} (default: {opt.default!r}; env {opt.env})".replace("%", "%%")
        kw: dict[str, Any] = {"dest": opt.name, "default": argparse.SUPPRESS, "help": text}
        if opt.kind is bool:
            group.add_argument(opt.flag, action=argparse.BooleanOptionalAction, **kw)
        elif opt.kind is tuple:
            group.add_argument(opt.flag, nargs="+", metavar="MADDR", **kw)
        else:
            group.add_argument(opt.flag, type=_argparse_type(opt), **kw)


def _argparse_type(opt: Option) -> Any:
    def convert(raw: str) -> Any:
        try:
            return parse_text(opt, raw)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = opt.kind.__name__  # argparse names the type in its error message
    return convert


def parse_text(opt: Option, raw: str) -> Any:
    """A value from text (a flag or an environment variable)."""
    text = raw.strip()
    if opt.kind is bool:
        if text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
        raise ConfigError(f"{opt.flag}: expected true/false, got {raw!r}")
    if opt.kind is tuple:
        return tuple(p for p in re.split(r"[,\s]+", text) if p)
    try:
        return opt.kind(text)
    except ValueError:
        raise ConfigError(f"{opt.flag}: expected {opt.kind.__name__}, got {raw!r}") from None


def _coerce(opt: Option, value: Any, where: str) -> Any:
    """A TOML value checked against the field's kind (ints are accepted for floats)."""
    if opt.kind is tuple:
        if isinstance(value, str):
            return parse_text(opt, value)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
    elif opt.kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    elif isinstance(value, opt.kind) and not (opt.kind is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"{where}: {opt.name} must be {opt.kind.__name__}, got {value!r}")


def load_toml(path: str | Path) -> dict[str, Any]:
    """Field values from a TOML file, by field name; ConfigError on unknown tables or keys."""
    try:
        doc = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None
    opts, out = options(), {}
    for section, table in doc.items():
        if section not in SECTIONS or not isinstance(table, dict):
            raise ConfigError(f"--config {path}: unknown table [{section}]; tables are "
                              f"{', '.join(SECTIONS)}")
        for key, value in table.items():
            opt = opts.get(key)
            if opt is None or opt.section != section:
                known = ", ".join(o.name for o in opts.values() if o.section == section)
                raise ConfigError(f"--config {path}: unknown key {key!r} in [{section}]; "
                                  f"known keys: {known}")
            out[key] = _coerce(opt, value, f"--config {path} [{section}]")
    return out


def load_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """Field values from ``GASLOC_<NAME>`` variables that name a config field."""
    out = {}
    for opt in options().values():
        if opt.env in environ:
            try:
                out[opt.name] = parse_text(opt, environ[opt.env])
            except ConfigError as exc:
                raise ConfigError(f"environment {opt.env}: {exc}") from None
    return out


def build_config(args: argparse.Namespace | None = None,
                 environ: Mapping[str, str] | None = None,
                 toml_path: str | Path | None = None) -> NodeConfig:
    """Merge defaults, TOML, environment and flags (in rising precedence) and validate.

    ``args`` holds only the flags the user gave (see :func:`add_config_flags`); its ``config``
    attribute, when present, overrides ``toml_path``. ``environ`` defaults to ``os.environ``.
    """
    flags = dict(vars(args)) if args is not None else {}
    toml_path = flags.pop("config", toml_path)
    env = load_env(os.environ if environ is None else environ)
    values: dict[str, Any] = load_toml(toml_path) if toml_path else {}
    values.update(env)
    opts = options()
    values.update({k: tuple(v) if isinstance(v, list) else v
                   for k, v in flags.items() if k in opts})
    sections: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for name, value in values.items():
        sections[opts[name].section][name] = value
    hints = typing.get_type_hints(NodeConfig)
    built = {s: hints[s](**kw) for s, kw in sections.items()}
    return NodeConfig(**built).validate()
