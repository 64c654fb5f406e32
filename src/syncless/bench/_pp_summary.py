"""Turn the workers' results into the ``pp`` report: tables, goals, notes and the plot.

Plain Python (matplotlib only inside the plot), so it is unit-tested with
made-up numbers. A value that was not measured is NaN and shows as "n/a"; a
goal whose value is missing counts as missed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from syncless.bench._pp_launch import Outcome
from syncless.bench._pp_plan import (
    BANDWIDTH_VS_NCCL_TARGET,
    BANDWIDTH_VS_RAW_TARGET,
    GOAL_SPLIT_NBYTES,
    HIDDEN,
    OWN_STREAM,
    PENDING_KERNEL_TARGET,
    Plan,
    latency_vs_nccl_target,
    payload_label,
    size_label,
)
from syncless.bench._report import BenchOutput, Goal

NAN = float("nan")
METHOD_NAMES = {
    "raw": "raw peer copy",
    "nccl": "NCCL send/recv",
    "ours": "ours",
    "ours_depth0": "ours, depth=0",
    "ours_auto": 'ours, depth="auto"',
    "raw_flags": "raw copy + flags",
}
METHOD_NAMES.update({m + OWN_STREAM: f"{name}, own stream" for m, name in list(METHOD_NAMES.items())})
BANDWIDTH_METHODS = ("raw", "nccl", "ours", "ours_depth0", "ours_auto")
LATENCY_METHODS = ("nccl", "ours", "ours_depth0", "raw_flags", "ours_auto")
#: the latency runs: (suffix of the method names, what the table calls the callers' stream)
LATENCY_STREAMS = (("", "default"), (OWN_STREAM, "own"))


def lookup(tree: Any, *path: Any) -> Any:
    """Return the value at ``path`` in nested dicts, or None where any key is missing."""
    node = tree
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def number(tree: Any, *path: Any) -> float:
    """Return the number at ``path``, or NaN where it is missing or not a number."""
    value = lookup(tree, *path)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return NAN
    return float(value)


def ratio(numerator: float, denominator: float) -> float:
    """Return ``numerator / denominator``, NaN unless both are finite and the denominator positive."""
    if not (math.isfinite(numerator) and math.isfinite(denominator)) or denominator <= 0:
        return NAN
    return numerator / denominator


# Tables ----------------------------------------------------------------------------

# depth="auto" (opt-in, not judged) comes last, so the columns before it keep their places.
BANDWIDTH_COLUMNS = ["payload", "raw peer copy GB/s", "NCCL GB/s", "ours GB/s", "ours depth=0 GB/s", "ours / raw",
                     "ours / NCCL", "ours depth=0 / raw", "ours depth=0 / NCCL", "ours auto GB/s", "ours auto / raw",
                     "ours auto / NCCL"]  # fmt: skip
LATENCY_COLUMNS = ["callers' stream", "payload", "NCCL us", "ours us", "ours depth=0 us", "raw copy + flags us",
                   "ours / NCCL", "ours depth=0 / NCCL", "ours auto us", "ours auto / NCCL"]
INTERFERENCE_COLUMNS = ["what", "alone", "with NCCL", "with ours", "NCCL / alone", "ours / alone"]
HOST_CPU_COLUMNS = ["payload", "ours send() us", "NCCL send us", "ours recv() us", "NCCL recv us"]


def bandwidth_rows(plan: Plan, results: dict[Any, Any]) -> list[list[Any]]:
    rows = []
    for nbytes in plan.payloads:
        raw, nccl, ours, direct, auto = (number(results, "bandwidth", m, nbytes, "gbps") for m in BANDWIDTH_METHODS)
        rows.append([payload_label(nbytes), raw, nccl, ours, direct, ratio(ours, raw), ratio(ours, nccl),
                     ratio(direct, raw), ratio(direct, nccl), auto, ratio(auto, raw), ratio(auto, nccl)])  # fmt: skip
    return rows


def latency_rows(plan: Plan, results: dict[Any, Any]) -> list[list[Any]]:
    rows = []
    for suffix, stream in LATENCY_STREAMS:
        for nbytes in plan.latency_payloads:
            nccl, ours, direct, raw, auto = (
                number(results, "latency", m + suffix, nbytes, "one_way_us") for m in LATENCY_METHODS
            )
            rows.append([stream, payload_label(nbytes), nccl, ours, direct, raw, ratio(ours, nccl),
                         ratio(direct, nccl), auto, ratio(auto, nccl)])  # fmt: skip
    return rows


def interference_rows(plan: Plan, results: dict[Any, Any]) -> list[list[Any]]:
    gemm = [number(results, "gemm", m, "ms_per_gemm") for m in ("alone", "nccl", "ours")]
    spin = [number(results, "pending", m, "kernel_ms") for m in ("alone", "nccl", "ours")]
    n = plan.gemm_n
    return [
        [f"bf16 {n}x{n}x{n} GEMM on the sending GPU while {size_label(plan.interference_nbytes)} steps stream, ms",
         *gemm, ratio(gemm[1], gemm[0]), ratio(gemm[2], gemm[0])],
        [f"full-SM kernel on the receiving GPU while a {size_label(plan.pending_nbytes)} receive is pending, ms",
         *spin, ratio(spin[1], spin[0]), ratio(spin[2], spin[0])],
    ]  # fmt: skip


def host_cpu_rows(plan: Plan, results: dict[Any, Any]) -> list[list[Any]]:
    rows = []
    for nbytes in plan.payloads:
        rows.append(
            [
                payload_label(nbytes),
                number(results, "host_cpu", "ours", nbytes, "send", "thread_us"),
                number(results, "host_cpu", "nccl", nbytes, "send", "thread_us"),
                number(results, "host_cpu", "ours", nbytes, "recv", "thread_us"),
                number(results, "host_cpu", "nccl", nbytes, "recv", "thread_us"),
            ]
        )
    return rows


# Goals -----------------------------------------------------------------------------


def goals(plan: Plan, results: dict[Any, Any]) -> list[Goal]:
    """Return issue 18's goals for the default setting ("ours") with this run's values.

    One row per size and kind: sustained bandwidth at every payload (ours /
    NCCL, and from :data:`GOAL_SPLIT_NBYTES` up ours / raw peer copy), one-way
    latency at every latency payload on both stream modes; then the ones kept
    from before (GEMM slowdown, full-SM kernel with a receive pending, host
    CPU per call). depth=0 and depth="auto" are reported in the tables, not judged. Missing
    values count as missed.
    """
    out = []
    split = size_label(GOAL_SPLIT_NBYTES)
    vs_nccl = f"(target: at least {BANDWIDTH_VS_NCCL_TARGET}x at every size)"
    vs_raw = f"(target: at least {BANDWIDTH_VS_RAW_TARGET}x from {split} up)"
    higher = {"unit": "x", "higher_is_better": True}
    for nbytes in plan.payloads:
        raw, nccl, ours = (number(results, "bandwidth", m, nbytes, "gbps") for m in ("raw", "nccl", "ours"))
        what = f"sustained bandwidth at {size_label(nbytes)}: ours"
        out.append(Goal(f"{what} / NCCL {vs_nccl}", ratio(ours, nccl), BANDWIDTH_VS_NCCL_TARGET, **higher))
        if nbytes >= GOAL_SPLIT_NBYTES:
            out.append(Goal(f"{what} / raw peer copy {vs_raw}", ratio(ours, raw), BANDWIDTH_VS_RAW_TARGET, **higher))
    for suffix, _ in LATENCY_STREAMS:
        where = "" if not suffix else ", each rank on its own stream"
        for nbytes in plan.latency_payloads:
            nccl, ours = (number(results, "latency", m + suffix, nbytes, "one_way_us") for m in ("nccl", "ours"))
            target = latency_vs_nccl_target(nbytes)
            span = f"from {split} up" if nbytes >= GOAL_SPLIT_NBYTES else f"below {split}"
            what = f"one-way GPU latency at {size_label(nbytes)}{where}: ours / NCCL"
            out.append(Goal(f"{what} (target: at most {target}x {span})", ratio(ours, nccl), target, "x"))
    out.append(
        Goal(
            "GEMM slowdown on the sending GPU while streaming: ours (target: NCCL's slowdown)",
            number(results, "gemm", "ours", "slowdown_pct"),
            number(results, "gemm", "nccl", "slowdown_pct"),
            "%",
        )
    )
    out.append(
        Goal(
            "full-SM kernel on the receiving GPU with a receive pending: ours / alone",
            number(results, "pending", "ours", "ratio"),
            PENDING_KERNEL_TARGET,
            "x",
        )
    )
    size = size_label(plan.cpu_nbytes)
    calls = (("send", "send()", "NCCL isend batch"), ("recv", "recv()", "NCCL irecv batch + wait"))
    for direction, call, nccl_call in calls:
        out.append(
            Goal(
                f"host CPU per {call} at {size}: ours (target: {nccl_call})",
                number(results, "host_cpu", "ours", plan.cpu_nbytes, direction, "thread_us"),
                number(results, "host_cpu", "nccl", plan.cpu_nbytes, direction, "thread_us"),
                "us",
            )
        )
    return out


# Notes -----------------------------------------------------------------------------


def quality_flags(plan: Plan, results: dict[Any, Any]) -> list[str]:
    """Return a line for every measurement whose conditions did not hold (host behind, bad data, ...)."""
    flags = []
    for method in BANDWIDTH_METHODS:
        for nbytes in plan.payloads:
            record = lookup(results, "bandwidth", method, nbytes)
            if not isinstance(record, dict):
                continue
            where = f"bandwidth {METHOD_NAMES[method]} at {size_label(nbytes)}"
            if record.get("data_ok") is False:
                flags.append(f"{where}: the received bytes did NOT match what was sent")
            ahead = record.get("ahead") or []
            if ahead and not all(ahead):
                flags.append(
                    f"{where}: in {ahead.count(False)} of {len(ahead)} repeats the loop was not fully queued "
                    "before the GPU started (host-paced, or the launch queue was full)"
                )
    for method in (m + suffix for suffix, _ in LATENCY_STREAMS for m in LATENCY_METHODS):
        for nbytes in plan.latency_payloads:
            record = lookup(results, "latency", method, nbytes)
            if not isinstance(record, dict):
                continue
            where = f"latency {METHOD_NAMES[method]} at {size_label(nbytes)}"
            if record.get("data_ok") is False:
                flags.append(f"{where}: the echoed bytes did NOT match what was sent")
            if record.get("all_ahead") is False:
                flags.append(f"{where}: no repeat had the whole loop queued before the GPU started (host-paced)")
    for method in ("nccl", "ours"):
        if lookup(results, "gemm", method, "covered") is False:
            flags.append(f"GEMM interference with {METHOD_NAMES[method]}: the sends ended before the GEMM loop did")
        if lookup(results, "pending", method, "pending") is False:
            flags.append(
                f"pending receive with {METHOD_NAMES[method]}: data landed before a kernel ended (not pending)"
            )
        if lookup(results, "pending", method, "data_ok") is False:
            flags.append(f"pending receive with {METHOD_NAMES[method]}: the received bytes did NOT match")
    return flags


def ceiling_notes(plan: Plan, results: dict[Any, Any]) -> list[str]:
    """Return a line for each payload where even the raw peer copy is short of the bandwidth target vs NCCL.

    Ours is a peer copy plus flags, so raw / NCCL is what ours / NCCL can
    expect at best (splitting a copy over streams or copy engines measured
    no faster on H200s).
    """
    out = []
    for nbytes in plan.payloads:
        raw, nccl = (number(results, "bandwidth", m, nbytes, "gbps") for m in ("raw", "nccl"))
        ceiling = ratio(raw, nccl)
        if math.isfinite(ceiling) and ceiling < BANDWIDTH_VS_NCCL_TARGET:
            out.append(
                f"At {size_label(nbytes)} the raw peer copy itself is only {ceiling:.3f}x NCCL ({raw:.1f} / "
                f"{nccl:.1f} GB/s), so ours / NCCL is not expected to reach {BANDWIDTH_VS_NCCL_TARGET}x on this "
                "machine: a copy engine's peer copy is the ceiling of this transport."
            )
    return out


def notes(plan: Plan, outcome: Outcome) -> list[str]:
    results = outcome.results
    out = []
    if not outcome.complete:
        out.append(f"INCOMPLETE RUN: {outcome.failure}. Values not measured show as n/a; their goals count as missed.")
    labels = {"fwd": "rank 0 -> 1", "bwd": "rank 1 -> 0 (echo)", "fwd0": "rank 0 -> 1, depth=0",
              "bwd0": "rank 1 -> 0 (echo), depth=0", "fwda": 'rank 0 -> 1, depth="auto"',
              "bwda": 'rank 1 -> 0 (echo), depth="auto"'}
    for direction, label in labels.items():
        transport = lookup(results, "setup", "rank0", f"transport_{direction}")
        if isinstance(transport, dict):
            reason = transport.get("fallback_reason")
            text = f"; fallback reason: {reason}" if reason else ""
            if transport.get("direct_unavailable_reason"):
                text += f"; every step through a slot: {transport['direct_unavailable_reason']}"
            if direction in ("fwd", "fwd0") and transport.get("batched_copies") is not None:  # rank 0 sends these
                text += f"; one batched copy per step: {'yes' if transport['batched_copies'] else 'no'}"
                if direction == "fwd0" and transport["batched_copies"]:
                    text += " (not from torch's default stream, where the driver refuses batches)"
            out.append(f"transport under test ({label}): backend {transport.get('backend')}{text}")
    setup = lookup(results, "setup", "rank0")
    if isinstance(setup, dict):
        out.append(
            f"software: torch {setup.get('torch')}, NCCL {setup.get('nccl')}, "
            f"cuda-bindings {setup.get('cuda_bindings')}; NCCL_NVLS_ENABLE={setup.get('nccl_nvls_enable')}"
        )
    out += [
        f"Each step moves two bf16 tensors (hidden and residual, {HIDDEN} wide): 8 MiB = a 256-token decode step, "
        "256 MiB = an 8k-token prefill. Data are fresh pseudo-random values, checked bit for bit on arrival.",
        "Bandwidth: the sender's stream is held by a GPU sleep while its host enqueues the whole loop, so the loop "
        "is queued ahead of the GPU (ours keeps at most depth = 2 steps in flight on the link; with depth=0 the "
        "sender copies straight into the receiver's persistent tensors, one step at a time); GB/s = (K - 1) "
        "steps / time between the arrival of step 1 and step K, from CUDA events on the receiver (raw: "
        "back-to-back cuMemcpyAsync into a CUDA-IPC-opened buffer, events on the sender); median of "
        f"{plan.bandwidth_reps} repeats.",
        "Latency: ping-pong between two transports (rank 0 -> 1 and back), both hosts enqueued ahead with rank 0 "
        "gated by a GPU sleep; one-way = round trip / 2 from CUDA events on rank 0; median of the repeats whose "
        "whole loop was queued before the gate opened. 'raw copy + flags' is the physical floor "
        "(cuMemcpyAsync then cuStreamWriteValue64 on the peer, cuStreamWaitValue64 on one's own flag).",
        "Latency runs twice: with the callers on torch's default stream (the legacy default stream) and with each "
        "rank on a created stream of its own ('own stream'); NCCL and the raw floor run both ways too. Either way "
        "a step of ours with depth >= 1 runs on the transport's relay stream, fenced to the caller's stream by "
        "events; depth=0 runs on the caller's stream. depth=\"auto\" (opt-in, not judged) sends each step straight "
        "into the receiver's persistent tensors (on the caller's stream) once the receiver's host has posted that "
        "recv(), else through one of 2 slots (on the relay), so the ping-pong mostly goes direct and the "
        "back-to-back bandwidth loop mostly through the slots.",
        "Host CPU: time.thread_time() around each call, mean over every timed step; NCCL send = one "
        "batch_isend_irecv of two isend, NCCL recv = one batch of two irecv plus work.wait().",
        "Reference (HARDWARE.md, same machine type): raw peer copy 384 / 392 GB/s at 64 / 256 MiB, NCCL 327 / 345; "
        "one-way at 8 MiB NCCL 45.4 us, raw copy + flags 31.7 us; GEMM slowdown 6.0% copy engines vs 8.4% NCCL; "
        "full-SM kernel 2.0x with a pending NCCL receive.",
    ]
    out += ceiling_notes(plan, results)
    out += quality_flags(plan, results)
    out += outcome.notes
    return out


# Plot ------------------------------------------------------------------------------


def draw(path: Path, plan: Plan, results: dict[Any, Any]) -> None:
    """Write the PNG: bandwidth vs payload, one-way latency, interference relative to alone."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(16, 4.8), layout="constrained")
    FigureCanvasAgg(figure)
    bw_axes, lat_axes, int_axes = figure.subplots(1, 3)
    sizes_mib = [nbytes / (1 << 20) for nbytes in plan.payloads]
    for method, marker in (("raw", "s"), ("nccl", "o"), ("ours", "^"), ("ours_depth0", "v"), ("ours_auto", "D")):
        values = [number(results, "bandwidth", method, nbytes, "gbps") for nbytes in plan.payloads]
        bw_axes.plot(sizes_mib, values, marker=marker, label=METHOD_NAMES[method])
    bw_axes.set_xscale("log", base=2)
    bw_axes.set_xticks(sizes_mib, [size_label(n) for n in plan.payloads], rotation=30)
    bw_axes.set_xlabel("payload per step (hidden + residual)")
    bw_axes.set_ylabel("sustained GB/s (higher is better)")
    bw_axes.set_title("Bandwidth, rank 0 -> rank 1")
    bw_axes.grid(True, alpha=0.3)
    bw_axes.legend()

    _grouped_bars(
        lat_axes,
        [size_label(n) for n in plan.latency_payloads],
        {METHOD_NAMES[m]: [number(results, "latency", m, n, "one_way_us") for n in plan.latency_payloads]
         for m in (*LATENCY_METHODS, *(m + OWN_STREAM for m in LATENCY_METHODS))},
    )  # fmt: skip
    lat_axes.set_ylabel("one-way GPU latency, us (lower is better)")
    lat_axes.set_title("Ping-pong latency")

    labels = ["GEMM on sender", "full-SM kernel,\nreceive pending"]
    bars = {}
    for method in ("nccl", "ours"):
        bars[METHOD_NAMES[method]] = [
            ratio(number(results, "gemm", method, "ms_per_gemm"), number(results, "gemm", "alone", "ms_per_gemm")),
            number(results, "pending", method, "ratio"),
        ]
    _grouped_bars(int_axes, labels, bars)
    int_axes.axhline(1.0, color="gray", linewidth=1)
    int_axes.set_ylabel("time relative to alone (lower is better)")
    int_axes.set_title("Interference")
    figure.suptitle("syncless bench pp" + (" (quick run)" if plan.quick else ""))
    figure.savefig(path, dpi=110)


