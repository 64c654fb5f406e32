"""The one registry of ``SYNCLESS_*`` environment variables.

Each variable is declared exactly once here: its name, how its text is parsed,
its default and what it does. Reading one validates it, and a bad value
raises :class:`ConfigError` naming the variable, the value given and the
values allowed. Explicit arguments always beat the environment
(:func:`resolve`).
"""

from __future__ import annotations

import difflib
import os
import re
import sys
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


#: Bounds of a pipeline timeout: below, the host would poll its peer in a busy loop (and a healthy step
#: could not finish in time); above, the deadlines overflow what the socket and gloo timeouts accept.
PP_TIMEOUT_MIN_S = 0.1
PP_TIMEOUT_MAX_S = 86400.0


def check_pp_timeout(value: object, name: str) -> float:
    """Return ``value`` as seconds if it is a number in [:data:`PP_TIMEOUT_MIN_S`, :data:`PP_TIMEOUT_MAX_S`].

    Raises:
        ConfigError: it is not a number (bool included), not finite, or out of bounds; the message
            names ``name``, the value and the bounds.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number of seconds; got {value!r}")
    seconds = float(value)
    if not PP_TIMEOUT_MIN_S <= seconds <= PP_TIMEOUT_MAX_S:  # NaN fails both comparisons
        raise ConfigError(
            f"{name}={value!r} is out of bounds: a pipeline timeout is {PP_TIMEOUT_MIN_S:g} to "
            f"{PP_TIMEOUT_MAX_S:g} seconds (one day)"
        )
    return seconds


def _pp_timeout_seconds(text: str) -> float:
    try:
        return check_pp_timeout(float(text), "SYNCLESS_PP_TIMEOUT_S")
    except ConfigError as err:
        raise ValueError(text) from err


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}
_SIZE_PATTERN = re.compile(r"^\s*(\d+)\s*([a-z]*)\s*$")


def _count(text: str) -> int:
    value = int(text.strip())
    if value < 0:
        raise ValueError(f"{value} is negative")
    return value


def _int_between(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text.strip())
        if not low <= value <= high:
            raise ValueError(f"{value} is outside [{low}, {high}]")
        return value

    return parse


def parse_nbytes(text: str) -> int:
    """Parse a byte count such as ``"1048576"``, ``"64MiB"`` or ``"2G"`` (binary units)."""
    match = _SIZE_PATTERN.match(text.lower())
    if match is None or match.group(2) not in _SIZE_UNITS:
        raise ValueError(text)
    return int(match.group(1)) * _SIZE_UNITS[match.group(2)]


def _nbytes_at_most(high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = parse_nbytes(text)
        if value > high:
            raise ValueError(f"{value} is above {high}")
        return value

    return parse


_SETTINGS: dict[str, Setting] = {}
_PREFIX = "SYNCLESS_"


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
    "SYNCLESS_SYNC_NVTX",
    _boolean,
    "0",
    "1, true, yes, on / 0, false, no, off",
    "Also put each recorded hidden sync on the NVTX row (torch.cuda.nvtx) for Nsight Systems (read once at import).",
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
    "SYNCLESS_CC_INLINE_MAX_BYTES",
    _nbytes_at_most(4080),  # syncless.cc._inline_h2d.INLINE_MAX_BYTES: what one kernel launch's parameters hold
    "4080",
    "a byte count from 0 to 4080",
    "Non-blocking host-to-device copies of at most this many bytes are written by a kernel from its launch "
    "parameters (no transfer to wait for under CC); 0 stages them like larger ones.",
)
_declare(
    "SYNCLESS_CC_D2H_HELPER",
    _boolean,
    "0",
    "1/true/yes/on or 0/false/no/off",
    "Small offloaded device-to-host copies are made by a helper process per GPU (its own GIL and CUDA context), "
    "so no thread of this process waits for their transfer under CC; read at cc.install().",
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
    _pp_timeout_seconds,
    "60",
    "a number of seconds from 0.1 to 86400 (one day)",
    "How long a pipeline stage waits for its peer before raising instead of hanging.",
)
_declare(
    "SYNCLESS_PP_AUTO_SLOTS",
    _int_between(2, 64),
    "2",
    "a whole number from 2 to 64",
    'With make_transport(..., depth="auto"): receive slots per link for the steps that go through a slot; every '
    "stage must set the same value.",
)
_declare(
    "SYNCLESS_PP_AUTO_DIRECT_MIN_BYTES",
    parse_nbytes,
    "0",
    "a byte count such as 0, 1048576, 64MiB or 1GiB",
    'With depth="auto": the smallest step that may go straight into the receiver\'s persistent tensors (smaller '
    "steps always go through a slot).",
)
_declare(
    "SYNCLESS_FUZZ_PROGRAMS",
    _count,
    "20000",
    "a whole number >= 0",
    "Tests: how many random programs the syncless.cc differential fuzzer runs on the GPU.",
)
_declare(
    "SYNCLESS_FUZZ_SEED",
    _count,
    "20261130",
    "a whole number >= 0",
    "Tests: the first seed of the syncless.cc differential fuzzer (program i uses seed + i).",
)
_declare(
    "SYNCLESS_FUZZ_TIME_S",
    _count,
    "0",
    "a whole number of seconds >= 0 (0: no limit)",
    "Tests: stop the syncless.cc differential fuzzer after this long, at the end of a round, and report the count.",
)
_declare(
    "SYNCLESS_DEBUG",
    _boolean,
    "0",
    "1/true/yes/on or 0/false/no/off",
    "The syncless command line prints the full traceback of an error instead of one line (same as --debug).",
)
_declare(
    "SYNCLESS_REQUIRE_GPU",
    _boolean,
    "0",
    "1/true/yes/on or 0/false/no/off",
    "Tests: fail instead of skipping when a GPU test finds no GPU.",
)
_declare(
    "SYNCLESS_REQUIRE_CUPTI",
    _boolean,
    "0",
    "1/true/yes/on or 0/false/no/off",
    "Tests: with SYNCLESS_REQUIRE_GPU=1, fail instead of skipping when a CUPTI test finds no cupti-python.",
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


def read_or_default(name: str, environ: Mapping[str, str] | None = None) -> tuple[Any, str | None]:
    """Read ``name`` as :func:`read` does, but fall back to its default instead of raising.

    For a setting read when a module is imported (``SYNCLESS_SYNC_CHECK``,
    ``SYNCLESS_SYNC_BACKEND``): an import must not fail on a bad value, because
    the pytest plugin imports those modules in every pytest run of the
    environment.

    Returns:
        ``(value, None)`` for a good (or unset) value; ``(default value, message)``
        for a bad one, the message naming the variable, the value and the values allowed.
    """
    try:
        return read(name, environ), None
    except ConfigError as err:
        return setting(name).parse(setting(name).default), str(err)


def check_choice(value: object, what: str, name: str) -> str:
    """Validate an explicit argument against the values the choice setting ``name`` allows.

    The argument is parsed as the variable's text is (so ``"Torch "`` is
    ``"torch"``), and the errors name the argument, the value and the values
    allowed, so that the keyword and the variable accept the same words.

    Raises:
        TypeError: ``value`` is not a ``str``.
        ValueError: ``value`` is not one of the allowed values.
    """
    decl = setting(name)
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, one of {decl.allowed}; got {type(value).__name__}")
    try:
        return decl.parse(value)
    except ValueError:
        raise ValueError(
            f"{what} must be one of {decl.allowed}; got {value!r} (the values allowed for {name})") from None


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


def closest_name(name: str) -> str | None:
    """Return the declared variable ``name`` was most likely meant to be, or None if none is close."""
    # Compare what follows SYNCLESS_: the shared prefix alone made every name look close to every other
    # (SYNCLESS_FOO got "did you mean SYNCLESS_CC?").
    stem = name.removeprefix(_PREFIX)
    by_stem = {known.removeprefix(_PREFIX): known for known in _SETTINGS}
    matches = difflib.get_close_matches(stem, list(by_stem), n=1, cutoff=0.7)
    if matches:
        return by_stem[matches[0]]
    # A longer name that starts like a declared one: SYNCLESS_CC_MODE for SYNCLESS_CC.
    prefixed = [known for known in _SETTINGS if name.startswith(known + "_")]
    return max(prefixed, key=len) if prefixed else None


def unknown_names(environ: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """Return ``(name, closest declared name or None)`` for every ``SYNCLESS_*`` variable not declared here."""
    env = os.environ if environ is None else environ
    return [(name, closest_name(name)) for name in sorted(env)
            if name.startswith("SYNCLESS_") and name not in _SETTINGS]


def describe_unknown(name: str, closest: str | None) -> str:
    """One line on an undeclared ``SYNCLESS_*`` variable: that it is ignored, and what was likely meant."""
    hint = f"did you mean {closest}?" if closest else f"known: {', '.join(_SETTINGS)}"
    return f"{name} is not a syncless setting and is ignored ({hint})"


def invalid_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Return one message per declared variable whose value is not allowed (empty when all are valid). Never raises."""
    return [row["error"] for row in effective(environ) if row["error"]]


