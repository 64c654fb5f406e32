"""``syncless bench pp|cc|syncs|all``: run benchmarks and write their reports."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from syncless.bench._report import BenchOutput, render_markdown, run_metadata, write_output

# name -> module providing ``run(args, progress) -> BenchOutput``
BENCHMARKS = {
    "syncs": "syncless.bench._syncs",
    "cc": "syncless.bench._cc",
    "pp": "syncless.bench._pp",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` subcommand's arguments."""
    parser.add_argument("which", choices=[*BENCHMARKS, "all"], help="which benchmark to run")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="directory for JSON, PNG and markdown")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats (a smoke run, not for quoting)")


def _progress(name: str, start_s: float):
    def report(message: str) -> None:
        print(f"[bench {name} {time.perf_counter() - start_s:6.1f}s] {message}", file=sys.stderr, flush=True)

    return report


def run(args: argparse.Namespace) -> int:
    """Run the selected benchmarks; write ``<name>.json/.md/.png`` and ``report.md``."""
    names = list(BENCHMARKS) if args.which == "all" else [args.which]
    meta = run_metadata()
    start_s = time.perf_counter()
    outputs: list[BenchOutput] = []
    for index, name in enumerate(names, 1):
        progress = _progress(name, start_s)
        progress(f"({index}/{len(names)}) starting")
        module = importlib.import_module(BENCHMARKS[name])
        output = module.run(args, progress)
        paths = write_output(output, args.out, meta)
        outputs.append(output)
        progress(f"wrote {', '.join(str(p) for p in paths.values())}")
    report = args.out / "report.md"
    sections = [render_markdown(output, meta) for output in outputs]
    report.write_text("# syncless benchmarks\n\n" + "\n".join(sections))
    print(f"report: {report}")
    missed = [g.description for output in outputs for g in output.goals if not g.met]
    for description in missed:
        print(f"goal missed: {description}")
    return 0