def _grouped_bars(axes: Any, groups: list[str], series: dict[str, list[float]]) -> None:
    width = 0.8 / max(1, len(series))
    for index, (name, values) in enumerate(series.items()):
        positions = [g + (index - (len(series) - 1) / 2) * width for g in range(len(groups))]
        heights = [v if math.isfinite(v) else 0.0 for v in values]
        container = axes.bar(positions, heights, width, label=name)
        axes.bar_label(container, labels=[f"{v:.3g}" if math.isfinite(v) else "n/a" for v in values], fontsize=8)
    finite = [v for values in series.values() for v in values if math.isfinite(v)]
    axes.set_ylim(0.0, max(finite, default=1.0) * 1.3)  # headroom for the labels and the legend
    axes.set_xticks(range(len(groups)), groups)
    axes.grid(True, axis="y", alpha=0.3)
    axes.legend(loc="upper left", fontsize=8)


# Assembly --------------------------------------------------------------------------


def build_output(plan: Plan, outcome: Outcome) -> BenchOutput:
    """Assemble the ``pp`` :class:`BenchOutput` from what the workers delivered."""
    results = outcome.results
    quick = " (quick run: not for quoting)" if plan.quick else ""
    return BenchOutput(
        name="pp",
        title="Pipeline-parallel transport: ours vs NCCL vs raw peer copy" + quick,
        data={
            "plan": plan.as_dict(),
            "complete": outcome.complete,
            "failure": outcome.failure,
            "errors": {str(rank): text for rank, text in outcome.errors.items()},
            "results": results,
        },
        tables=[
            ("Sustained bandwidth, rank 0 -> rank 1 (GB/s)", BANDWIDTH_COLUMNS, bandwidth_rows(plan, results)),
            ("One-way GPU latency, ping-pong (us)", LATENCY_COLUMNS, latency_rows(plan, results)),
            ("Interference (ms; lower is better)", INTERFERENCE_COLUMNS, interference_rows(plan, results)),
            ("Host CPU time per call (us, thread time, mean)", HOST_CPU_COLUMNS, host_cpu_rows(plan, results)),
        ],
        goals=goals(plan, results),
        plot=lambda path: draw(path, plan, results),
        notes=notes(plan, outcome),
    )