def validate_all(environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`ConfigError` for the first bad ``SYNCLESS_*`` value, if any.

    Also rejects a ``SYNCLESS_*`` name that is not declared; callers that
    should only warn about one use :func:`unknown_names`.
    """
    env = os.environ if environ is None else environ
    for name, closest in unknown_names(env):
        raise ConfigError(describe_unknown(name, closest))
    for decl in settings():
        read(decl.name, env)


def warn_unknown_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """Log a warning, once per process and name, for each undeclared ``SYNCLESS_*`` variable; return the lines.

    Processes started by :mod:`multiprocessing` (the demo's and tests' ranks)
    stay quiet: their parent has already warned about the same environment.
    """
    import logging

    from syncless._core.logs import log_once

    if started_by_multiprocessing():
        return []
    logger = logging.getLogger("syncless")
    lines = []
    for name, closest in unknown_names(environ):
        line = describe_unknown(name, closest)
        if log_once(logger, logging.WARNING, f"unknown-setting:{name}", "syncless: warning: %s", line):
            lines.append(line)
    return lines


def started_by_multiprocessing() -> bool:
    """Whether this process is a child that :mod:`multiprocessing` started (spawn, forkserver or fork).

    A spawned child imports syncless while it unpickles its target, before
    ``multiprocessing.parent_process()`` is set (that happens when the target
    starts to run); its interpreter's command line (``sys.orig_argv``: the
    child's ``sys.argv`` is replaced by the parent's) ends in ``--multiprocessing-fork``.
    """
    import multiprocessing

    return multiprocessing.parent_process() is not None or "--multiprocessing-fork" in sys.orig_argv
