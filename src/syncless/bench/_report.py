"""Write benchmark results: JSON for machines, markdown for people, PNG plots.

Every result file carries the command, the machine and the date, so that a
committed result can be traced to the run that made it.
"""

from __future__ import annotations

import datetime
import json
import platform
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Goal:
    """A target a benchmark is judged against, and whether this run met it."""

    description: str
    measured: float
    target: float
    unit: str = "x"
    higher_is_better: bool = False

    @property
    def met(self) -> bool:
        return self.measured >= self.target if self.higher_is_better else self.measured <= self.target

    def as_dict(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "measured": self.measured,
            "target": self.target,
            "unit": self.unit,
            "higher_is_better": self.higher_is_better,
            "met": self.met,
        }


@dataclass
class BenchOutput:
    """What one benchmark produced: raw data, tables, goals and plots.

    Attributes:
        name: short name, used for file names (``pp`` -> ``pp.json``).
        title: heading of its markdown section.
        data: raw measurements, stored in the JSON file as they are.
        tables: ``(caption, columns, rows)`` triples rendered as markdown.
        goals: targets with the measured values.
        plot: draws the PNG; called with the path to write.
        notes: lines printed under the tables.
    """

    name: str
    title: str
    data: dict[str, Any] = field(default_factory=dict)
    tables: list[tuple[str, Sequence[str], Sequence[Sequence[Any]]]] = field(default_factory=list)
    goals: list[Goal] = field(default_factory=list)
    plot: Callable[[Path], None] | None = None
    notes: list[str] = field(default_factory=list)


def _command_line() -> str:
    """The command as a user would type it (``syncless ...`` also for ``python -m syncless``)."""
    program = sys.argv[0] if sys.argv else ""
    if program.endswith(("syncless", "__main__.py")):
        return " ".join(["syncless", *sys.argv[1:]])
    return " ".join(sys.argv)


def run_metadata() -> dict[str, Any]:
    """Describe this run: date, command, host, software and GPUs."""
    import torch

    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "command": _command_line(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": gpus,
    }


def format_value(value: Any) -> str:
    """Format a table cell: floats to 3 significant digits, others as text."""
    if isinstance(value, float):
        if value != value:
            return "n/a"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.3g}"
    return str(value)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Render a markdown table."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    lines += ["| " + " | ".join(format_value(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(output: BenchOutput, meta: dict[str, Any], heading_level: int = 2, plotted: bool | None = None) -> str:
    """Render one benchmark's section: metadata, tables, goals, notes and plot link.

    ``plotted`` says whether the PNG exists (default: whether matplotlib can be imported).
    """
    if plotted is None:
        plotted = is_plotting_available()
    hashes = "#" * heading_level
    parts = [f"{hashes} {output.title}", ""]
    gpus = ", ".join(meta["gpus"]) or "no GPU"
    parts.append(
        f"Run {meta['date_utc']} UTC on `{meta['host']}` ({gpus}; torch {meta['torch']}, "
        f"Python {meta['python']}). Command: `{meta['command']}`."
    )
    for caption, columns, rows in output.tables:
        parts += ["", f"**{caption}**", "", markdown_table(columns, rows)]
    if output.goals:
        rows = [
            [g.description, f"{format_value(g.measured)} {g.unit}", f"{'>=' if g.higher_is_better else '<='} {format_value(g.target)} {g.unit}", "met" if g.met else "MISSED"]
            for g in output.goals
        ]
        parts += ["", "**Goals**", "", markdown_table(["goal", "measured", "target", ""], rows)]
    if output.notes:
        parts += [""] + [f"- {note}" for note in output.notes]
    if output.plot is not None and plotted:
        parts += ["", f"![{output.title}]({output.name}.png)"]
    elif output.plot is not None:
        parts += ["", f"(No plot: matplotlib is not installed; `pip install 'syncless[bench]'` adds it.)"]
    return "\n".join(parts) + "\n"


def is_plotting_available() -> bool:
    """Whether matplotlib (the ``bench`` extra) can be imported."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def write_output(output: BenchOutput, out_dir: Path, meta: dict[str, Any] | None = None) -> dict[str, Path]:
    """Write ``<name>.json``, ``<name>.md`` and, if it has a plot and matplotlib is installed, ``<name>.png``.

    Without matplotlib the JSON and markdown are still written, and the
    markdown says how to get the plot.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = run_metadata() if meta is None else meta
    paths = {"json": out_dir / f"{output.name}.json", "md": out_dir / f"{output.name}.md"}
    document = {
        "meta": meta,
        "data": output.data,
        "tables": [{"caption": c, "columns": list(cols), "rows": [list(r) for r in rows]} for c, cols, rows in output.tables],
        "goals": [g.as_dict() for g in output.goals],
        "notes": output.notes,
    }
    paths["json"].write_text(json.dumps(document, indent=2, default=str) + "\n")
    plotted = output.plot is not None and is_plotting_available()
    if plotted:
        paths["png"] = out_dir / f"{output.name}.png"
        output.plot(paths["png"])
    paths["md"].write_text(render_markdown(output, meta, heading_level=1, plotted=plotted))
    return paths
