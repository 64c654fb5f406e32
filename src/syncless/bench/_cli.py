"""``syncless bench pp|cc|syncs|all``: run benchmarks and write their reports."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from syncless._core.errors import MissingDependencyError
from syncless.bench._report import BenchOutput, render_markdown, run_metadata, write_output

# name -> module providing ``run(args, progress) -> BenchOutput``
BENCHMARKS = {
    "syncs": "syncless.bench._syncs",
    "cc": "syncless.bench._cc",
    "pp": "syncless.bench._pp",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` subcommand's arguments."""
    # metavar: argparse's errors name the argument by it ("argument BENCHMARK: invalid choice: 'foo'").
    parser.add_argument("which", choices=[*BENCHMARKS, "all"], metavar="BENCHMARK",
                        help=f"which benchmark to run: {', '.join(BENCHMARKS)} or all (all: each one this machine "
                             "can run; cc and pp need GPUs)")
    parser.add_argument("--out", type=Path, default=Path("bench-out"),
                        help="directory for JSON, markdown and (with matplotlib) PNG files (default: bench-out)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer sizes and repeats: a smoke run, not for quoting (default: off)")


def _progress(name: str, start_s: float):
    def report(message: str) -> None:
        print(f"[bench {name} {time.perf_counter() - start_s:6.1f}s] {message}", file=sys.stderr, flush=True)

    return report


def _check_out_dir(out: Path) -> None:
    """Refuse an --out that cannot hold the reports before anything is measured."""
    from syncless._core.exits import UsageError

    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a directory; pick a directory (default: bench-out)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--out {out}: cannot create the directory ({err.strerror}); pick another") from err


def run(args: argparse.Namespace) -> int:
    """Run the selected benchmarks; write ``<name>.json/.md/.png`` and ``report.md``."""
    names = list(BENCHMARKS) if args.which == "all" else [args.which]
    meta = run_metadata()
    start_s = time.perf_counter()
    _check_out_dir(args.out)
    outputs: list[BenchOutput] = []
    skipped: list[str] = []
    plots_missing = False
    for index, name in enumerate(names, 1):
        progress = _progress(name, start_s)
        progress(f"({index}/{len(names)}) starting")
        module = importlib.import_module(BENCHMARKS[name])
        try:
            output = module.run(args, progress)
        except MissingDependencyError as err:
            if args.which != "all":
                raise
            # `all` runs what this machine can run (a CPU machine: syncs) and says what it left out.
            progress(f"skipped: {err}")
            skipped.append(f"{name}: skipped, {err}")
            continue
        paths = write_output(output, args.out, meta)
        outputs.append(output)
        plots_missing = plots_missing or (output.plot is not None and "png" not in paths)
        progress(f"wrote {', '.join(str(p) for p in paths.values())}")
    report = args.out / "report.md"
    sections = [render_markdown(output, meta) for output in outputs]
    tail = ["## Not run\n"] + [f"- {line}" for line in skipped] if skipped else []
    report.write_text("# syncless benchmarks\n\n" + "\n".join(sections + tail) + ("\n" if tail else ""))
    print(f"report: {report}")
    if plots_missing:
        print("plots: not drawn, matplotlib is not installed; `pip install 'syncless[bench]'` adds it", file=sys.stderr)
    if not outputs:
        print("no benchmark could run here: " + "; ".join(skipped), file=sys.stderr)
        return 1
    missed = [g.description for output in outputs for g in output.goals if not g.met]
    for description in missed:
        print(f"goal missed: {description}")
    return 0
