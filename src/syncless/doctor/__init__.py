"""``syncless doctor``: what this machine offers and what syncless would choose.

Exits 0 on any machine; what is absent is named with how to get it.
"""

from __future__ import annotations

import argparse
import json

from syncless.doctor._probe import collect
from syncless.doctor._render import render

__all__ = ["add_arguments", "collect", "render", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``doctor`` subcommand's arguments."""
    parser.add_argument("--json", action="store_true", help="print the same report as JSON")


def run(args: argparse.Namespace) -> int:
    """Print the report; return 0."""
    report = collect()
    print(json.dumps(report, indent=2, default=str) if args.json else render(report))
    return 0
