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
import tomllib
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gasloc_p2p.flags import Option, add_flags, parse_text
from gasloc_p2p.flags import options as flag_options
from gasloc_p2p.node.config import HELP_GROUPS, SECTION_GROUPS, SECTIONS, ConfigError, NodeConfig

ENV_PREFIX = "GASLOC_"
# (values, where each given one came from) -> the values to build (a run manifest's rule)
RunSettings = Callable[[dict[str, Any], dict[str, str]], dict[str, Any]]


def options() -> dict[str, Option]:
    """Every node config field by name, in declaration order (``group``: its --help group)."""
    hints = typing.get_type_hints(NodeConfig)
    opts = flag_options({section: hints[section] for section in SECTIONS})
    return {name: dataclasses.replace(o, group=o.group or SECTION_GROUPS[o.section])
            for name, o in opts.items()}


def env_name(opt: Option) -> str:
    return ENV_PREFIX + opt.name.upper()


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field that is not advanced tuning, in the --help groups; unset
    flags stay absent from the args."""
    parser.add_argument("--config", metavar="TOML", default=argparse.SUPPRESS,
                        help="TOML file with [train], [gossip], [network], ... tables (every "
                             "setting, tuning included: docs/configuration.md)")
    add_flags(parser, options(), env_prefix=ENV_PREFIX, groups=HELP_GROUPS, advanced=False)


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
        env = env_name(opt)
        if env in environ:
            try:
                out[opt.name] = parse_text(opt, environ[env])
            except ConfigError as exc:
                raise ConfigError(f"environment {env}: {exc}") from None
    return out


def build_config(args: argparse.Namespace | None = None,
                 environ: Mapping[str, str] | None = None,
                 toml_path: str | Path | None = None,
                 run: RunSettings | None = None) -> NodeConfig:
    """Merge defaults, TOML, environment and flags (in rising precedence) and validate.

    ``args`` holds only the flags the user gave (see :func:`add_config_flags`); its ``config``
    attribute, when present, overrides ``toml_path``. ``environ`` defaults to ``os.environ``.
    ``run`` (a run manifest's :func:`gasloc_p2p.node.manifest.apply`) gets every value and
    where each given one came from, and returns the values to build: the run's settings, or a
    ConfigError naming a setting that contradicts one of them.
    """
    flags = dict(vars(args)) if args is not None else {}
    toml_path = flags.pop("config", toml_path)
    env = load_env(os.environ if environ is None else environ)
    from_toml: dict[str, Any] = load_toml(toml_path) if toml_path else {}
    opts = options()
    from_flags = {k: tuple(v) if isinstance(v, list) else v
                  for k, v in flags.items() if k in opts}
    values = {**from_toml, **env, **from_flags}
    if run is not None:
        given = ({k: f"[{opts[k].section}] {k} in --config" for k in from_toml}
                 | {k: env_name(opts[k]) for k in env} | {k: opts[k].cli for k in from_flags})
        defaults = {name: o.default for name, o in opts.items()}
        values = run({**defaults, **values}, given)
    sections: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for name, value in values.items():
        sections[opts[name].section][name] = value
    hints = typing.get_type_hints(NodeConfig)
    built = {s: hints[s](**kw) for s, kw in sections.items()}
    try:
        return NodeConfig(**built).validate()
    except ConfigError as exc:
        raise ConfigError(_name_settings(str(exc), opts)) from None


def _name_settings(message: str, opts: Mapping[str, Option]) -> str:
    """Advanced settings have no flag: a message naming ``--x-y=v`` names ``x_y=v`` (TOML
    ``[section] x_y`` or ``GASLOC_X_Y``) instead."""
    for opt in opts.values():
        if opt.advanced and message.startswith(opt.cli + "="):
            return (f"{opt.name}{message[len(opt.cli):].split(':', 1)[0]} ([{opt.section}] in "
                    f"--config, or {env_name(opt)}):{message.split(':', 1)[1]}")
    return message


def reference() -> str:
    """docs/configuration.md: every setting by section, generated from the config classes
    (``tests/test_node_config.py`` checks the committed page is current)."""
    hints = typing.get_type_hints(NodeConfig)
    lines = ["# Configuration reference", "",
             "Generated by `python -m gasloc_p2p.node.settings --reference > "
             "docs/configuration.md` from the config dataclasses (gasloc_p2p/node/config*.py); "
             "a test keeps it current.", "",
             "Every setting is a key of its table in a TOML file (`gasloc-node join --config "
             "FILE`) and an environment variable (`GASLOC_` and its name in capitals). Settings "
             "with a flag are also `join` options; the others (timeouts, guard thresholds, "
             "limits) are tuning that few runs need. Precedence: flags > environment > TOML > "
             "defaults. Times are seconds, sizes bytes unless the name says otherwise.", ""]
    opts = options()
    for section in SECTIONS:
        doc = (hints[section].__doc__ or "").strip().split("\n\n")[0]
        lines += [f"## [{section}]", "", " ".join(doc.split()), "",
                  "| setting | flag | default | meaning |", "|---|---|---|---|"]
        for opt in opts.values():
            if opt.section != section:
                continue
            flag = "" if opt.advanced else f"`{opt.cli}`"
            default = opt.default if opt.kind is not tuple else list(opt.default)
            text = opt.help + (f" (one of: {', '.join(opt.choices)})" if opt.choices else "")
            text = text.replace("|", "\\|")
            lines.append(f"| `{opt.name}` | {flag} | `{default!r}` | {text} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--reference"]:
        raise SystemExit("usage: python -m gasloc_p2p.node.settings --reference")
    sys.stdout.write(reference())
