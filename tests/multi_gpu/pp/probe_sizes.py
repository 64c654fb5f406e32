"""Probe for issue 18: which copy-engine mechanism wins at which step size, on two NVLink GPUs.

Run it once, from the repository root of a machine with two NVLink-connected GPUs::

    PYTHONPATH=src python3 tests/multi_gpu/pp/probe_sizes.py --json /tmp/probe-sizes.json
    PYTHONPATH=src python3 tests/multi_gpu/pp/probe_sizes.py --list    # the plan only: no GPU, no torch.cuda

Two processes, one per GPU (``syncless._core.launch.run_ranks``, NVLink multicast off). Rank 0
sends on the forward link (0 -> 1), rank 1 echoes on the backward link (1 -> 0). Every mechanism
moves one pipeline step: two bf16 tensors (hidden, residual) of 8192 columns, as ``syncless bench
pp`` does. For each step size it measures

* one-way latency: ping-pong, round trip / 2, from CUDA events on rank 0, rank 0's stream held by
  a GPU sleep while both hosts enqueue the whole loop (so the GPUs, not the hosts, set the pace);
* sustained bandwidth: many back-to-back steps 0 -> 1, from CUDA events on the receiver between
  the first and the last step's arrival (the raw copies: on the sender), the sender gated alike;

for NCCL, the raw peer copy, the transport as it is (``make_transport`` with depth 2, 0 and 8),
and candidate mechanisms built here from the driver calls the transport uses (stream memory
operations on 64-bit flags, ``cuMemcpyAsync``/``cuMemcpyBatchAsync`` over CUDA IPC mappings).
Then a ping-pong with a tiny kernel before every send (a real stage computes before it sends),
the legacy-default-stream rows, and single-GPU op-chain costs that say where a step's time goes.

Checks: every loop sends fresh pseudo-random data (new seeds per measurement, two to four
different sources in turn), the receiving side's destination is poisoned before every timed
repeat, and the last step that landed is compared bit for bit; each bandwidth row then runs a
short checked pass in which the receiver copies every step out as soon as it landed (the reader a
real stage would be) and every step is compared. A mismatch prints ``DATA MISMATCH`` and makes the
exit status 4.

Limits: each GPU phase has a hard timeout (``--phase-timeout-s``, default 15 s: a stream waiting
on a flag that never comes becomes an error, not a hang); the whole run is killed after
``--hard-timeout-s`` (default 230 s) with exit status 3; after ``--budget-s`` (default 170 s) the
remaining rows are skipped (listed as skipped). Expected runtime on 2 x H200: 1 to 1.5 minutes.

Each row, what it answers, and which design each outcome picks: ``docs/pp-sizes-probe.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from syncless.bench._pp_plan import (
    BANDWIDTH_VS_RAW_TARGET,
    GOAL_SPLIT_NBYTES,
    HIDDEN,
    KIB,
    LATENCY_VS_NCCL_SMALL_TARGET,
    LATENCY_VS_NCCL_TARGET,
    MIB,
    ROW_NBYTES,
    TENSOR_NAMES,
    rows_for,
    size_label,
)

# -- plan (plain Python, unit-tested on the CPU) -----------------------------------------------

DEFAULT_SIZES = (64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 8 * MIB, 64 * MIB, 256 * MIB)
#: sizes of the legacy-stream, kernel-before-send and op-chain rows
FOCUS_SIZES = (64 * KIB, 1 * MIB, 8 * MIB)
SPLIT_MIN_NBYTES = 1 * MIB
#: issue 18's goals, the ones `syncless bench pp` states: latency <= 1.0x NCCL everywhere, <= 0.8x from
#: 1 MiB; bandwidth >= NCCL everywhere, >= 0.9x the raw peer copy from 1 MiB
STRICT_FROM_NBYTES = GOAL_SPLIT_NBYTES
LATENCY_VS_NCCL = LATENCY_VS_NCCL_SMALL_TARGET
LATENCY_VS_NCCL_STRICT = LATENCY_VS_NCCL_TARGET
BANDWIDTH_VS_RAW_STRICT = BANDWIDTH_VS_RAW_TARGET
SECTIONS = ("lat", "bw", "legacy", "kernel", "chain")
MAX_GATE_MS = 1500.0

# Each rank's one IPC-shared allocation: [flags | sources | slots | destination A | destination B].
FLAGS_NBYTES = 2 * MIB  # 128 blocks of 64 words of 64 bits in the first 64 KiB; data starts page-aligned
BLOCK_NBYTES = 512
SCRATCH_BLOCK = 127  # op-chain scratch words (written remotely, never waited on) and join words
SRC_NBYTES = 512 * MIB
SLOTS_NBYTES = 1024 * MIB
HALF_MAX_NBYTES = 128 * MIB
OFF_SRC = FLAGS_NBYTES
OFF_SLOTS = OFF_SRC + SRC_NBYTES
OFF_DST_A = OFF_SLOTS + SLOTS_NBYTES
OFF_DST_B = OFF_DST_A + HALF_MAX_NBYTES
REGION_NBYTES = OFF_DST_B + HALF_MAX_NBYTES
MAX_NBYTES = 2 * HALF_MAX_NBYTES

# Words of a link's flag block. A flag lives on the GPU that waits on it; the other GPU writes it.
W_FULL = 0  # [0, 16) receiver's: slot s holds step N (the value is N)
W_SPLIT = 16  # [16, 24) receiver's: chunk k of step N landed in the destination
W_EMPTY = 32  # sender's: every slot step <= N was copied out (or pulled)
W_READY = 33  # sender's: the receiver's stream reached recv(N): the destination is free for step N
W_DONE = 34  # sender's: the receiver pulled step N
W_POSTED = 35  # sender's (observer): the receiver's stream reached recv(N)
W_AVAIL = 36  # receiver's: step N can be pulled from the sender's tensors
MAX_SLOTS = 16

#: name -> (slots per link, what it is). "raw" mechanisms are built in this file from driver calls.
MECHANISMS: dict[str, tuple[int, str]] = {
    "nccl": (0, "torch.distributed NCCL, one batch_isend_irecv of the two tensors per step"),
    "raw": (0, "bandwidth reference: back-to-back cuMemcpyAsync of the whole step into the peer, one stream, no flag"),
    "raw_alt2": (0, "raw, steps alternating over two streams (two copies in flight), no flag"),
    "raw_split2": (0, "raw, each step split in two halves copied at once on two streams (latency: + one flag each)"),
    "raw_flags": (0, "latency floor: one copy, then cuStreamWriteValue64 on the peer's flag; peer waits on it"),
    "ours_d2": (2, "syncless.pp make_transport, default depth=2 (slots, relay stream, copy-out)"),
    "ours_d0": (0, "syncless.pp make_transport, depth=0 (straight into alloc_persistent tensors)"),
    "ours_d8": (8, "syncless.pp make_transport, depth=8 (same protocol, more slots; steps <= 8 MiB)"),
    "direct": (0, "receiver writes ready=N into the sender, sender waits, copies into the destination, writes full"),
    "direct_relay": (0, "direct, sender's wait+copy+flag on a relay stream fenced by events (legacy-stream callers)"),
    "direct_split2": (0, "direct, copy split over the caller's stream and a relay stream, one flag each"),
    "direct_obs": (0, "direct + observer: how long did the sender's stream wait for the receiver to post recv(N)?"),
    "slot2": (2, "slots: 2, copies on the caller's stream (today's depth=2 without its relay and Python)"),
    "slot8": (8, "slots: 8, copies on the caller's stream"),
    "slot8_k2": (8, "slots: 8, steps alternate over 2 relay streams; per-slot flag carries N; fence before flag"),
    "slot8_k4": (8, "slot8_k2 with 4 relay streams"),
    "slot8_k2_b4": (8, "slot8_k2, the receiver frees slots with one flag write every 4 steps"),
    "slot8_k2_obs": (8, "slot8_k2 + observer: did the receiver post recv(N) before the sender's data was ready?"),
    "pull": (0, "receiver pulls from the sender's tensors (sender writes avail=N, then waits done=N)"),
    "pull_staged8": (8, "sender stages into 8 outbox slots (local copy), receiver pulls into its destination"),
}
MECH_ORDER = tuple(MECHANISMS)
#: physical references, not transports: never a "winner"
BASELINES = ("nccl", "raw", "raw_alt2", "raw_split2", "raw_flags")

LAT_OWN = ("nccl", "raw_flags", "ours_d0", "ours_d2", "direct", "direct_obs", "slot2", "slot8_k2", "slot8_k2_obs",
           "pull", "pull_staged8")
LAT_DEF = ("nccl", "ours_d0", "ours_d2")
LAT_DEF_FOCUS = ("direct", "direct_relay")
BW_REF = ("raw", "raw_alt2", "raw_split2")
BW_DEF = ("nccl", "ours_d2", "ours_d0", "ours_d8")
BW_OWN = ("ours_d2", "direct", "direct_obs", "direct_split2", "slot2", "slot8", "slot8_k2", "slot8_k4", "slot8_k2_b4",
          "slot8_k2_obs", "pull", "pull_staged8")
SPLIT_METHODS = ("raw_split2", "direct_split2")
KERNEL_METHODS = ("nccl", "raw_flags", "ours_d0", "ours_d2", "direct", "slot2")
CHAIN_ROWS: dict[str, str] = {
    "copy": "peer copy (batch of the two tensors)",
    "copy_w64": "peer copy + remote write64",
    "copy_w32": "peer copy + remote write32",
    "wait_copy_w64": "wait(already met) + peer copy + remote write64",
    "copy_ev_w64": "peer copy + event record + remote write64",
    "alt2_copy_w64": "steps alternating on 2 streams: peer copy + remote write64",
    "alt4_copy_w64": "steps alternating on 4 streams: peer copy + remote write64",
    "copyout": "copy-out step: wait(met) + local copy + remote write64",
    "w64": "remote write64 alone",
    "pull": "pull copy (this GPU's engine reads the peer)",
    "local_copy": "local copy then peer copy (engine switch)",
    "kernel": "tiny kernel alone",
    "kernel_copy": "tiny kernel then peer copy, one stream",
    "kernel_ev_copy": "tiny kernel; peer copy on a relay joined by events",
    "kernel_flag_copy": "tiny kernel; peer copy on a relay joined by flags (write/wait)",
}


def parse_size(text: str) -> int:
    """Return the bytes of ``"64K"``, ``"1M"``, ``"256MiB"`` or ``"65536"``.

    Raises:
        ValueError: unreadable, not a positive multiple of one 32 KiB token row, or above 256 MiB.
    """
    cleaned = text.strip().upper().removesuffix("IB").removesuffix("B")
    units = {"K": KIB, "M": MIB}
    unit = units.get(cleaned[-1:], 1)
    number = cleaned[:-1] if cleaned[-1:] in units else cleaned
    try:
        value = int(number) * unit
    except ValueError:
        raise ValueError(f"--sizes: cannot read {text!r} as a size; write e.g. 64K, 1M or 256M") from None
    if value <= 0 or value % ROW_NBYTES:
        raise ValueError(f"--sizes: {text!r} is {value} bytes; a step must be a positive multiple of "
                         f"{ROW_NBYTES} bytes (one token row of two bf16 tensors of {HIDDEN} columns)")
    if value > MAX_NBYTES:
        raise ValueError(f"--sizes: {text!r} is above the probe's largest step, {size_label(MAX_NBYTES)}")
    return value


@dataclass(frozen=True)
class Config:
    """What one run measures, and its limits (identical in the parent and both ranks)."""

    sizes: tuple[int, ...] = DEFAULT_SIZES
    sections: tuple[str, ...] = SECTIONS
    methods: tuple[str, ...] | None = None  # None: every mechanism
    quick: bool = False
    budget_s: float = 170.0
    phase_timeout_s: float = 15.0
    hard_timeout_s: float = 230.0
    json_path: str | None = None


def parse_args(argv: list[str]) -> tuple[Config, bool]:
    """Return the run's :class:`Config` and whether only the plan is to be listed.

    Raises:
        SystemExit: bad arguments (argparse prints the message).
    """
    parser = argparse.ArgumentParser(prog="probe_sizes.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(size_label(n).replace(" ", "").removesuffix("iB")
                                                    for n in DEFAULT_SIZES),
                        help="comma-separated step sizes (default %(default)s)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, of %(default)s")
    parser.add_argument("--methods", default=None, help="only these mechanisms (comma-separated); default all")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run, not for quoting)")
    parser.add_argument("--budget-s", type=float, default=170.0, help="skip the rows left after this long")
    parser.add_argument("--phase-timeout-s", type=float, default=15.0, help="longest wait for one GPU phase")
    parser.add_argument("--hard-timeout-s", type=float, default=230.0, help="kill both ranks after this long")
    parser.add_argument("--json", dest="json_path", default=None, help="also write every result here")
    parser.add_argument("--list", action="store_true", help="print the plan and exit (no GPU needed)")
    args = parser.parse_args(argv)
    try:
        sizes = tuple(sorted({parse_size(part) for part in args.sizes.split(",") if part.strip()}))
    except ValueError as err:
        parser.error(str(err))
    sections = tuple(part.strip() for part in args.sections.split(",") if part.strip())
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        parser.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")
    methods = None
    if args.methods:
        methods = tuple(part.strip() for part in args.methods.split(",") if part.strip())
        bad = [m for m in methods if m not in MECHANISMS]
        if bad:
            parser.error(f"--methods: unknown {bad}; choose from {', '.join(MECH_ORDER)}")
    if not sizes:
        parser.error("--sizes: give at least one size")
    for name in ("budget_s", "phase_timeout_s", "hard_timeout_s"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0; got {getattr(args, name)}")
    config = Config(sizes, sections, methods, args.quick, args.budget_s, args.phase_timeout_s,
                    args.hard_timeout_s, args.json_path)
    return config, args.list


@dataclass(frozen=True)
class Row:
    """One measurement.

    Attributes:
        section: ``lat`` (ping-pong), ``bw`` (sustained bandwidth) or ``chain`` (single-GPU op chain).
        method: a :data:`MECHANISMS` name (``chain``: a :data:`CHAIN_ROWS` name).
        mode: ``own`` (each rank on a created stream) or ``def`` (torch's default, the legacy stream).
        nbytes: the step size.
        kernel: ping-pong with a tiny kernel before every send.
    """

    section: str
    method: str
    mode: str
    nbytes: int
    kernel: bool = False

    @property
    def key(self) -> str:
        return f"{self.section}{'+k' if self.kernel else ''}|{self.method}|{self.mode}|{self.nbytes}"

    def label(self) -> str:
        what = "lat+kernel" if self.kernel else self.section
        return f"{what:10s} {self.mode:3s} {size_label(self.nbytes):8s} {self.method}"


def fits(method: str, nbytes: int) -> bool:
    """Whether ``method`` can run a step of ``nbytes`` in this probe's buffers."""
    if method in SPLIT_METHODS and nbytes < SPLIT_MIN_NBYTES:
        return False
    if method == "ours_d8":
        return nbytes <= 8 * MIB
    slots = MECHANISMS[method][0] if method in MECHANISMS else 0
    return slots * nbytes <= SLOTS_NBYTES and nbytes <= MAX_NBYTES


def build_plan(config: Config) -> list[Row]:
    """Return every row in the order it runs: most decisive first, the op chains last."""
    rows: list[Row] = []

    def add(section: str, methods: tuple[str, ...], mode: str, sizes: tuple[int, ...], kernel: bool = False) -> None:
        for nbytes in sizes:
            for method in methods:
                if config.methods is not None and method not in config.methods:
                    continue
                if fits(method, nbytes):
                    rows.append(Row(section, method, mode, nbytes, kernel))

    focus = tuple(n for n in config.sizes if n in FOCUS_SIZES)
    if "lat" in config.sections:
        add("lat", LAT_OWN + SPLIT_METHODS, "own", config.sizes)
    if "bw" in config.sections:
        for nbytes in config.sizes:  # per size: the references first, then NCCL and ours as the bench runs them
            add("bw", BW_REF, "own", (nbytes,))
            add("bw", BW_DEF, "def", (nbytes,))
            add("bw", BW_OWN, "own", (nbytes,))
    if "legacy" in config.sections:
        add("lat", LAT_DEF, "def", config.sizes)
        add("lat", LAT_DEF_FOCUS, "def", focus)
    if "kernel" in config.sections:
        add("lat", KERNEL_METHODS, "own", focus, kernel=True)
    if "chain" in config.sections:
        for nbytes in focus:
            rows.extend(Row("chain", name, "own", nbytes) for name in CHAIN_ROWS)
    return rows


def source_count(nbytes: int) -> int:
    """How many different sources a loop cycles through (2 to 4, as the source region allows)."""
    return max(2, min(4, SRC_NBYTES // nbytes))


def source_offsets(index: int, nbytes: int) -> tuple[int, int, int]:
    """Return ``(offset of tensor A, offset of tensor B, bytes of each)`` of source ``index``."""
    start = OFF_SRC + index * nbytes
    return start, start + nbytes // 2, nbytes // 2


def latency_iters(nbytes: int, quick: bool) -> int:
    """Round trips per timed ping-pong repeat."""
    base = 40 if nbytes <= MIB else 20 if nbytes <= 8 * MIB else 8 if nbytes <= 64 * MIB else 4
    return max(2, base // 2) if quick else base


def bandwidth_steps(nbytes: int, quick: bool) -> int:
    """Steps per timed bandwidth repeat (about 1 GiB, 16 to 80 steps)."""
    low, high = (8, 40) if quick else (16, 80)
    return max(low, min(high, math.ceil((1 << 30) / nbytes)))


def checked_steps(nbytes: int) -> int:
    """Steps of a bandwidth row's checked pass (every step compared; the logs take at most 512 MiB)."""
    return max(2, min(8, SRC_NBYTES // nbytes))


def repeats(quick: bool) -> int:
    """Timed repeats per row (the median of those whose hosts were ahead is reported)."""
    return 2 if quick else 5


def gate_ms(host_s_per_iter: float, count: int) -> float:
    """A GPU sleep long enough for the slower host to enqueue ``count`` iterations twice over."""
    return min(MAX_GATE_MS, 1.0 + 2.0 * host_s_per_iter * 1e3 * count)


def split_copies(copies: list[tuple[int, int, int]], parts: int) -> list[list[tuple[int, int, int]]]:
    """Cut every ``(dst, src, nbytes)`` copy into ``parts`` pieces on 256-byte boundaries; one list per part."""
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(parts)]
    for dst, src, nbytes in copies:
        piece = nbytes // parts // 256 * 256
        start = 0
        for k in range(parts):
            size = nbytes - start if k == parts - 1 else piece
            if size:
                out[k].append((dst + start, src + start, size))
            start += size
    return out


def meets_latency(nbytes: int, us: float, nccl_us: float) -> bool:
    """Issue 18's latency goal: <= 1.0x NCCL, and <= 0.8x from 1 MiB (False when a value is missing)."""
    limit = LATENCY_VS_NCCL_STRICT if nbytes >= STRICT_FROM_NBYTES else LATENCY_VS_NCCL
    return bool(us <= limit * nccl_us)


def meets_bandwidth(nbytes: int, gbps: float, nccl_gbps: float, raw_gbps: float) -> bool:
    """Issue 18's bandwidth goal: >= NCCL, and >= 0.9x the raw peer copy from 1 MiB."""
    ok = gbps >= nccl_gbps
    if nbytes >= STRICT_FROM_NBYTES:
        ok = ok and gbps >= BANDWIDTH_VS_RAW_STRICT * raw_gbps
    return bool(ok)


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def observer_figures(deltas_us: list[float]) -> dict[str, float]:
    """Summarize the observer's (posted - ready) values: share negative, median, 10th and 90th percentile."""
    if not deltas_us:
        return {}
    ordered = sorted(deltas_us)

    def at(fraction: float) -> float:
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]

    return {"posted_first": sum(d < 0 for d in ordered) / len(ordered), "posted_minus_ready_us": median(ordered),
            "posted_minus_ready_p10_us": at(0.1), "posted_minus_ready_p90_us": at(0.9)}


# -- summary (plain Python) ---------------------------------------------------------------------


def _value(results: dict[str, dict[str, Any]], key: str) -> float:
    record = results.get(key)
    return float(record["value"]) if record and record.get("value") is not None else float("nan")


def _good(results: dict[str, dict[str, Any]], key: str) -> bool:
    record = results.get(key)
    return bool(record) and record.get("data_ok") is True and not math.isnan(_value(results, key))


def _table(title: str, header: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = ["", title, "  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in body]
    return lines


def summarize(results: dict[str, dict[str, Any]], sizes: tuple[int, ...]) -> list[str]:
    """Return the summary tables and the per-size verdict, as lines of text."""
    lines: list[str] = []
    header = ["method", *(size_label(n) for n in sizes)]

    def latency_table(section: str, mode: str, title: str) -> None:
        methods = [m for m in MECH_ORDER if any(f"{section}|{m}|{mode}|{n}" in results for n in sizes)]
        if not methods:
            return
        body = []
        for method in methods:
            cells = [method]
            for nbytes in sizes:
                key = f"{section}|{method}|{mode}|{nbytes}"
                us, nccl = _value(results, key), _value(results, f"{section}|nccl|{mode}|{nbytes}")
                if key not in results or math.isnan(us):
                    cells.append("-")
                    continue
                mark = "" if _good(results, key) else " BAD"
                if method not in BASELINES and meets_latency(nbytes, us, nccl):
                    mark += " ok"
                cells.append(f"{us:.1f} {us / nccl:.2f}x{mark}" if not math.isnan(nccl) else f"{us:.1f}{mark}")
            body.append(cells)
        lines.extend(_table(title, header, body))

    latency_table("lat", "own", "One-way latency, us (x NCCL on the same streams; ok = meets the goal), created streams")
    latency_table("lat", "def", "One-way latency, us, torch's default (legacy) stream")
    latency_table("lat+k", "own", "One-way latency with a tiny kernel before every send, us, created streams")

    methods = [m for m in MECH_ORDER if any(f"bw|{m}|{mode}|{n}" in results for n in sizes for mode in ("own", "def"))]
    body = []
    for method in methods:
        for mode in ("def", "own"):
            if not any(f"bw|{method}|{mode}|{n}" in results for n in sizes):
                continue
            cells = [f"{method} ({mode})"]
            for nbytes in sizes:
                key = f"bw|{method}|{mode}|{nbytes}"
                gbps = _value(results, key)
                raw, nccl = _value(results, f"bw|raw|own|{nbytes}"), _value(results, f"bw|nccl|def|{nbytes}")
                if key not in results or math.isnan(gbps):
                    cells.append("-")
                    continue
                mark = "" if _good(results, key) else " BAD"
                if method not in BASELINES and meets_bandwidth(nbytes, gbps, nccl, raw):
                    mark += " ok"
                cells.append(f"{gbps:.1f} {gbps / raw:.2f}xraw{mark}" if not math.isnan(raw) else f"{gbps:.1f}{mark}")
            body.append(cells)
    if body:
        lines.extend(_table("Sustained bandwidth 0 -> 1, GB/s (x raw peer copy; ok = meets the goal)", header, body))

    host_body = []
    for method in methods:
        for mode in ("def", "own"):
            cells, seen = [f"{method} ({mode})"], False
            for nbytes in sizes:
                record = results.get(f"bw|{method}|{mode}|{nbytes}") or {}
                send, recv = record.get("host_send_us"), record.get("host_recv_us")
                seen = seen or send is not None
                cells.append(f"{send:.0f}/{recv:.0f}" if send is not None and recv is not None else "-")
            if seen:
                host_body.append(cells)
    if host_body:
        lines.extend(_table("Host CPU per call while streaming, us (send/recv, thread time)", header, host_body))

    chain_sizes = [n for n in sizes if any(f"chain|{c}|own|{n}" in results for c in CHAIN_ROWS)]
    if chain_sizes:
        body = []
        for name, what in CHAIN_ROWS.items():
            cells = [what]
            for nbytes in chain_sizes:
                key = f"chain|{name}|own|{nbytes}"
                value = _value(results, key)
                mark = "" if key not in results or results[key].get("data_ok") in (True, None) else " BAD"
                cells.append(f"{value:.2f}{mark}" if not math.isnan(value) else "-")
            body.append(cells)
        lines.extend(_table("Op chains on one GPU (rank 0), us per iteration",
                            ["chain", *(size_label(n) for n in chain_sizes)], body))

    observed = [(key, record) for key, record in results.items() if "posted_first" in record]
    if observed:
        lines.append("")
        lines.append("Observer (*_obs rows): share of steps whose recv() was posted before the sender's data was "
                     "ready, and (posted - ready) in us, median [10th, 90th percentile]; negative = the receiver "
                     "was waiting")
        for key, record in observed:
            lines.append(f"  {key:40s} posted first {record['posted_first']:.0%}, "
                         f"median {record['posted_minus_ready_us']:+.1f} us "
                         f"[{record['posted_minus_ready_p10_us']:+.1f}, {record['posted_minus_ready_p90_us']:+.1f}]")
    lines.extend(verdict(results, sizes))
    return lines


def verdict(results: dict[str, dict[str, Any]], sizes: tuple[int, ...]) -> list[str]:
    """Per size: the goals, which candidates meet them, and which single candidate meets both."""
    lines = ["", "Verdict per size (candidates only; NCCL and raw are the references)"]
    for nbytes in sizes:
        nccl_us = _value(results, f"lat|nccl|own|{nbytes}")
        nccl_bw, raw_bw = _value(results, f"bw|nccl|def|{nbytes}"), _value(results, f"bw|raw|own|{nbytes}")
        limit = LATENCY_VS_NCCL_STRICT if nbytes >= STRICT_FROM_NBYTES else LATENCY_VS_NCCL
        floor = max(nccl_bw, BANDWIDTH_VS_RAW_STRICT * raw_bw if nbytes >= STRICT_FROM_NBYTES else 0.0)
        lat_ok = {m: _value(results, f"lat|{m}|own|{nbytes}") for m in MECH_ORDER if m not in BASELINES
                  and _good(results, f"lat|{m}|own|{nbytes}")
                  and meets_latency(nbytes, _value(results, f"lat|{m}|own|{nbytes}"), nccl_us)}
        bw_ok: dict[str, float] = {}
        for method in MECH_ORDER:
            for mode in ("def", "own"):
                key = f"bw|{method}|{mode}|{nbytes}"
                if method not in BASELINES and _good(results, key) and meets_bandwidth(
                        nbytes, _value(results, key), nccl_bw, raw_bw):
                    bw_ok[method] = max(bw_ok.get(method, 0.0), _value(results, key))
        both = sorted(set(lat_ok) & set(bw_ok))
        lat_text = ", ".join(f"{m} {v:.1f}" for m, v in sorted(lat_ok.items(), key=lambda kv: kv[1])) or "none"
        bw_text = ", ".join(f"{m} {v:.1f}" for m, v in sorted(bw_ok.items(), key=lambda kv: -kv[1])) or "none"
        lines.append(f"- {size_label(nbytes)}: latency <= {limit * nccl_us:.1f} us met by: {lat_text}")
        lines.append(f"  {' ' * len(size_label(nbytes))}  bandwidth >= {floor:.1f} GB/s met by: {bw_text}")
        pad = " " * len(size_label(nbytes))
        lines.append(f"  {pad}  one mechanism for both: {', '.join(both) or 'none'}")
        # The proposed default (docs/pp-sizes-probe.md): direct while the receiver waits, slots while the sender
        # is ahead; it meets both goals when a direct row meets latency and a direct or slot row meets bandwidth.
        direct_lat = [m for m in lat_ok if m.startswith("direct")]
        switch_bw = [m for m in bw_ok if m.startswith(("direct", "slot"))]
        adaptive = f"yes ({direct_lat[0]} + {switch_bw[0]})" if direct_lat and switch_bw else "no"
        lines.append(f"  {pad}  adaptive switch (direct while the receiver waits, else slots) meets both: {adaptive}")
    return lines


# -- GPU part: everything below runs in the two ranks ---------------------------------------------


def _gpu_modules() -> tuple[Any, Any, Any]:
    import torch
    import torch.distributed as dist

    from syncless.pp import _driver as drv

    return torch, dist, drv


class Rank:
    """This rank's GPU, its shared allocation (and the peer's, mapped), streams and gloo helpers."""

    def __init__(self, rank: int, config: Config):
        from datetime import timedelta

        from syncless.bench._pp_cuda import Gate, bind_primary_context

        torch, dist, drv = _gpu_modules()
        self.rank, self.config = rank, config
        self.device = torch.device("cuda", rank)
        torch.cuda.set_device(self.device)
        torch.empty(1, device=self.device)
        self.context = bind_primary_context(rank)
        self.cpu = dist.new_group([0, 1], backend="gloo", timeout=timedelta(seconds=60))
        self.nccl = dist.new_group([0, 1], backend="nccl", timeout=timedelta(seconds=60))  # as the bench does
        self.gate = Gate()
        self.base = drv.mem_alloc(REGION_NBYTES)
        drv.mem_zero(self.base, FLAGS_NBYTES, 0)  # every flag reads 0 before the peer can see the handle
        torch.cuda.synchronize(self.device)
        handles = self.gather(drv.ipc_handle(self.base))
        self.peer = drv.ipc_open(handles[1 - rank])
        self.own = torch.cuda.ExternalStream(drv.stream_create(), device=self.device)
        # Batched copies where the driver takes them, tried as the transport does: 16 bytes of zeros
        # into zeros of the peer's scratch block that nobody reads (blocks until the stream is idle).
        scratch = SCRATCH_BLOCK * BLOCK_NBYTES
        self.batch_problem = drv.batch_copy_problem(self.base + scratch + 256, self.peer + scratch + 384,
                                                    self.own.cuda_stream)
        self.hot = drv.Hot(batch=self.batch_problem is None)
        self.legacy = torch.cuda.default_stream(self.device)
        self.relays = [torch.cuda.ExternalStream(drv.stream_create(), device=self.device) for _ in range(4)]
        self.side = torch.cuda.ExternalStream(drv.stream_create(), device=self.device)
        self.cur = self.own
        self.fence_event = torch.cuda.Event()
        self.scratch = torch.zeros(256, device=self.device)
        self.seed = 0
        self.join = 0
        self.ours: dict[tuple[str, str], tuple[Any, Any]] = {}
        self.links: dict[str, tuple[Any, Any]] = {}
        self.barrier()

    # gloo helpers (block the host, touch no stream)
    def barrier(self) -> None:
        _, dist, _ = _gpu_modules()
        dist.barrier(group=self.cpu)

    def gather(self, value: Any) -> list[Any]:
        _, dist, _ = _gpu_modules()
        out: list[Any] = [None, None]
        dist.all_gather_object(out, value, group=self.cpu)
        return out

    def share(self, value: Any) -> Any:
        _, dist, _ = _gpu_modules()
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.cpu)
        return box[0]

    def sync(self, what: str) -> None:
        """Wait for this GPU, at most the phase timeout (a stuck flag wait raises instead of hanging)."""
        from syncless.bench._pp_cuda import sync_device

        sync_device(self.device, self.config.phase_timeout_s, what)

    # stream helpers (enqueue only)
    def fence(self, before: Any, after: Any) -> None:
        """Make stream ``after`` wait for everything queued on ``before`` so far (one event, re-recorded)."""
        self.fence_event.record(before)
        after.wait_event(self.fence_event)

    def tick(self) -> None:
        """A tiny kernel on the current stream (what a stage computes before it sends, in miniature)."""
        self.scratch.add_(1)

    def next_seeds(self, count: int) -> list[int]:
        self.seed += 1
        return [1000 + 16 * self.seed + i for i in range(count)]

    def fill(self, offsets: tuple[int, int, int], payload: dict[str, Any]) -> None:
        """Copy a payload's two tensors to ``offsets`` in this rank's allocation, on the current stream."""
        off_a, off_b, half = offsets
        self.hot.memcpy(self.base + off_a, payload["hidden"].data_ptr(), half, self.cur.cuda_stream)
        self.hot.memcpy(self.base + off_b, payload["residual"].data_ptr(), half, self.cur.cuda_stream)

    def poison(self, offsets: tuple[int, int, int]) -> None:
        _, _, drv = _gpu_modules()
        off_a, off_b, half = offsets
        drv.mem_fill_bytes(self.base + off_a, 0xFF, half, self.cur.cuda_stream)
        drv.mem_fill_bytes(self.base + off_b, 0xFF, half, self.cur.cuda_stream)

    def snapshot(self, offsets: tuple[int, int, int]) -> dict[str, Any]:
        """Copy the two tensors at ``offsets`` out, on the current stream (ordered after what landed)."""
        torch, _, _ = _gpu_modules()
        off_a, off_b, half = offsets
        out = {name: torch.empty(half, dtype=torch.uint8, device=self.device) for name in TENSOR_NAMES}
        self.hot.memcpy(out["hidden"].data_ptr(), self.base + off_a, half, self.cur.cuda_stream)
        self.hot.memcpy(out["residual"].data_ptr(), self.base + off_b, half, self.cur.cuda_stream)
        return out

    def close(self) -> None:
        _, _, drv = _gpu_modules()
        self.sync("tear-down")
        for transport, _ in self.ours.values():
            transport.close()
        drv.ipc_close(self.peer)
        self.barrier()  # both mappings are closed before either allocation is freed
        drv.mem_free(self.base)


def as_bytes(tensor: Any) -> Any:
    torch, _, _ = _gpu_modules()
    return tensor.contiguous().view(torch.uint8).reshape(-1)


def matches(landed: dict[str, Any], expected: dict[str, Any]) -> bool:
    """Bit-for-bit comparison of two payloads (raw bytes or bf16 tensors); synchronizes the host."""
    torch, _, _ = _gpu_modules()
    return all(torch.equal(as_bytes(landed[name]), as_bytes(expected[name])) for name in TENSOR_NAMES)


# -- links: one direction of one mechanism, as this rank sees it ------------------------------------


class RawLink:
    """A mechanism built here: payloads are ``(offset A, offset B, bytes each)`` in the owner's allocation.

    Each end counts steps; both ranks make the same calls in the same order, so the counts agree
    and every flag only grows over the whole run (no flag is ever reset).
    """

    kind = "raw"

    def __init__(self, rk: Rank, name: str, direction: int, observe: bool = False):
        self.rk, self.name = rk, name
        self.block = 2 * MECH_ORDER.index(name) + direction
        self.step = 0
        self.observe = observe
        self.observed: list[tuple[Any, Any]] = []
        self.pool: list[Any] = []

    def start_observing(self) -> None:
        """From the next send on, time every step's "receiver posted" against "sender ready" (sender only)."""
        torch, _, _ = _gpu_modules()
        if not self.pool:
            self.pool = [torch.cuda.Event(enable_timing=True) for _ in range(2 * 256)]
        self.observed = []

    def observe_step(self, word: int) -> None:
        """At send() entry: record "ready" on the caller's stream; on the side stream, when ``word`` (written
        by the receiver at recv() entry) reaches this step, record "posted". Holds no SM; delays nothing."""
        if not (self.observe and self.pool and len(self.observed) < 256):
            return
        rk = self.rk
        ready, posted = self.pool[2 * len(self.observed)], self.pool[2 * len(self.observed) + 1]
        ready.record(rk.cur)
        rk.hot.wait_geq(rk.side.cuda_stream, self.mine(word), self.step)
        posted.record(rk.side)
        self.observed.append((ready, posted))

    def observations(self, reference: Any) -> list[float]:
        """(posted - ready) in us for every observed step (call after the GPU finished them)."""
        return [(reference.elapsed_time(posted) - reference.elapsed_time(ready)) * 1000.0
                for ready, posted in self.observed]

    def mine(self, word: int) -> int:
        return self.rk.base + self.block * BLOCK_NBYTES + 8 * word

    def theirs(self, word: int) -> int:
        return self.rk.peer + self.block * BLOCK_NBYTES + 8 * word

    def landing(self, half: int) -> tuple[int, int, int]:
        """Where a received step is, in the receiver's allocation."""
        return OFF_DST_A, OFF_DST_B, half

    def prepare(self, nbytes: int) -> None:
        """Per-measurement set-up (nothing for most)."""

    def poison(self, half: int) -> None:
        self.rk.poison(self.landing(half))

    def snapshot(self, landed: tuple[int, int, int]) -> dict[str, Any]:
        return self.rk.snapshot(landed)

    def send(self, src: tuple[int, int, int]) -> None:
        raise NotImplementedError

    def recv(self, hint: tuple[int, int, int]) -> tuple[int, int, int]:
        """``hint``: the sender's payload offsets (both ranks know the schedule)."""
        raise NotImplementedError


class RawFlagsLink(RawLink):
    """Latency floor: one copy of the whole step, then the peer's flag; the peer waits on its flag."""

    def landing(self, half: int) -> tuple[int, int, int]:
        return OFF_SLOTS, OFF_SLOTS + half, half

    def send(self, src: tuple[int, int, int]) -> None:
        self.step += 1
        rk, stream = self.rk, self.rk.cur.cuda_stream
        off_a, _, half = src  # sources and landings are dense: B follows A
        rk.hot.memcpy(rk.peer + OFF_SLOTS, rk.base + off_a, 2 * half, stream)
        rk.hot.write(stream, self.theirs(W_FULL), self.step)  # after the copy, in stream order

    def recv(self, hint: tuple[int, int, int]) -> tuple[int, int, int]:
        self.step += 1
        self.rk.hot.wait_geq(self.rk.cur.cuda_stream, self.mine(W_FULL), self.step)
        return self.landing(hint[2])


class RawSplitLink(RawFlagsLink):
    """raw_flags with the copy split in two halves: the caller's stream and a relay, one flag each."""

    def send(self, src: tuple[int, int, int]) -> None:
        self.step += 1
        rk, cur, relay = self.rk, self.rk.cur, self.rk.relays[0]
        off_a, _, half = src
        first, second = split_copies([(rk.peer + OFF_SLOTS, rk.base + off_a, 2 * half)], 2)
        rk.fence(cur, relay)  # the relay's half reads the source after the caller's earlier work
        rk.hot.memcpy_all(first, cur.cuda_stream)
        rk.hot.write(cur.cuda_stream, self.theirs(W_SPLIT), self.step)
        rk.hot.memcpy_all(second, relay.cuda_stream)
        rk.fence(relay, cur)  # the caller's later work comes after the relay's half
        rk.hot.write(relay.cuda_stream, self.theirs(W_SPLIT + 1), self.step)

    def recv(self, hint: tuple[int, int, int]) -> tuple[int, int, int]:
        self.step += 1
        for k in range(2):
            self.rk.hot.wait_geq(self.rk.cur.cuda_stream, self.mine(W_SPLIT + k), self.step)
        return self.landing(hint[2])


class DirectLink(RawLink):
    """Depth-0 protocol: the sender copies straight into the receiver's destination once it is free.

    receiver (its stream): write ready=N into the sender (everything before recv(N), readers of
    step N-1 included, is done), then wait until every chunk's flag >= N.
    sender: wait ready >= N, copy (split over ``split`` streams), write each chunk's flag = N
    after its copy. ``relay``: the sender's part runs on a relay stream, the flag wait first and the
    caller's work (an event) second, as the transport's relay does.
    """

    def __init__(self, rk: Rank, name: str, direction: int, split: int = 1, relay: bool = False,
                 observe: bool = False):
        super().__init__(rk, name, direction, observe)
        self.split, self.relay = split, relay

    def send(self, src: tuple[int, int, int]) -> None:
        self.step += 1
        rk, cur = self.rk, self.rk.cur
        self.observe_step(W_READY)  # `ready` is what the receiver writes at recv() entry anyway
        off_a, off_b, half = src
        copies = [(rk.peer + OFF_DST_A, rk.base + off_a, half), (rk.peer + OFF_DST_B, rk.base + off_b, half)]
        if self.relay:
            relay = rk.relays[0]
            rk.hot.wait_geq(relay.cuda_stream, self.mine(W_READY), self.step)
            rk.fence(cur, relay)
            rk.hot.memcpy_all(copies, relay.cuda_stream)
            rk.fence(relay, cur)
            rk.hot.write(relay.cuda_stream, self.theirs(W_SPLIT), self.step)
            return
        chunks = split_copies(copies, self.split)
        rk.hot.wait_geq(cur.cuda_stream, self.mine(W_READY), self.step)
        for k in range(1, self.split):
            rk.fence(cur, rk.relays[k - 1])  # after the ready wait (and the caller's earlier work)
        rk.hot.memcpy_all(chunks[0], cur.cuda_stream)
        rk.hot.write(cur.cuda_stream, self.theirs(W_SPLIT), self.step)
        for k in range(1, self.split):
            relay = rk.relays[k - 1]
            rk.hot.memcpy_all(chunks[k], relay.cuda_stream)
            rk.fence(relay, cur)
            rk.hot.write(relay.cuda_stream, self.theirs(W_SPLIT + k), self.step)

    def recv(self, hint: tuple[int, int, int]) -> tuple[int, int, int]:
        self.step += 1
        stream = self.rk.cur.cuda_stream
        self.rk.hot.write(stream, self.theirs(W_READY), self.step)
        for k in range(self.split):
            self.rk.hot.wait_geq(stream, self.mine(W_SPLIT + k), self.step)
        return self.landing(hint[2])


class SlotLink(RawLink):
    """Slots on the receiver, copy-out into the destination; step N uses slot (N-1) % depth.

    sender: [wait empty >= N-depth], copy into the peer's slot, write full[slot] = N. With
    ``streams`` > 1 step N runs on relay (N-1) % streams, fenced to the caller's stream by an event
    before (the caller's work) and one after the copies (recorded before the flag write, so the
    caller and the next step need not wait for it).
    receiver (its stream): wait full[slot] >= N, copy the slot into the destination, write
    empty = N into the sender (only when N % ``empty_every`` == 0; depth >= empty_every keeps that
    from deadlocking: the sender needs empty >= N - depth, which step <= N - 1 always provides).
    ``observe``: the receiver also writes posted = N at recv() entry; the sender times, on a side
    stream, that moment against the moment its own data was ready (the adaptive switch's signal).
    """

    def __init__(self, rk: Rank, name: str, direction: int, depth: int, streams: int = 1, empty_every: int = 1,
                 observe: bool = False):
        super().__init__(rk, name, direction, observe)
        if depth > MAX_SLOTS or depth < empty_every:
            raise ValueError(f"{name}: depth {depth} must be in [empty_every={empty_every}, {MAX_SLOTS}]")
        self.depth, self.streams, self.empty_every = depth, streams, empty_every

    def send(self, src: tuple[int, int, int]) -> None:
        self.step += 1
        rk, cur, n = self.rk, self.rk.cur, self.step
        off_a, off_b, half = src
        slot = rk.peer + OFF_SLOTS + ((n - 1) % self.depth) * 2 * half
        copies = [(slot, rk.base + off_a, half), (slot + half, rk.base + off_b, half)]
        self.observe_step(W_POSTED)
        stream = cur if self.streams == 1 else rk.relays[(n - 1) % self.streams]
        if n > self.depth:
            rk.hot.wait_geq(stream.cuda_stream, self.mine(W_EMPTY), n - self.depth)
        if stream is not cur:
            rk.fence(cur, stream)
        rk.hot.memcpy_all(copies, stream.cuda_stream)
        if stream is not cur:
            rk.fence(stream, cur)
        rk.hot.write(stream.cuda_stream, self.theirs(W_FULL + (n - 1) % self.depth), n)

    def recv(self, hint: tuple[int, int, int]) -> tuple[int, int, int]:
        self.step += 1
        rk, stream, n = self.rk, self.rk.cur.cuda_stream, self.step
        half = hint[2]
        if self.observe:
            rk.hot.write(stream, self.theirs(W_POSTED), n)
        slot = rk.base + OFF_SLOTS + ((n - 1) % self.depth) * 2 * half
        rk.hot.wait_geq(stream, self.mine(W_FULL + (n - 1) % self.depth), n)
        rk.hot.memcpy_all([(rk.base + OFF_DST_A, slot, half), (rk.base + OFF_DST_B, slot + half, half)], stream)
        if n % self.empty_every == 0:
            rk.hot.write(stream, self.theirs(W_EMPTY), n)
        return self.landing(half)


class PullLink(RawLink):
    """The receiver's copy engine reads the sender's tensors; the sender's stream holds until it is done."""

    def send(self, src: tuple[int, int, int]) -> None:
        self.step += 1
        stream = self.rk.cur.cuda_stream
        self.rk.hot.write(stream, self.theirs(W_AVAIL), self.step)  # after the producers, in stream order
        self.rk.hot.wait_geq(stream, self.mine(W_DONE), self.step)  # later overwrites wait for the pull

    def recv(self, hint: tuple[int, int, int]) -> tuple[int, int, int]:
        self.step += 1
        rk, stream = self.rk, self.rk.cur.cuda_stream
        off_a, off_b, half = hint
        rk.hot.wait_geq(stream, self.mine(W_AVAIL), self.step)
        rk.hot.memcpy_all([(rk.base + OFF_DST_A, rk.peer + off_a, half), (rk.base + OFF_DST_B, rk.peer + off_b, half)],
                          stream)
        rk.hot.write(stream, self.theirs(W_DONE), self.step)
        return self.landing(half)


class PullStagedLink(RawLink):
    """The sender copies into its own outbox slot (local), the receiver pulls it into its destination."""

    def __init__(self, rk: Rank, name: str, direction: int, depth: int):
        super().__init__(rk, name, direction)
        self.depth = depth

    def send(self, src: tuple[int, int, int]) -> None:
        self.step += 1
        rk, stream, n = self.rk, self.rk.cur.cuda_stream, self.step
        off_a, off_b, half = src
        out = rk.base + OFF_SLOTS + ((n - 1) % self.depth) * 2 * half
        if n > self.depth:
            rk.hot.wait_geq(stream, self.mine(W_DONE), n - self.depth)
        rk.hot.memcpy_all([(out, rk.base + off_a, half), (out + half, rk.base + off_b, half)], stream)
        rk.hot.write(stream, self.theirs(W_FULL + (n - 1) % self.depth), n)

    def recv(self, hint: tuple[int, int, int]) -> tuple[int, int, int]:
        self.step += 1
        rk, stream, n = self.rk, self.rk.cur.cuda_stream, self.step
        half = hint[2]
        out = rk.peer + OFF_SLOTS + ((n - 1) % self.depth) * 2 * half
        rk.hot.wait_geq(stream, self.mine(W_FULL + (n - 1) % self.depth), n)
        rk.hot.memcpy_all([(rk.base + OFF_DST_A, out, half), (rk.base + OFF_DST_B, out + half, half)], stream)
        rk.hot.write(stream, self.theirs(W_DONE), n)
        return self.landing(half)


class TorchLink:
    """``make_transport`` (``ours_*``) or NCCL (``nccl``): payloads are dicts of bf16 tensors."""

    kind = "torch"

    def __init__(self, rk: Rank, transport: Any = None, persistent: Any = None):
        self.rk, self.transport, self.persistent = rk, transport, persistent
        self.buffers: list[Any] = []
        self.sends: list[Any] = []  # NCCL send works, kept until the next measurement (never waited on)
        self.count = 0

    def prepare(self, nbytes: int) -> None:
        from syncless.bench._pp_rig import empty_payload

        self.sends = []  # the last measurement ended with a device synchronize: its sends are done
        if self.transport is None:  # NCCL receives into two buffers in turn
            self.buffers = [empty_payload(rows_for(nbytes), self.rk.device) for _ in range(2)]

    def poison(self, half: int) -> None:
        from syncless.bench._pp_rig import poison

        for tensors in ([self.persistent] if self.transport is not None else self.buffers):
            if tensors:
                poison(tensors)

    def snapshot(self, landed: dict[str, Any]) -> dict[str, Any]:
        return {name: landed[name].clone() for name in TENSOR_NAMES}

    def send(self, payload: dict[str, Any]) -> None:
        if self.transport is not None:
            self.transport.send(payload)
            return
        _, dist, _ = _gpu_modules()
        ops = [dist.P2POp(dist.isend, payload[name], 1 - self.rk.rank, group=self.rk.nccl) for name in TENSOR_NAMES]
        self.sends.extend(dist.batch_isend_irecv(ops))  # NCCL's stream waits for the current one

    def recv(self, hint: Any) -> dict[str, Any]:
        if self.transport is not None:
            out = self.transport.recv()
            return {name: out[name] for name in TENSOR_NAMES}
        _, dist, _ = _gpu_modules()
        into = self.buffers[self.count % 2]
        self.count += 1
        ops = [dist.P2POp(dist.irecv, into[name], 1 - self.rk.rank, group=self.rk.nccl) for name in TENSOR_NAMES]
        for work in dist.batch_isend_irecv(ops):
            work.wait()  # the current stream waits; the host does not
        return into


def make_link(rk: Rank, method: str, direction: int) -> Any:
    """Return this rank's end of ``method`` in ``direction`` (0: rank 0 -> 1, 1: rank 1 -> 0)."""
    if method == "nccl":
        return TorchLink(rk)
    if method.startswith("ours_"):
        built = rk.ours.get((method, "fwd" if direction == 0 else "bwd"))
        return TorchLink(rk, *built) if built is not None else None  # ours_d8 is built forward only
    table = {
        "raw_flags": lambda: RawFlagsLink(rk, method, direction),
        "raw_split2": lambda: RawSplitLink(rk, method, direction),
        "direct": lambda: DirectLink(rk, method, direction),
        "direct_relay": lambda: DirectLink(rk, method, direction, relay=True),
        "direct_split2": lambda: DirectLink(rk, method, direction, split=2),
        "direct_obs": lambda: DirectLink(rk, method, direction, observe=True),
        "slot2": lambda: SlotLink(rk, method, direction, 2),
        "slot8": lambda: SlotLink(rk, method, direction, 8),
        "slot8_k2": lambda: SlotLink(rk, method, direction, 8, streams=2),
        "slot8_k4": lambda: SlotLink(rk, method, direction, 8, streams=4),
        "slot8_k2_b4": lambda: SlotLink(rk, method, direction, 8, streams=2, empty_every=4),
        "slot8_k2_obs": lambda: SlotLink(rk, method, direction, 8, streams=2, observe=True),
        "pull": lambda: PullLink(rk, method, direction),
        "pull_staged8": lambda: PullStagedLink(rk, method, direction, 8),
    }
    if method not in table:
        raise ValueError(f"no link for {method!r}")
    return table[method]()


def make_transports(rk: Rank, plan: list[Row]) -> None:
    """Build the ``make_transport`` links the plan uses (collective: same order on both ranks)."""
    from syncless.bench._pp_rig import empty_payload
    from syncless.pp import make_transport

    wanted = {row.method for row in plan}
    largest = max(row.nbytes for row in plan)
    specs = [("ours_d2", "fwd", [0, 1], 1, 2, largest), ("ours_d2", "bwd", [1, 0], 0, 2, largest),
             ("ours_d0", "fwd", [0, 1], 1, 0, largest), ("ours_d0", "bwd", [1, 0], 0, 0, largest),
             ("ours_d8", "fwd", [0, 1], 1, 8, min(largest, 8 * MIB))]
    for name, direction, order, receiver, depth, nbytes in specs:
        if name not in wanted:
            continue
        rows = rows_for(nbytes)
        persistent = empty_payload(rows, rk.device, own_allocation=depth == 0) if rk.rank == receiver else None
        transport = make_transport(None, persistent, stage_ranks=order, backend="copy_engine", timeout_s=20.0,
                                   depth=depth)
        rk.ours[(name, direction)] = (transport, persistent)


# -- measurements ---------------------------------------------------------------------------------


class Sources:
    """One measurement's fresh data: ``count`` payloads, as the sender holds them and as offsets."""

    def __init__(self, rk: Rank, kind: str, nbytes: int, holder: int):
        from syncless.bench._pp_rig import make_payload

        self.rk, self.kind, self.nbytes = rk, kind, nbytes
        self.rows, self.count = rows_for(nbytes), source_count(nbytes)
        self.seeds = rk.next_seeds(self.count)
        self.offsets = [source_offsets(i, nbytes) for i in range(self.count)]
        self.payloads: list[Any] = []
        if rk.rank == holder:
            self.payloads = [make_payload(self.rows, seed, rk.device) for seed in self.seeds]
            if kind == "raw":
                for offsets, payload in zip(self.offsets, self.payloads):
                    rk.fill(offsets, payload)

    def to_send(self, i: int) -> Any:
        return self.offsets[i % self.count] if self.kind == "raw" else self.payloads[i % self.count]

    def expected(self, i: int) -> dict[str, Any]:
        from syncless.bench._pp_rig import make_payload

        return make_payload(self.rows, self.seeds[i % self.count], self.rk.device)


def _host_ahead(event: Any) -> bool:
    return not event.query()


def measure_latency(rk: Rank, row: Row) -> dict[str, Any]:
    """Ping-pong: rank 0 sends step i, rank 1 echoes what landed; one-way = round trip / 2 (rank 0)."""
    torch, _, _ = _gpu_modules()
    fwd, bwd = make_link_pair(rk, row.method)
    link_kind = fwd.kind
    nbytes, half = row.nbytes, row.nbytes // 2
    sources = Sources(rk, link_kind, nbytes, holder=0)
    iters = latency_iters(nbytes, rk.config.quick)
    fwd.prepare(nbytes)
    bwd.prepare(nbytes)
    echo_hint = fwd.landing(half) if link_kind == "raw" else None
    observer = fwd if isinstance(fwd, RawLink) and fwd.observe and rk.rank == 0 else None

    def loop(count: int, mark: Any = None) -> Any:
        landed = None
        for i in range(count):
            if rk.rank == 0:
                if row.kernel:
                    rk.tick()
                fwd.send(sources.to_send(i))
                landed = bwd.recv(echo_hint)
            else:
                landed = fwd.recv(sources.offsets[i % sources.count])
                if mark is not None and i == 0:
                    mark.record(rk.cur)
                if row.kernel:
                    rk.tick()
                bwd.send(landed)
        return landed

    start_s = time.perf_counter()
    loop(2)
    per_iter = max(rk.gather((time.perf_counter() - start_s) / 2))
    rk.sync(f"{row.label()}: warm-up")
    gate = gate_ms(per_iter, iters)
    times, aheads, deltas = [], [], []
    landed = None
    for _ in range(repeats(rk.config.quick)):
        (bwd if rk.rank == 0 else fwd).poison(half)
        rk.sync(f"{row.label()}: poisoning")
        rk.barrier()
        start, end, mark = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        if observer is not None:
            observer.start_observing()
        if rk.rank == 0:
            reference = torch.cuda.Event(enable_timing=True)
            reference.record(rk.cur)
            held = rk.gate.hold(gate)
            start.record(rk.cur)
            landed = loop(iters)
            end.record(rk.cur)
            ahead = _host_ahead(held)
        else:
            landed = loop(iters, mark)
            ahead = _host_ahead(mark)
        rk.sync(f"{row.label()}: ping-pong")
        both = all(rk.gather(ahead))
        aheads.append(both)
        if rk.rank == 0:
            times.append(start.elapsed_time(end) * 1000.0 / iters / 2.0)
            if observer is not None:
                deltas.extend(observer.observations(reference))
        if not both:
            gate = min(gate * 2.0, MAX_GATE_MS)
    expected = sources.expected(iters - 1)
    snapshot = (bwd if rk.rank == 0 else fwd).snapshot(landed)
    data_ok = all(rk.gather(matches(snapshot, expected)))
    good = [t for t, a in zip(times, aheads) if a] or times
    record: dict[str, Any] = {"value": median(good), "reps": times, "ahead": aheads, "data_ok": data_ok,
                              "iters": iters, "gate_ms": gate}
    record.update(observer_figures(deltas))
    return record


def make_link_pair(rk: Rank, method: str) -> tuple[Any, Any]:
    """This rank's ends of ``method``'s two links, made once and kept (their step counts persist)."""
    if method not in rk.links:
        rk.links[method] = (make_link(rk, method, 0), make_link(rk, method, 1))
    return rk.links[method]


def measure_bandwidth(rk: Rank, row: Row) -> dict[str, Any]:
    """Back-to-back steps 0 -> 1; GB/s from the receiver's events at the first and last arrival."""
    if row.method.startswith("raw"):
        return measure_raw_bandwidth(rk, row)
    torch, _, _ = _gpu_modules()
    fwd, _ = make_link_pair(rk, row.method)
    nbytes, half = row.nbytes, row.nbytes // 2
    sources = Sources(rk, fwd.kind, nbytes, holder=0)
    steps = bandwidth_steps(nbytes, rk.config.quick)
    fwd.prepare(nbytes)
    sender = rk.rank == 0
    observer = fwd if isinstance(fwd, RawLink) and fwd.observe and sender else None

    def step(i: int) -> Any:
        if sender:
            fwd.send(sources.to_send(i))
            return None
        return fwd.recv(sources.offsets[i % sources.count])

    start_s = time.perf_counter()
    for i in range(4):
        step(i)
    per_step = max(rk.gather((time.perf_counter() - start_s) / 4))
    rk.sync(f"{row.label()}: warm-up")
    gate = gate_ms(per_step, steps)
    rates, aheads, host, deltas = [], [], [], []
    landed = None
    for _ in range(repeats(rk.config.quick)):
        if not sender:
            fwd.poison(half)
            rk.sync(f"{row.label()}: poisoning")
        rk.barrier()
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if observer is not None:
            observer.start_observing()
        spent = 0.0
        if sender:
            reference = torch.cuda.Event(enable_timing=True)
            reference.record(rk.cur)
            held = rk.gate.hold(gate)
            for i in range(steps):
                t0 = time.thread_time()
                step(i)
                spent += time.thread_time() - t0
            ahead = _host_ahead(held)
        else:
            for i in range(steps):
                t0 = time.thread_time()
                landed = step(i)
                spent += time.thread_time() - t0
                if i == 0:
                    first.record(rk.cur)
            last.record(rk.cur)
            ahead = _host_ahead(first)
        host.append(spent / steps * 1e6)
        rk.sync(f"{row.label()}: streaming")
        both = all(rk.gather(ahead))
        aheads.append(both)
        if not sender:
            rates.append((steps - 1) * nbytes / (first.elapsed_time(last) * 1e6))
        if observer is not None:
            deltas.extend(observer.observations(reference))
        if not both:
            gate = min(gate * 2.0, MAX_GATE_MS)
    final_ok = True if sender else matches(fwd.snapshot(landed), sources.expected(steps - 1))
    checked_ok = checked_pass(rk, row, fwd, sources)
    oks = rk.gather(final_ok and checked_ok)
    hosts = rk.gather(statistics.fmean(host))
    deltas_all = rk.gather(deltas)[0]
    rates = rk.gather(rates)[1]
    good = [r for r, a in zip(rates, aheads) if a] or rates
    record: dict[str, Any] = {"value": median(good), "reps": rates, "ahead": aheads, "data_ok": all(oks),
                              "steps": steps, "gate_ms": gate, "host_send_us": hosts[0], "host_recv_us": hosts[1]}
    record.update(observer_figures(deltas_all))
    return record


def checked_pass(rk: Rank, row: Row, fwd: Any, sources: Sources) -> bool:
    """A few more steps, each copied out by the receiver as soon as it landed, then all compared."""
    count = checked_steps(row.nbytes)
    if rk.rank == 1:
        fwd.poison(row.nbytes // 2)
    rk.sync(f"{row.label()}: checked pass set-up")
    rk.barrier()
    logs = []
    for i in range(count):
        if rk.rank == 0:
            fwd.send(sources.to_send(i))
        else:
            logs.append(fwd.snapshot(fwd.recv(sources.offsets[i % sources.count])))  # the reader of step i
    rk.sync(f"{row.label()}: checked pass")
    return all(matches(log, sources.expected(i)) for i, log in enumerate(logs))


def measure_raw_bandwidth(rk: Rank, row: Row) -> dict[str, Any]:
    """Rank 0 copies back to back into rank 1's slots region (no flags); GB/s from rank 0's events."""
    torch, _, _ = _gpu_modules()
    nbytes = row.nbytes
    sources = Sources(rk, "raw", nbytes, holder=0)
    steps = bandwidth_steps(nbytes, rk.config.quick)
    cur, relay = rk.cur, rk.relays[0]
    sender = rk.rank == 0

    def enqueue(count: int, first: Any = None) -> None:
        rk.fence(cur, relay)  # the relay starts after the gate too
        for i in range(count):
            off_a = sources.offsets[i % sources.count][0]
            if row.method == "raw":
                rk.hot.memcpy(rk.peer + OFF_SLOTS, rk.base + off_a, nbytes, cur.cuda_stream)
            elif row.method == "raw_alt2":  # two streams, each into its own half of the slots region
                stream = cur if i % 2 == 0 else relay
                rk.hot.memcpy(rk.peer + OFF_SLOTS + (i % 2) * nbytes, rk.base + off_a, nbytes, stream.cuda_stream)
            else:  # raw_split2: each stream moves its half of every step
                one, two = split_copies([(rk.peer + OFF_SLOTS, rk.base + off_a, nbytes)], 2)
                rk.hot.memcpy_all(one, cur.cuda_stream)
                rk.hot.memcpy_all(two, relay.cuda_stream)
            if i == 0 and first is not None:
                first.record(cur)
        rk.fence(relay, cur)

    rates, aheads = [], []
    gate = 0.0
    if sender:
        start_s = time.perf_counter()
        enqueue(4)
        gate = gate_ms((time.perf_counter() - start_s) / 4, steps)
        rk.sync(f"{row.label()}: warm-up")
    for _ in range(repeats(rk.config.quick)):
        rk.barrier()  # the sender's last repeat is finished (it synchronized): poison what it wrote
        if not sender:
            rk.poison((OFF_SLOTS, OFF_SLOTS + nbytes, nbytes))  # both halves of raw_alt2's two destinations
            rk.sync(f"{row.label()}: poisoning")
        rk.barrier()
        if sender:
            first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            held = rk.gate.hold(gate)
            enqueue(steps, first)
            last.record(cur)
            ahead = _host_ahead(held)
            rk.sync(f"{row.label()}: streaming")
            rates.append((steps - 1) * nbytes / (first.elapsed_time(last) * 1e6))
            aheads.append(ahead)
            if not ahead:
                gate = min(gate * 2.0, MAX_GATE_MS)
    rk.barrier()  # rank 0's copies are finished before rank 1 reads what landed
    data_ok = True
    if not sender:
        if row.method == "raw_alt2":  # each half ends with the last step of its parity
            for parity in (0, 1):
                last_i = steps - 1 if (steps - 1) % 2 == parity else steps - 2
                start = OFF_SLOTS + parity * nbytes
                got = rk.snapshot((start, start + nbytes // 2, nbytes // 2))
                data_ok = data_ok and matches(got, sources.expected(last_i))
        else:
            got = rk.snapshot((OFF_SLOTS, OFF_SLOTS + nbytes // 2, nbytes // 2))
            data_ok = matches(got, sources.expected(steps - 1))
    oks = rk.gather(data_ok)
    rates = rk.gather(rates)[0]
    aheads = rk.gather(aheads)[0]
    good = [r for r, a in zip(rates, aheads) if a] or rates
    return {"value": median(good), "reps": rates, "ahead": aheads, "data_ok": all(oks), "steps": steps}


def measure_chain(rk: Rank, row: Row) -> dict[str, Any]:
    """Rank 0 runs one op chain ``n`` times on its stream, back to back; us per iteration (rank 1 idles)."""
    torch, _, _ = _gpu_modules()
    nbytes, half, name = row.nbytes, row.nbytes // 2, row.method
    sources = Sources(rk, "raw", nbytes, holder=0)
    cur, relays, hot = rk.cur, rk.relays, rk.hot
    off_a, off_b, _ = sources.offsets[0]
    scratch = SCRATCH_BLOCK * BLOCK_NBYTES
    push = [(rk.peer + OFF_SLOTS, rk.base + off_a, half), (rk.peer + OFF_SLOTS + half, rk.base + off_b, half)]
    local = [(rk.base + OFF_DST_A, rk.base + off_a, half), (rk.base + OFF_DST_B, rk.base + off_b, half)]
    pull = [(rk.base + OFF_DST_A, rk.peer + OFF_SRC, half), (rk.base + OFF_DST_B, rk.peer + OFF_SRC + half, half)]
    met = rk.base + scratch  # a local word set far above any value waited for
    remote64, remote32 = rk.peer + scratch + 8, rk.peer + scratch + 16
    join_a, join_b = rk.base + scratch + 24, rk.base + scratch + 32
    n = 40
    lanes = {"alt2_copy_w64": 2, "alt4_copy_w64": 4}.get(name, 1)
    aux = relays[:lanes - 1] + ([relays[0]] if name.startswith("kernel_") and name != "kernel_copy" else [])

    def body(i: int) -> None:
        stream = cur.cuda_stream
        if name == "copy":
            hot.memcpy_all(push, stream)
        elif name == "copy_w64":
            hot.memcpy_all(push, stream)
            hot.write(stream, remote64, i)
        elif name == "copy_w32":
            from syncless._core import cuda

            hot.memcpy_all(push, stream)
            cuda.call("cuStreamWriteValue32", stream, remote32, i & 0xFFFFFFFF, 0)
        elif name == "wait_copy_w64":
            hot.wait_geq(stream, met, 1)
            hot.memcpy_all(push, stream)
            hot.write(stream, remote64, i)
        elif name == "copy_ev_w64":
            hot.memcpy_all(push, stream)
            rk.fence_event.record(cur)
            hot.write(stream, remote64, i)
        elif name in ("alt2_copy_w64", "alt4_copy_w64"):
            lane = [cur, *relays][i % lanes]
            hot.memcpy_all(push, lane.cuda_stream)
            hot.write(lane.cuda_stream, remote64, i)
        elif name == "copyout":
            hot.wait_geq(stream, met, 1)
            hot.memcpy_all(local, stream)
            hot.write(stream, remote64, i)
        elif name == "w64":
            hot.write(stream, remote64, i)
        elif name == "pull":
            hot.memcpy_all(pull, stream)
        elif name == "local_copy":
            hot.memcpy_all(local, stream)
            hot.memcpy_all(push, stream)
        elif name == "kernel":
            rk.tick()
        elif name == "kernel_copy":
            rk.tick()
            hot.memcpy_all(push, stream)
        elif name == "kernel_ev_copy":
            rk.tick()
            rk.fence(cur, relays[0])
            hot.memcpy_all(push, relays[0].cuda_stream)
            rk.fence(relays[0], cur)
        elif name == "kernel_flag_copy":
            rk.join += 1
            rk.tick()
            hot.write(stream, join_a, rk.join)
            hot.wait_geq(relays[0].cuda_stream, join_a, rk.join)
            hot.memcpy_all(push, relays[0].cuda_stream)
            hot.write(relays[0].cuda_stream, join_b, rk.join)
            hot.wait_geq(stream, join_b, rk.join)
        else:
            raise ValueError(f"unknown op chain {name!r}")

    writes_peer = name not in ("copyout", "w64", "pull", "kernel")
    if rk.rank == 1:
        copy_of_source = sources.expected(0)  # kept until the fill ran (synchronized below)
        rk.fill(sources.offsets[0], copy_of_source)  # the "pull" row reads rank 1's source 0
        if writes_peer:
            rk.poison((OFF_SLOTS, OFF_SLOTS + half, half))
    else:
        hot.write(cur.cuda_stream, met, 1 << 40)
        rk.poison((OFF_DST_A, OFF_DST_B, half))
    rk.sync(f"{row.label()}: set-up")
    rk.barrier()
    times = []
    if rk.rank == 0:
        start_s = time.perf_counter()
        for stream in aux:
            rk.fence(cur, stream)
        for i in range(3):
            body(i)
        for stream in aux:
            rk.fence(stream, cur)
        gate = gate_ms((time.perf_counter() - start_s) / 3, n)
        rk.sync(f"{row.label()}: warm-up")
        for _ in range(repeats(rk.config.quick)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            held = rk.gate.hold(gate)
            start.record(cur)
            for stream in aux:
                rk.fence(cur, stream)
            for i in range(n):
                body(i)
            for stream in aux:
                rk.fence(stream, cur)
            end.record(cur)
            if not _host_ahead(held):
                gate = min(gate * 2.0, MAX_GATE_MS)
            rk.sync(f"{row.label()}: op chain")
            times.append(start.elapsed_time(end) * 1000.0 / n)
    rk.barrier()
    data_ok: bool | None = None
    if name not in ("w64", "kernel"):
        mine = (rk.rank == 1) == writes_peer
        if mine:
            where = (OFF_SLOTS, OFF_SLOTS + half, half) if writes_peer else (OFF_DST_A, OFF_DST_B, half)
            data_ok = matches(rk.snapshot(where), sources.expected(0))
        data_ok = all(ok for ok in rk.gather(data_ok) if ok is not None)
    times = rk.gather(times)[0]
    return {"value": median(times), "reps": times, "data_ok": data_ok}


# -- one rank -------------------------------------------------------------------------------------


def _line(row: Row, record: dict[str, Any], nccl: float | None) -> str:
    unit = "GB/s" if row.section == "bw" else "us"
    value = record.get("value", float("nan"))
    text = f"{row.label():44s} {value:8.2f} {unit}"
    if nccl is not None and not math.isnan(nccl) and not math.isnan(value):
        text += f"  ({value / nccl:.2f}x NCCL)"
    if record.get("data_ok") is False:
        text += "  DATA MISMATCH"
    if record.get("ahead") is not None and not all(record["ahead"]):
        text += f"  (host not ahead in {record['ahead'].count(False)} of {len(record['ahead'])} repeats)"
    if "posted_first" in record:
        text += f"  posted first {record['posted_first']:.0%}, median {record['posted_minus_ready_us']:+.1f} us"
    if "host_send_us" in record:
        text += f"  host {record['host_send_us']:.0f}/{record['host_recv_us']:.0f} us"
    return text


def warm_up_nccl(rk: Rank) -> None:
    """Connect NCCL both ways with one batch per rank (a send and a receive posted together cannot deadlock)."""
    torch, dist, _ = _gpu_modules()
    out = torch.full((1024,), float(rk.rank + 1), device=rk.device)
    into = torch.zeros(1024, device=rk.device)
    ops = [dist.P2POp(dist.isend, out, 1 - rk.rank, group=rk.nccl),
           dist.P2POp(dist.irecv, into, 1 - rk.rank, group=rk.nccl)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    rk.sync("NCCL warm-up")
    if float(into[0].item()) != float(2 - rk.rank):
        raise RuntimeError(f"NCCL warm-up delivered {into[0].item()} instead of {2 - rk.rank}")


def rank_main(rank: int, world_size: int, fields: dict[str, Any]) -> dict[str, Any]:
    """One rank: set up, run every row of the plan in order, tear down; rank 0 returns the results.

    ``fields``: the :class:`Config` as plain data (this module is loaded again by file in each rank).
    """
    from syncless._core.launch import say

    torch, _, _ = _gpu_modules()
    config = Config(**fields)
    started = time.monotonic()
    plan = build_plan(config)
    rk = Rank(rank, config)
    out = print if rank == 0 else (lambda *a, **k: None)
    say(f"on {torch.cuda.get_device_name(rk.device)}; batched copies: {rk.batch_problem or 'yes'}")
    make_transports(rk, plan)
    warm_up_nccl(rk)
    say(f"set up in {time.monotonic() - started:.1f} s; {len(plan)} rows")
    results: dict[str, dict[str, Any]] = {}
    skipped: list[str] = []
    try:
        for index, row in enumerate(plan):
            if not rk.share(time.monotonic() - started < config.budget_s if rank == 0 else None):
                skipped.append(row.key)
                continue
            rk.cur = rk.legacy if row.mode == "def" else rk.own
            with torch.cuda.stream(rk.cur):
                if row.section == "lat":
                    record = measure_latency(rk, row)
                elif row.section == "bw":
                    record = measure_bandwidth(rk, row)
                else:
                    record = measure_chain(rk, row)
            results[row.key] = record
            reference = None
            if row.section == "lat" and row.method != "nccl":
                reference = results.get(Row("lat", "nccl", row.mode, row.nbytes, row.kernel).key, {}).get("value")
            elif row.section == "bw" and row.method != "nccl":
                reference = results.get(Row("bw", "nccl", "def", row.nbytes).key, {}).get("value")
            out(f"[{time.monotonic() - started:6.1f}s {index + 1:3d}/{len(plan)}] {_line(row, record, reference)}",
                flush=True)
    except BaseException as err:
        # The ranks are out of step now (a flag wait timed out, a call failed): no further row can run.
        # Print what was measured, then let the launcher stop both ranks and report the error.
        out(f"row {len(results) + len(skipped) + 1} failed ({type(err).__name__}: {err}); summary so far:",
            flush=True)
        for line in summarize(results, config.sizes) if rank == 0 else []:
            print(line, flush=True)
        raise
    if skipped:
        out(f"skipped (time budget {config.budget_s:g} s): {len(skipped)} rows: {', '.join(skipped)}", flush=True)
    if rank == 0:
        for line in summarize(results, config.sizes):
            print(line, flush=True)
    try:
        rk.close()
    except Exception as err:  # noqa: BLE001 - the results are in; a failed tear-down is only reported
        say(f"tear-down failed: {type(err).__name__}: {err}")
    return {"results": results, "skipped": skipped, "batched_copies": rk.batch_problem is None,
            "elapsed_s": time.monotonic() - started} if rank == 0 else {}


def main(argv: list[str] | None = None) -> int:
    config, list_only = parse_args(sys.argv[1:] if argv is None else argv)
    plan = build_plan(config)
    if list_only:
        for row in plan:
            print(row.label())
        print(f"{len(plan)} rows")
        return 0
    from syncless._core.errors import MissingDependencyError
    from syncless._core.launch import RankFailed, RanksTimedOut, run_ranks

    try:
        import torch

        count = torch.cuda.device_count()
    except (ImportError, MissingDependencyError) as err:
        print(f"probe_sizes: needs torch with CUDA: {err}", file=sys.stderr)
        return 2
    if count < 2:
        print(f"probe_sizes: needs two GPUs of one node (NVLink); torch sees {count}", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        outcome = run_ranks(rank_main, 2, args=(dataclasses.asdict(config),), backend="cpu:gloo,cuda:nccl", devices=[0, 1],
                            timeout_s=config.hard_timeout_s, load_by_file=True, progress=True)
    except RanksTimedOut as err:
        print(f"\nprobe_sizes: HUNG, killed after {config.hard_timeout_s:g} s: {err}\n"
              "The rows printed above are valid; the last one printed is the one before the hang.", file=sys.stderr)
        return 3
    except RankFailed as err:
        print(f"\nprobe_sizes: FAILED after {time.monotonic() - started:.0f} s:\n{err}", file=sys.stderr)
        return 2
    report = outcome[0]
    bad = [key for key, record in report["results"].items() if record.get("data_ok") is False]
    if config.json_path:
        with open(config.json_path, "w", encoding="utf-8") as handle:
            json.dump({"config": dataclasses.asdict(config), **report}, handle, indent=1, default=str)
        print(f"results written to {config.json_path}")
    print(f"probe_sizes: done in {time.monotonic() - started:.0f} s; {len(report['results'])} rows, "
          f"{len(report['skipped'])} skipped, {len(bad)} data mismatches")
    if bad:
        print(f"probe_sizes: DATA MISMATCH in {', '.join(bad)}", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
