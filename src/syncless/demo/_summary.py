"""Format the demo's closing summary from what every stage reported."""

from __future__ import annotations

from syncless.demo._stage import DemoOptions, StageResult


def format_summary(options: DemoOptions, results: list[StageResult], wall_s: float) -> str:
    """Return the summary: stages, transport and why, tokens/s, syncs found, CC mode."""
    last = results[-1]
    tokens = last.tokens_generated
    tokens_per_s = tokens / last.elapsed_s if last.elapsed_s > 0 else float("nan")
    lines = ["", "== syncless demo summary"]
    for r in results:
        lines.append(f"  stage {r.rank}: {r.device}, layers {r.layers[0]}-{r.layers[-1]}" if r.layers
                     else f"  stage {r.rank}: {r.device}, no layers")
    if len(results) > 1:
        first = results[0]
        reason = f" (fallback: {first.transport_reason})" if first.transport_reason else ""
        lines.append(f"  transport: {first.transport}{reason}")
    else:
        lines.append("  transport: none (one stage)")
    lines.append(f"  decode: {tokens} tokens in {last.elapsed_s:.2f} s = {tokens_per_s:,.0f} tokens/s "
                 f"({options.steps} steps x {options.micro_batches} micro-batches x {options.batch} sequences; "
                 f"{wall_s:.1f} s with start-up)")
    total_syncs = sum(int(row.get("count", 1)) for r in results for row in r.syncs)
    if not any(r.sync_checked for r in results):
        lines.append("  hidden syncs in the hot loop: not checked (this torch build has no CUDA sync debug mode)")
    elif total_syncs == 0:
        lines.append("  hidden syncs in the hot loop: none (checked in record mode)")
    else:
        lines.append(f"  hidden syncs in the hot loop: {total_syncs}")
        for r in results:
            if r.syncs:
                lines.append(f"  stage {r.rank}:")
                lines += ["    " + line for line in r.sync_report.splitlines()]
    cc = results[0].cc
    lines.append(f"  confidential computing: {cc.get('mode')} ({cc.get('reason', '')})")
    if last.sample:
        lines.append(f"  last tokens (first 8 sequences): {last.sample[-1]}")
    return "\n".join(lines)
