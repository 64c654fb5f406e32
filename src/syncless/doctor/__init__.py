"""``syncless doctor``: what this machine offers and what syncless would choose.

Runs on any machine; what is absent is named with how to get it. Exits 1
when a ``SYNCLESS_*`` setting is invalid or unknown (a misspelt name), so a
script can check its configuration with it, and 0 otherwise.
"""

from __future__ import annotations

import argparse
import json

from syncless.doctor._probe import collect, config_problems
from syncless.doctor._render import render

__all__ = ["add_arguments", "collect", "render", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``doctor`` subcommand's arguments."""
    parser.add_argument("--json", action="store_true", help="print the same report as JSON (default: text)")


def run(args: argparse.Namespace) -> int:
    """Print the report; return 1 if a setting is invalid or unknown, else 0."""
    report = collect()
    print(json.dumps(report, indent=2, default=str) if args.json else render(report))
    return 1 if config_problems(report) else 0
