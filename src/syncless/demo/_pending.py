"""The demo's interference figure: a kernel that needs every SM, on the receiving stage while a receive is pending.

This runs ``syncless bench pp``'s own measurement (``bench._pp_interfere.
run_pending``) between the demo's two GPU stages, after both decode runs:
rank 1 launches the full-SM kernel alone, then while an NCCL receive is
pending, then while a syncless receive is pending; rank 0 holds each send
back with a GPU sleep so that the receive stays pending throughout::

    rank 1  recv stream:    [receive posted ...................... data lands]^done
            compute stream:    [full-SM kernel][full-SM kernel]^end

A pending NCCL receive occupies an SM with a waiting kernel, so the full-SM
kernel needs a second wave; a copy-engine receive waits with a stream
memory operation and holds no SM (``docs/pp.md``).
"""

from __future__ import annotations

from typing import Any

from syncless._core.errors import CudaError, MissingDependencyError


class _Collector:
    """Stands in for the benchmark's Reporter: keeps results and progress lines in this process."""

    def __init__(self) -> None:
        self.results: dict[tuple[Any, ...], Any] = {}
        self.lines: list[str] = []

    def progress(self, text: str) -> None:
        self.lines.append(text)

    def note(self, text: str) -> None:
        self.lines.append(text)

    def result(self, path: Any, value: Any) -> None:
        self.results[tuple(path)] = value


def measure_pending(rank: int, device: Any) -> dict[str, Any] | None:
    """Run the pending-receive measurement on ranks 0 and 1 of a 2-rank world; blocks the host.

    Returns, on rank 1 (the receiver): ``{"alone_ms", "nccl_ratio", "ours_ratio", "ours_backend",
    "pending_ok", "data_ok"}`` or ``{"skipped": reason}``; on rank 0: None.
    """
    import datetime

    import torch
    import torch.distributed as dist

    from syncless.bench._pp_cuda import Gate, SpinKernel, bind_primary_context
    from syncless.bench._pp_interfere import run_pending
    from syncless.bench._pp_plan import DECODE_STEP_NBYTES, Plan, rows_for
    from syncless.bench._pp_rig import Rig, empty_payload, nccl_warmup
    from syncless.pp import make_transport

    plan = Plan(quick=True, payloads=(DECODE_STEP_NBYTES,), interference_nbytes=DECODE_STEP_NBYTES,
                pending_nbytes=DECODE_STEP_NBYTES)
    timeout = datetime.timedelta(seconds=plan.dist_timeout_s)
    # Every rank creates both groups, in the same order (torch.distributed requires it).
    cpu_group = dist.new_group([0, 1], backend="gloo", timeout=timeout)
    nccl_group = dist.new_group([0, 1], backend="nccl", timeout=timeout)
    context = bind_primary_context(device.index)
    collector = _Collector()
    rig = Rig(rank=rank, device=device, plan=plan, report=collector, cpu_group=cpu_group, nccl_group=nccl_group,
              gate=Gate())
    spin_error = None
    try:
        receiver = rank == 1
        tensors = empty_payload(rows_for(plan.pending_nbytes), device) if receiver else None
        rig.fwd = make_transport(None, tensors, stage_ranks=[0, 1], timeout_s=plan.transport_timeout_s)
        if receiver:
            rig.persistent["fwd"] = tensors
            try:
                rig.spin = SpinKernel(device.index, torch.cuda.get_device_capability(device))
            except (MissingDependencyError, CudaError, RuntimeError) as err:
                spin_error = f"the full-SM kernel could not be built: {err}"
        nccl_warmup(rig)
        run_pending(rig)  # both ranks agree inside on whether the kernel exists
        if not receiver:
            return None
        record = collector.results.get(("pending",))
        if record is None:
            return {"skipped": spin_error or "the measurement produced no result"}
        return {
            "alone_ms": record["alone"]["kernel_ms"],
            "nccl_ratio": record["nccl"]["ratio"],
            "ours_ratio": record["ours"]["ratio"] if "ours" in record else None,
            "ours_backend": rig.fwd.backend,
            "pending_ok": all(record[mode]["pending"] for mode in record if isinstance(record[mode], dict)
                              and record[mode].get("pending") is not None),
            "data_ok": all(record[mode]["data_ok"] for mode in record if isinstance(record[mode], dict)
                           and record[mode].get("data_ok") is not None),
            "payload_nbytes": record["payload_nbytes"],
        }
    finally:
        if rig.fwd is not None:
            rig.fwd.close()
        if rig.spin is not None:
            rig.spin.unload()
        context.release()
