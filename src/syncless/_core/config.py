"""The one registry of ``SYNCLESS_*`` environment variables.

Each variable is declared exactly once here: its name, how its text is parsed,
its default and what it does. Reading one validates it, and a bad value
raises :class:`ConfigError` naming the variable, the value given and the
values allowed. Explicit arguments always beat the environment
(:func:`resolve`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from syncless._core.errors import ConfigError


@dataclass(frozen=True)
class Setting:
    """One ``SYNCLESS_*`` variable.

    Attributes:
        name: the variable's name.
        parse: turns the variable's text into a value; raises ``ValueError``
            when the text is not allowed.
        default: the text used when the variable is unset.
        allowed: the values allowed, as a user should read them.
        doc: one line on what the variable does.
    """

    name: str
    parse: Callable[[str], Any]
    default: str
    allowed: str
    doc: str


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(text)
        return value

    return parse


_TRUE_WORDS = {"1", "true", "yes", "on"}
_FALSE_WORDS = {"0", "false", "no", "off", ""}


def _boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE_WORDS:
        return True
    if value in _FALSE_WORDS:
        return False
    raise ValueError(text)


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(text)
    return value


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}
_SIZE_PATTERN = re.compile(r"^\s*(\d+)\s*([a-z]*)\s*$")


def parse_nbytes(text: str) -> int:
    """Parse a byte count such as ``"1048576"``, ``"64MiB"`` or ``"2G"`` (binary units)."""
    match = _SIZE_PATTERN.match(text.lower())
    if match is None or match.group(2) not in _SIZE_UNITS:
        raise ValueError(text)
    return int(match.group(1)) * _SIZE_UNITS[match.group(2)]


_SETTINGS: dict[str, Setting] = {}


def _declare(name: str, parse: Callable[[str], Any], default: str, allowed: str, doc: str) -> None:
    if name in _SETTINGS:
        raise RuntimeError(f"{name} is declared twice")
    _SETTINGS[name] = Setting(name, parse, default, allowed, doc)


_declare(
    "SYNCLESS_SYNC_CHECK",
    _choice("off", "warn", "error", "record"),
    "off",
    "off, warn, error, record",
    "What the hidden-sync detector does with a sync in a checked region (read once at import).",
)
_declare(
    "SYNCLESS_SYNC_BACKEND",
    _choice("auto", "torch", "cupti"),
    "auto",
    "auto, torch, cupti",
    "Which layers find hidden syncs: torch (debug mode + wrappers), cupti (those + every blocking CUDA call, "
    "needs syncless[cupti]), auto (cupti when installed and free).",
)
_declare(
    "SYNCLESS_CC",
    _choice("auto", "on", "off", "emulate"),
    "auto",
    "auto, on, off, emulate",
    "Confidential Computing mode: auto asks NVML; emulate makes host<->device copies host-synchronous as CC does.",
)
_declare(
    "SYNCLESS_CC_MAX_STAGED_BYTES",
    parse_nbytes,
    "64MiB",
    "a byte count such as 1048576, 64MiB or 1GiB",
    "Host-to-device copies larger than this keep the original copy instead of the staging stream.",
)
_declare(
    "SYNCLESS_PP_TRANSPORT",
    _choice("auto", "copy_engine", "torch_distributed"),
    "auto",
    "auto, copy_engine, torch_distributed",
    "Which pipeline-parallel transport make_transport builds; auto prefers copy engines when eligible.",
)
_declare(
    "SYNCLESS_PP_TIMEOUT_S",
    _positive_seconds,
    "60",
    "a positive number of seconds",
    "How long a pipeline stage waits for its peer before raising instead of hanging.",
)
_declare(
    "SYNCLESS_REQUIRE_GPU",
    _boolean,
    "0",
    "1/true/yes/on or 0/false/no/off",
    "Tests: fail instead of skipping when a GPU test finds no GPU.",
)


def settings() -> list[Setting]:
    """Return every declared variable, in declaration order."""
    return list(_SETTINGS.values())


def setting(name: str) -> Setting:
    """Return the declaration of ``name``; raise ``KeyError`` naming the known ones."""
    try:
        return _SETTINGS[name]
    except KeyError:
        raise KeyError(f"{name} is not a syncless setting; known: {', '.join(_SETTINGS)}") from None


def read(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """Read, parse and validate ``name`` from ``environ`` (default ``os.environ``).

    Raises:
        ConfigError: the value is not allowed; the message names the
            variable, the value given and the values allowed.
    """
    decl = setting(name)
    env = os.environ if environ is None else environ
    text = env.get(name)
    if text is None:
        return decl.parse(decl.default)
    try:
        return decl.parse(text)
    except (ValueError, TypeError, OverflowError):
        raise ConfigError(f"{name}={text!r} is not valid; allowed: {decl.allowed}") from None


def resolve(name: str, explicit: Any = None) -> Any:
    """Return ``explicit`` if given, else the validated value of ``name``."""
    if explicit is not None:
        return explicit
    return read(name)


def effective(environ: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Describe every variable's effective value, where it came from, and any error.

    Never raises: a bad value is reported in the ``error`` field instead.
    """
    env = os.environ if environ is None else environ
    rows = []
    for decl in settings():
        row: dict[str, Any] = {"name": decl.name, "source": "env" if decl.name in env else "default", "doc": decl.doc}
        try:
            row["value"] = read(decl.name, env)
            row["error"] = None
        except ConfigError as err:
            row["value"] = env.get(decl.name)
            row["error"] = str(err)
        rows.append(row)
    return rows


def validate_all(environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`ConfigError` for the first bad ``SYNCLESS_*`` value, if any.

    Also rejects a ``SYNCLESS_*`` name that is not declared (a typo would
    otherwise be ignored silently).
    """
    env = os.environ if environ is None else environ
    for name in sorted(env):
        if name.startswith("SYNCLESS_") and name not in _SETTINGS:
            raise ConfigError(f"{name} is not a syncless setting; known: {', '.join(_SETTINGS)}")
    for decl in settings():
        read(decl.name, env)
