"""The ``syncless`` command line: doctor, demo, bench and trace.

Each subcommand lives in its own module, which provides
``add_arguments(parser)`` and ``run(args) -> int``; this file only wires
them together, so ``syncless --help`` imports no CUDA.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from syncless import __version__
from syncless._core.errors import SynclessError

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("syncless.doctor", "show what this machine offers and what syncless would choose"),
    "demo": ("syncless.demo", "run a pipelined decode loop that uses all three capabilities"),
    "bench": ("syncless.bench._cli", "measure syncless against the plain path and write reports"),
    "trace": ("syncless.syncs._trace", "run a script with chosen functions checked for hidden GPU syncs (record mode)"),
}


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="syncless", description="Keep GPU inference pipelines asynchronous.")
    parser.add_argument("--version", action="version", version=f"syncless {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sub)
        sub.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args._module.run(args) or 0)
    except SynclessError as err:
        print(f"syncless {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
