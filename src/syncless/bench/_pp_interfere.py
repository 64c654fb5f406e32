"""Interference: what moving activations costs the compute that shares the GPU.

(i) GEMM slowdown on the sending GPU: a bf16 GEMM loop on one stream while
the transport streams a payload from another, against the loop alone::

    rank 0  gemm stream: [gate 2 ms][GEMM][GEMM]...[GEMM]^end
            comm stream: [send][send][send] ........ [send]^tail   (tail after end: the window was covered)

(ii) A kernel that needs every SM, on the receiving GPU while a receive is
pending: rank 0 holds its send back with a GPU sleep; rank 1 posts the
receive on one stream, then launches the kernel on another::

    rank 1  recv stream:    [receive posted ...................... data lands]^done
            compute stream:    [full-SM kernel][full-SM kernel]^end          (end before done: it was pending)

A pending NCCL receive runs a kernel that waits on an SM, so the full-SM
kernel needs a second wave; ours waits with a stream memory operation.
"""

from __future__ import annotations

import math
from typing import Any

from syncless.bench._pp_plan import rows_for, size_label
from syncless.bench._pp_rig import (
    Rig,
    empty_payload,
    make_payload,
    median,
    nccl_recv,
    nccl_send,
    poison,
    same_bits,
    views,
    wait_all,
)

NAN = float("nan")
GEMM_GATE_MS = 2.0
MAX_SENDS = 5000


def _modes(rig: Rig) -> list[str]:
    return ["alone", "nccl", "ours"] if rig.fwd is not None else ["alone", "nccl"]


def send_count(window_ms: float, nbytes: int, gbps: float, margin: float = 1.3) -> int:
    """Return how many ``nbytes`` sends at ``gbps`` keep a link busy for ``window_ms`` (with margin)."""
    if not gbps > 0:
        # Unknown rate: assume the fastest NVLink 4 can go (450 GB/s per direction), so
        # the sends can only outlast the window, never end inside it.
        gbps = 450.0
    step_ms = nbytes / (gbps * 1e6)
    return min(MAX_SENDS, math.ceil(window_ms * margin / step_ms) + 2)


def run_gemm(rig: Rig, bandwidth: dict[str, dict[int, float]]) -> None:
    """Time a bf16 GEMM loop on rank 0 alone and while NCCL / ours stream to rank 1."""
    import torch

    plan = rig.plan
    nbytes = plan.interference_nbytes
    rows = rows_for(nbytes)
    modes = _modes(rig)
    gemm_stream = comm_stream = None
    count = None
    if rig.sender:
        generator = torch.Generator(device=rig.device).manual_seed(7)
        a = torch.randn(plan.gemm_n, plan.gemm_n, device=rig.device, dtype=torch.bfloat16, generator=generator)
        b = torch.randn(plan.gemm_n, plan.gemm_n, device=rig.device, dtype=torch.bfloat16, generator=generator)
        c = torch.empty_like(a)
        payload = make_payload(rows, 900, rig.device)
        gemm_stream, comm_stream = torch.cuda.Stream(device=rig.device), torch.cuda.Stream(device=rig.device)
        with torch.cuda.stream(gemm_stream):
            for _ in range(3):
                torch.mm(a, b, out=c)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                torch.mm(a, b, out=c)
            end.record()
        rig.sync("GEMM calibration")
        gemm_ms = start.elapsed_time(end) / 5
        count = max(3, math.ceil(plan.gemm_window_ms / gemm_ms))
        window_ms = GEMM_GATE_MS + count * gemm_ms
        sends = {"alone": 0}
        for mode in modes[1:]:
            sends[mode] = send_count(window_ms, nbytes, bandwidth.get(mode, {}).get(nbytes, NAN))
        setup = {"count": count, "sends": sends}
    else:
        setup = None
    setup = rig.share(setup, src=0)
    count, sends = setup["count"], setup["sends"]
    into = None if rig.sender else empty_payload(rows, rig.device)
    per_gemm: dict[str, list[float]] = {mode: [] for mode in modes}
    covered: dict[str, list[bool]] = {mode: [] for mode in modes}
    for round_index in range(plan.gemm_rounds):
        shift = round_index % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            rig.barrier()
            if rig.sender:
                with torch.cuda.stream(gemm_stream):
                    rig.gate.hold(GEMM_GATE_MS)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(count):
                        torch.mm(a, b, out=c)
                    end.record()
                tail = None
                if sends[mode]:
                    with torch.cuda.stream(comm_stream):
                        tail = _stream_sends(rig, mode, payload, sends[mode])
                rig.sync(f"GEMM loop with {mode}")
                per_gemm[mode].append(start.elapsed_time(end) / count)
                covered[mode].append(tail is None or end.elapsed_time(tail) > 0)
            else:
                for _ in range(sends[mode]):
                    if mode == "nccl":
                        wait_all(nccl_recv(rig, into))
                    else:
                        views(rig.fwd.recv())
                rig.sync(f"receiving during the GEMM loop ({mode})")
    if not rig.sender:
        return
    alone = median(per_gemm["alone"])
    record: dict[str, Any] = {"gemm_n": plan.gemm_n, "gemms_per_loop": count, "payload_nbytes": nbytes, "sends": sends}
    for mode in modes:
        record[mode] = {
            "ms_per_gemm": median(per_gemm[mode]),
            "reps_ms": per_gemm[mode],
            "slowdown_pct": (median(per_gemm[mode]) / alone - 1.0) * 100.0,
            "covered": all(covered[mode]),
        }
    rig.report.result(("gemm",), record)
    text = ", ".join(f"{mode} {record[mode]['slowdown_pct']:+.1f}%" for mode in modes[1:])
    rig.report.progress(f"GEMM {plan.gemm_n}^3 on the sender: {alone:.3f} ms alone; slowdown {text}")


