"""The ``syncless`` command line: doctor, demo, bench, trace and docs.

Each subcommand lives in its own module, which provides
``add_arguments(parser)`` and ``run(args) -> int``; this file only wires
them together, so ``syncless --help`` imports no CUDA.

How a command ends (the same for every subcommand):

* a usage error (a bad option, a bad ``SYNCLESS_*`` value): one line on
  stderr naming the subcommand, the thing, the value and the fix (or where
  its help is: ``syncless demo: error: unrecognized arguments: --stpes 3
  (see `syncless demo --help`)``), with no usage block; exit status 2;
* any other error: one line on stderr; exit status 1;
* Ctrl-C or SIGTERM: one line, every process the command started is
  stopped; exit status 130 or 143 (``trace`` prints the report gathered
  until then first, marked as interrupted).

``--debug`` (or ``SYNCLESS_DEBUG=1``) prints the full traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NoReturn

from syncless import __version__
from syncless._core import config
from syncless._core.errors import ConfigError, SynclessError
from syncless._core.exits import (  # noqa: F401 - the exit statuses are part of the command line's surface
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    EXIT_USAGE,
    Terminated,
    UsageError,
)

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("syncless.doctor", "show what this machine offers and what syncless would choose"),
    "demo": ("syncless.demo", "run a pipelined decode twice, with syncless's transport and with torch.distributed"),
    "bench": ("syncless.bench._cli", "measure syncless against the plain path and write reports"),
    "trace": ("syncless.syncs._trace", "run a script with chosen functions checked for hidden GPU syncs (record mode)"),
    "docs": ("syncless.doctor._pages", "list the documentation installed with syncless, or print one page"),
}

#: Subcommands that run with an invalid SYNCLESS_* value (and report it) instead of refusing to start.
REPORTS_BAD_CONFIG = {"doctor"}

#: What the line after Ctrl-C or SIGTERM adds, for the subcommands that start processes.
_STOPPED = {"demo": "; every process it started was stopped", "bench": "; every process it started was stopped"}


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def _load(module_name: str) -> ModuleType | ConfigError:
    """Import a subcommand's module; a bad ``SYNCLESS_*`` value read at import comes back as the error."""
    try:
        return importlib.import_module(module_name)
    except ConfigError as err:
        return err


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line: the command, what was wrong, where the help is."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser with every subcommand (never raises on a bad ``SYNCLESS_*`` value)."""
    parser = _Parser(prog="syncless", description="Keep GPU inference pipelines asynchronous.")
    parser.add_argument("--version", action="version", version=f"syncless {__version__}")
    debug_help = "print the full traceback of an error (default: off; SYNCLESS_DEBUG=1 does the same)"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    # The same flag after the subcommand (`syncless demo --debug`); SUPPRESS keeps the top level's value.
    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = _load(module_name)
        sub = subparsers.add_parser(name, help=help_text, description=help_text, parents=[common])
        if isinstance(module, ConfigError):
            # The module cannot load with this environment: accept any arguments and report why at run time.
            sub.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            sub.set_defaults(_module=None, _load_error=module, _parser=sub)
            continue
        module.add_arguments(sub)
        sub.set_defaults(_module=module, _load_error=None, _parser=sub)
    return parser


def _debug_wanted(args: argparse.Namespace | None) -> bool:
    if args is not None and getattr(args, "debug", False):
        return True
    try:
        return bool(config.read("SYNCLESS_DEBUG"))
    except ConfigError:
        return False  # reported with the other bad values


def _one_line(err: BaseException) -> str:
    """The first line of an error's message (a stage's error carries its traceback after it)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _report_failure(command: str, err: BaseException) -> None:
    """One line per failure; the --debug hint only where a traceback exists that says more than the line.

    A ``SynclessError`` is a message written for the user ("needs a CUDA GPU"), and a stage that was killed
    or timed out left no traceback: for those the hint would send the user to nothing.
    """
    from syncless._core.launch import RankFailed

    has_traceback = False
    if isinstance(err, RankFailed) and getattr(err, "failures", None):
        for rank, story in sorted(err.failures.items()):
            print(f"syncless {command}: error: stage {rank}: {_one_line(Exception(story))}", file=sys.stderr)
            has_traceback = has_traceback or "Traceback (most recent" in story
        if err.stopped:
            print(f"syncless {command}: stages {err.stopped} were stopped after that", file=sys.stderr)
    elif isinstance(err, SynclessError):
        print(f"syncless {command}: error: {_one_line(err)}", file=sys.stderr)
    else:
        print(f"syncless {command}: error: {type(err).__name__}: {_one_line(err)}", file=sys.stderr)
        has_traceback = True
    if has_traceback:
        print(f"syncless {command}: run with --debug (or SYNCLESS_DEBUG=1) for the traceback", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the process exit code."""
    with warnings.catch_warnings():
        # The command line reports a bad SYNCLESS_SYNC_CHECK or SYNCLESS_SYNC_BACKEND itself, in one line
        # (below; doctor marks them and VLLM_GPU_SYNC_CHECK); the warning that importing syncless.syncs (or
        # syncless.compat.vllm) gives elsewhere would say it twice.
        warnings.filterwarnings("ignore", message=r"(SYNCLESS_SYNC_CHECK|SYNCLESS_SYNC_BACKEND|VLLM_GPU_SYNC_CHECK)=")
        parser = build_parser()
    # A usage error is one line naming the subcommand (not the top level's usage) and exits 2: an unknown
    # option of a subcommand is reported by that subcommand's parser.
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        (getattr(args, "_parser", None) or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    command = args.command
    bad_values = config.invalid_values()
    if args._load_error is not None or (bad_values and command not in REPORTS_BAD_CONFIG):
        for line in bad_values or [str(args._load_error)]:
            print(f"syncless {command}: error: {line}; fix or unset it (`syncless doctor` lists every setting)",
                  file=sys.stderr)
        return EXIT_USAGE
    debug = _debug_wanted(args)
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if _in_main_thread() else None
    try:
        return int(args._module.run(args) or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"\nsyncless {command}: interrupted{_STOPPED.get(command, '')}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        if debug:
            raise
        print(f"syncless {command}: terminated{_STOPPED.get(command, '')}", file=sys.stderr)
        return EXIT_TERMINATED
    except BrokenPipeError:
        # The reader went away (`syncless doctor | head -1`): stop quietly, as other command-line tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_ERROR
    except (UsageError, ConfigError) as err:
        if debug:
            raise
        print(f"syncless {command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as err:  # noqa: BLE001 - the top of the command line: one line instead of a traceback
        if debug:
            raise
        _report_failure(command, err)
        return EXIT_ERROR
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    raise SystemExit(main())
