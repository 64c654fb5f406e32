"""Format the demo's closing summary from what every stage reported: both runs side by side."""

from __future__ import annotations

from typing import Any

from syncless.demo._stage import DemoOptions, RunResult, StageResult

PLANTED_FUNCTION = "_planted_sync"


def _rate(run: RunResult) -> float:
    return run.tokens_generated / run.elapsed_s if run.elapsed_s > 0 else float("nan")


def _sync_count(results: list[StageResult], index: int) -> int:
    return sum(int(row.get("count", 1)) for r in results for row in r.runs[index].syncs)


def _sync_cell(results: list[StageResult], index: int) -> str:
    if not any(r.runs[index].sync_checked for r in results):
        return "not checked"
    count = _sync_count(results, index)
    return "none" if count == 0 else f"{count} at {sum(len(r.runs[index].syncs) for r in results)} site(s)"


def planted_rows(results: list[StageResult]) -> list[dict[str, Any]]:
    """The sync sites the detector attributed to the planted ``.item()``, over every run and stage."""
    return [row for r in results for run in r.runs for row in run.syncs if row.get("function") == PLANTED_FUNCTION]


def unplanted_sync_count(results: list[StageResult]) -> int:
    """Syncs found in the hot loop other than the planted one."""
    return sum(int(row.get("count", 1)) for r in results for run in r.runs for row in run.syncs
               if row.get("function") != PLANTED_FUNCTION)


def format_summary(options: DemoOptions, results: list[StageResult], wall_s: float) -> str:
    """Return the summary: stages, each run's transport, tokens/s and syncs, their ratio, interference, CC."""
    last = results[-1]
    lines = ["", "== syncless demo summary"]
    for r in results:
        lines.append(f"  stage {r.rank}: {r.device}, layers {r.layers[0]}-{r.layers[-1]}" if r.layers
                     else f"  stage {r.rank}: {r.device}, no layers")
    lines.append(f"  decode: {options.steps} steps x {options.micro_batches} micro-batches x {options.batch} "
                 f"sequences per run; {wall_s:.1f} s in all with start-up")
    lines.append("")
    lines.append(f"  {'run':<19}{'transport':<19}{'tokens':>8}{'seconds':>9}{'tokens/s':>11}   hidden syncs in the hot loop")
    for index, run in enumerate(last.runs):
        transport = results[0].runs[index].transport or "none (one stage)"
        lines.append(f"  {run.label:<19}{transport:<19}{run.tokens_generated:>8}{run.elapsed_s:>9.2f}"
                     f"{_rate(run):>11,.0f}   {_sync_cell(results, index)}")
    if len(last.runs) == 2:
        ours, theirs = last.runs
        if results[0].runs[0].transport == results[0].runs[1].transport:
            # The same transport twice, measured once each, one after the other: a gap between them is not
            # the transport's, and a newcomer would quote a ratio. Not "noise" either: on a CPU the gap was
            # seen one-sided in some series and either way in others (docs/demo.md), which one pair of runs
            # cannot tell apart. Give no ratio, and say nothing can be concluded here.
            lines.append(f"  {ours.label} / {theirs.label}: no ratio: both runs used "
                         f"{results[0].runs[0].transport} here, each measured once, one after the other; "
                         "nothing about syncless can be concluded from their tokens/s on a CPU (the transports "
                         "differ on GPUs with copy engines)")
        else:
            ratio = _rate(ours) / _rate(theirs) if _rate(theirs) > 0 else float("nan")
            lines.append(f"  {ours.label} / {theirs.label}: {ratio:.2f}x the tokens/s")
    reason = results[0].runs[0].transport_reason if results[0].runs else None
    if reason:
        lines.append(f"  {last.runs[0].label}'s transport fell back: {reason}")
    lines += _sync_lines(options, results)
    lines += _pending_lines(results)
    cc = results[0].cc
    lines.append(f"  confidential computing: {cc.get('mode')} ({cc.get('reason', '')})")
    samples = [run.sample[-1] for run in last.runs if run.sample]
    if samples:
        same = "" if len(samples) < 2 else (" (the same in both runs)" if all(s == samples[0] for s in samples)
                                             else " (they differ between the runs)")
        lines.append(f"  last tokens (first 8 sequences): {samples[0]}{same}")
    return "\n".join(lines)


def _sync_lines(options: DemoOptions, results: list[StageResult]) -> list[str]:
    lines = []
    if not any(run.sync_checked for r in results for run in r.runs):
        reason = results[0].sync_unchecked_reason or "the detector could not run"
        lines.append(f"  hidden syncs: not checked ({reason})")
        if options.plant_sync:
            lines.append("  --plant-sync: the planted .item() ran, but nothing could check it here")
        return lines
    planted = planted_rows(results)
    if options.plant_sync:
        if planted:
            sites = ", ".join(sorted({row["site"] for row in planted}))
            total = sum(int(row.get("count", 1)) for row in planted)
            over = "over both runs" if len(options.runs) > 1 else "in the run"
            lines.append(f"  --plant-sync: the planted .item() was caught at {sites} ({total} times {over})")
        else:
            lines.append("  --plant-sync: the planted .item() was NOT caught")
    for index, run in enumerate(results[-1].runs):
        for r in results:
            found = r.runs[index]
            if found.syncs:
                lines.append(f"  {found.label}, stage {r.rank}:")
                lines += ["    " + line for line in found.sync_report.splitlines()]
    return lines


def _pending_lines(results: list[StageResult]) -> list[str]:
    pending = next((r.pending for r in results if r.pending is not None), None)
    if pending is None:
        return []
    if "skipped" in pending:
        return [f"  full-SM kernel while a receive is pending: not measured ({pending['skipped']})"]
    ours = pending.get("ours_ratio")
    ours_text = f", {pending['ours_backend']} {ours:.2f}x" if ours is not None else ""
    checks = "" if pending.get("pending_ok") and pending.get("data_ok") else (
        " (warning: a receive was not pending throughout, or its data did not arrive intact)")
    return [f"  full-SM kernel on stage 1 while a {pending['payload_nbytes'] >> 20} MiB receive is pending, time vs "
            f"alone ({pending['alone_ms']:.2f} ms): NCCL {pending['nccl_ratio']:.2f}x{ours_text}{checks}"]