def _stream_sends(rig: Rig, mode: str, payload: dict[str, Any], sends: int) -> Any:
    """Enqueue ``sends`` sends on the current stream; return an event that fires after the last one."""
    import torch

    works: list[Any] = []
    for _ in range(sends):
        if mode == "nccl":
            works = nccl_send(rig, payload)
        else:
            rig.fwd.send(payload)
    # NCCL: join the last send's stream; ours: the peer copies ran on this
    # stream, so an event recorded here fires after the last one.
    wait_all(works)
    tail = torch.cuda.Event(enable_timing=True)
    tail.record()
    return tail


# Full-SM kernel with a pending receive ----------------------------------------------


def run_pending(rig: Rig) -> None:
    """Time the full-SM kernel on rank 1 alone and while an NCCL / ours receive is pending."""
    import torch

    plan = rig.plan
    available = rig.share(rig.spin is not None if not rig.sender else None, src=1)
    if not available:
        return
    nbytes = plan.pending_nbytes
    rows = rows_for(nbytes)
    modes = _modes(rig)
    kernels = plan.spin_kernels_per_trial
    compute_stream = recv_stream = None
    calibration = None
    if not rig.sender:
        compute_stream = torch.cuda.Stream(device=rig.device)
        recv_stream = torch.cuda.Stream(device=rig.device)
        probe_cycles = 2_000_000
        best_ms = float("inf")
        with torch.cuda.stream(compute_stream):
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                rig.spin.launch(probe_cycles, compute_stream)
                end.record()
                end.synchronize()
                best_ms = min(best_ms, start.elapsed_time(end))
        cycles = max(1000, int(probe_cycles * plan.spin_kernel_ms / max(best_ms, 1e-3)))
        # The sender's delay: longer than every kernel of a trial even at 2x
        # (NCCL's second wave) plus launch skew, so the receive stays pending.
        calibration = {"cycles": cycles, "delay_ms": kernels * plan.spin_kernel_ms * 3.0 + 5.0}
    calibration = rig.share(calibration, src=1)
    payload = make_payload(rows, 950, rig.device) if rig.sender else None
    into = None if rig.sender else empty_payload(rows, rig.device)
    kernel_ms: dict[str, list[float]] = {mode: [] for mode in modes}
    pending_ok: dict[str, list[bool]] = {mode: [] for mode in modes}
    data_ok: dict[str, bool] = {}
    for _ in range(plan.spin_trials):
        for mode in modes:
            rig.barrier()
            if rig.sender:
                if mode != "alone":
                    rig.gate.hold(calibration["delay_ms"])
                    if mode == "nccl":
                        nccl_send(rig, payload)
                    else:
                        rig.fwd.send(payload)
                rig.sync(f"delayed send ({mode})")
                continue
            out = works = None
            if mode != "alone":
                with torch.cuda.stream(recv_stream):
                    # Poisoned on the receive stream, so ordered before the data lands.
                    if mode == "nccl":
                        poison(into)
                        works = nccl_recv(rig, into)
                    else:
                        poison(rig.persistent["fwd"])
                        out = views(rig.fwd.recv())
            events = []
            with torch.cuda.stream(compute_stream):
                for _ in range(kernels):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    rig.spin.launch(calibration["cycles"], compute_stream)
                    end.record()
                    events.append((start, end))
            done = None
            if mode != "alone":
                with torch.cuda.stream(recv_stream):
                    if works is not None:
                        wait_all(works)
                    done = torch.cuda.Event(enable_timing=True)
                    done.record()
            rig.sync(f"full-SM kernel ({mode})")
            kernel_ms[mode].extend(start.elapsed_time(end) for start, end in events)
            if done is not None:
                pending_ok[mode].append(events[-1][1].elapsed_time(done) > 0)
                expected = make_payload(rows, 950, rig.device)
                data_ok[mode] = data_ok.get(mode, True) and same_bits(into if mode == "nccl" else out, expected)
    if rig.sender:
        return
    alone = median(kernel_ms["alone"])
    record: dict[str, Any] = {
        "cycles": calibration["cycles"],
        "sender_delay_ms": calibration["delay_ms"],
        "sm_count": rig.spin.sm_count,
        "shared_nbytes": rig.spin.shared_nbytes,
        "ctas_per_sm": rig.spin.ctas_per_sm,
        "payload_nbytes": nbytes,
    }
    for mode in modes:
        record[mode] = {
            "kernel_ms": median(kernel_ms[mode]),
            "reps_ms": kernel_ms[mode],
            "ratio": median(kernel_ms[mode]) / alone,
            "pending": all(pending_ok[mode]) if mode != "alone" else None,
            "data_ok": data_ok.get(mode),
        }
    rig.report.result(("pending",), record)
    text = ", ".join(f"{mode} {record[mode]['ratio']:.2f}x" for mode in modes[1:])
    rig.report.progress(f"full-SM kernel on the receiver ({size_label(nbytes)} pending): {alone:.3f} ms alone; {text}")
