"""The configuration vocabulary shared by every config dataclass of the project.

A config field is declared with :func:`opt` (its default and ``--help`` text, optionally its
flag name, choices and whether it is advanced tuning); :mod:`gasloc_p2p.flags` turns such
fields into command-line flags for ``join``, ``sim`` and ``swarm`` alike. Values are checked with :func:`need`, whose message names
the flag to change, and the outer step (eta, gamma) is checked once, by
:func:`check_outer_step`, for every algorithm that has one.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag and how to fix it."""


def opt(default: Any, help: str, *, flag: str = "", choices: tuple[str, ...] = (),
        metavar: str = "", advanced: bool = False, group: str = "") -> Any:
    """A dataclass field carrying its ``--help`` text (and optionally flag name, choices).

    ``advanced``: tuning most users never touch (timeouts, guard thresholds, limits): no
    command-line flag of ``join``, still settable in TOML and the environment and listed in
    docs/configuration.md. ``group``: the ``--help`` group, when not the section's.
    """
    meta: dict[str, Any] = {"help": help, "advanced": advanced, "group": group}
    if flag:
        meta["flag"] = flag
    if choices:
        meta["choices"] = choices
    if metavar:
        meta["metavar"] = metavar
    return field(default=default, metadata=meta)


def flag_name(name: str) -> str:
    """``--field-name`` for the field ``field_name``."""
    return "--" + name.replace("_", "-")


def need(ok: bool, name: str, value: Any, what: str) -> None:
    """Raise :class:`ConfigError` ``--name=value: what`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{flag_name(name)}={value!r}: {what}")


def check_outer_step(eta: float, gamma: float, eta_name: str = "eta",
                     gamma_name: str = "gamma") -> None:
    """The outer learning rate needs (0, 2] and the outer momentum [0, 1), in every algorithm."""
    need(0.0 < eta <= 2.0, eta_name, eta, "the outer learning rate needs (0, 2] (try 0.7)")
    need(0.0 <= gamma < 1.0, gamma_name, gamma, "the outer momentum needs [0, 1)")
