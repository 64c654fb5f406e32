"""A picture of the timeline: one lane per thread over wall time, checked regions shaded, syncs as bars.

Each sync is a bar as long as the host was blocked (a thin tick where it
was not timed, i.e. without CUPTI), coloured by kind and labelled with its
site. Drawn with matplotlib (in the ``bench`` and ``test`` extras) on its
Agg canvas, without touching pyplot's global state.
"""

from __future__ import annotations

import os

from syncless._core.errors import MissingDependencyError
from syncless.syncs._chrome_trace import NO_TIMELINE

INSTALL_HINT = "install matplotlib (`pip install 'syncless[bench]'`) to draw the timeline"
# Labels beyond this many would overlap into a smear; the busiest sites are labelled once per lane instead.
MAX_LABELS = 24

_KIND_COLORS = {
    "explicit": "#d62728",
    "implicit copy": "#ff7f0e",
    "host wait": "#9467bd",
    "blocking copy": "#8c564b",
    "allocator": "#e377c2",
    "blocking memset": "#7f7f7f",
    "teardown": "#17becf",
}


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise MissingDependencyError(f"syncs.report().plot(): matplotlib is missing: {INSTALL_HINT}") from err
    return Figure, FigureCanvasAgg


def plot(report, path, title: str | None = None) -> None:
    """Draw ``report``'s timeline to ``path`` (the format from its suffix: ``.png``, ``.svg``, ``.pdf``).

    Raises:
        ValueError: the report holds no timeline (``syncs.record_timeline()`` was not on).
        MissingDependencyError: matplotlib is not installed.
    """
    timeline = report.timeline
    if timeline is None:
        raise ValueError(NO_TIMELINE)
    figure_cls, canvas_cls = _matplotlib()
    lanes: list[tuple[int, int]] = []
    names: dict[tuple[int, int], str] = {}
    for item in [*timeline.regions, *timeline.syncs]:
        key = (item.pid, item.tid)
        if key not in names:
            lanes.append(key)
            names[key] = item.thread
    starts = [r.start_ns for r in timeline.regions] + [s.start_ns for s in timeline.syncs]
    ends = [r.end_ns for r in timeline.regions] + [s.start_ns + s.blocked_ns for s in timeline.syncs]
    origin = min(starts) if starts else 0
    span_ms = max((max(ends) - origin) / 1e6, 1e-3) if ends else 1.0
    tick_ms = span_ms / 400  # an untimed sync is drawn this wide, so that it is seen
    figure = figure_cls(figsize=(12, 1.2 + 0.9 * max(len(lanes), 1)))
    canvas_cls(figure)
    axes = figure.add_subplot(1, 1, 1)
    row = {key: index for index, key in enumerate(lanes)}
    for region in timeline.regions:
        y = row[(region.pid, region.tid)]
        axes.broken_barh([((region.start_ns - origin) / 1e6, (region.end_ns - region.start_ns) / 1e6)],
                         (y - 0.4, 0.8), facecolors="#cfe2f3", edgecolors="none", zorder=1)
    labelled: set[tuple[int, int, str]] = set()
    kinds_seen: dict[str, str] = {}
    for sync in timeline.syncs:
        key = (sync.pid, sync.tid)
        y = row[key]
        color = _KIND_COLORS.get(sync.kind, "#333333")
        kinds_seen[sync.kind] = color
        width = max(sync.blocked_ns / 1e6, tick_ms)
        axes.broken_barh([((sync.start_ns - origin) / 1e6, width)], (y - 0.25, 0.5), facecolors=color, zorder=2)
        label = (key[0], key[1], sync.site)
        if label not in labelled and len(labelled) < MAX_LABELS:
            labelled.add(label)
            axes.annotate(f"{os.path.basename(sync.filename)}:{sync.lineno}", ((sync.start_ns - origin) / 1e6, y + 0.3),
                          fontsize=7, rotation=20, zorder=3)
    axes.set_yticks(range(len(lanes)))
    axes.set_yticklabels([f"{names[key]} ({key[1]})" for key in lanes])
    axes.set_ylim(-0.7, max(len(lanes), 1) - 0.3)
    axes.set_xlim(0, span_ms * 1.02)
    axes.set_xlabel("wall time (ms from the first event)")
    axes.set_title(title or f"syncless: {len(timeline.syncs)} hidden sync(s); shaded: checked regions"
                   + (f" ({report.backend})" if report.backend else ""), fontsize=9)
    if kinds_seen:
        from matplotlib.patches import Patch

        axes.legend(handles=[Patch(color=color, label=kind) for kind, color in kinds_seen.items()],
                    loc="upper right", fontsize=7)
    figure.tight_layout()
    figure.savefig(os.fspath(path), dpi=120)
