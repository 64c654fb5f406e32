"""One worker process of ``syncless bench pp``: one rank, one GPU.

Started by :mod:`._pp_launch` with the ``spawn`` method. It sets up
torch.distributed over a TCP store on 127.0.0.1 (gloo for the CPU side, NCCL
for the baseline), the transports under test, the raw IPC buffers and the
full-SM kernel, then runs the sections in a fixed order, identical on both
ranks, posting results to the parent as each one finishes (so a later
failure loses only what had not run yet). Sections, in order of risk:
bandwidth (raw peer copy, NCCL, ours, ours with depth=0; with host CPU per
call), latency (NCCL, ours, ours with depth=0)
on the default stream and again on a stream of each rank's own, GEMM
interference, pending receive, and last the raw flag ping-pong on both kinds
of stream (a stream waiting on a flag is the one thing here that could hang;
:func:`~._pp_cuda.sync_device` turns that into an error).
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from typing import Any

from syncless._core.errors import CudaError, MissingDependencyError
from syncless._core.launch import SAFE_ENV
from syncless.bench._pp_cuda import Gate, PeerBuffer, SpinKernel, bind_primary_context
from syncless.bench._pp_interfere import run_gemm, run_pending
from syncless.bench._pp_measure import run_bandwidth, run_latency
from syncless.bench._pp_plan import OWN_STREAM, Plan
from syncless.bench._pp_rig import Reporter, Rig, empty_payload, nccl_warmup


def child_main(rank: int, port: int, plan: Plan, queue: Any) -> None:
    """Entry point of a worker: run every section for ``rank``, reporting to ``queue``.

    Exits with status 1 after reporting the traceback if anything fails.
    """
    report = Reporter(rank, queue)
    try:
        rig, context = _set_up(rank, port, plan, report)
        _run_sections(rig)
    except BaseException:  # noqa: BLE001 - every failure must reach the parent, which stops both ranks
        report.error(traceback.format_exc(limit=30))
        raise SystemExit(1) from None
    report.done()
    try:
        _tear_down(rig)
        context.release()
    except Exception as err:  # noqa: BLE001 - the results are in; a failed clean-up is only noted
        report.note(f"rank {rank}: tear-down failed: {type(err).__name__}: {err}")


def _set_up(rank: int, port: int, plan: Plan, report: Reporter) -> tuple[Rig, Any]:
    for name, value in SAFE_ENV.items():  # never NVLink SHARP / multicast objects
        os.environ.setdefault(name, value)
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    torch.empty(1, device=device)  # torch's primary context exists from here on
    context = bind_primary_context(rank)
    report.progress(f"on {torch.cuda.get_device_name(device)}; joining the process group")
    timeout = timedelta(seconds=plan.dist_timeout_s)
    dist.init_process_group(
        backend="cpu:gloo,cuda:nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timeout,
    )
    cpu_group = dist.new_group([0, 1], backend="gloo", timeout=timeout)
    nccl_group = dist.new_group([0, 1], backend="nccl", timeout=timeout)
    rig = Rig(
        rank=rank, device=device, plan=plan, report=report, cpu_group=cpu_group, nccl_group=nccl_group, gate=Gate()
    )
    _open_raw(rig)
    _make_transports(rig)
    _build_spin(rig)
    nccl_warmup(rig)
    rig.report.result(("setup", f"rank{rank}"), _describe(rig))
    return rig, context


def _describe(rig: Rig) -> dict[str, Any]:
    import torch

    try:
        from cuda.bindings import __version__ as bindings_version
    except ImportError:
        bindings_version = None
    info: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(rig.device),
        "capability": list(torch.cuda.get_device_capability(rig.device)),
        "torch": torch.__version__,
        "nccl": _nccl_version(),
        "cuda_bindings": bindings_version,
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
        "gate_cycles_per_ms": rig.gate.cycles_per_ms,
        "raw_peer_buffers": rig.raw is not None,
    }
    for name, transport in (("fwd", rig.fwd), ("bwd", rig.bwd), ("fwd0", rig.fwd0), ("bwd0", rig.bwd0),
                            ("fwda", rig.fwda), ("bwda", rig.bwda)):
        if transport is not None:
            info[f"transport_{name}"] = {
                "backend": getattr(transport, "backend", None),
                "fallback_reason": getattr(transport, "fallback_reason", None),
                "batched_copies": getattr(transport, "batched_copies", None),
            }
            if name in ("fwda", "bwda"):
                info[f"transport_{name}"]["direct_unavailable_reason"] = getattr(
                    transport, "direct_unavailable_reason", None)
    if rig.spin is not None:
        info["spin_kernel"] = {
            "sm_count": rig.spin.sm_count,
            "shared_nbytes": rig.spin.shared_nbytes,
            "ctas_per_sm": rig.spin.ctas_per_sm,
        }
    return info


def _nccl_version() -> str:
    from torch.cuda import nccl

    version = nccl.version()
    return ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)


def _open_raw(rig: Rig) -> None:
    """Allocate this rank's raw buffer and open the peer's; on any failure neither rank keeps one."""
    buffer = None
    try:
        buffer = PeerBuffer(rig.plan.max_nbytes)
    except (CudaError, MissingDependencyError) as err:
        rig.report.note(f"rank {rig.rank}: no raw peer buffer (raw baselines skipped): {err}")
    handles = rig.gather(buffer.handle_bytes if buffer is not None else None)
    if any(handle is None for handle in handles):
        if buffer is not None:
            buffer.free()
        return
    failure = None
    try:
        buffer.open_peer(handles[rig.peer])
    except CudaError as err:
        failure = f"rank {rig.rank}: opening the peer's IPC buffer failed: {err}"
        rig.report.note(failure + " (raw baselines skipped)")
    if any(rig.gather(failure)):
        buffer.close_peer()
        rig.barrier()  # the peer has closed its mapping of our buffer too
        buffer.free()
        return
    rig.raw = buffer


def _make_transports(rig: Rig) -> None:
    """Build the forward (0 -> 1) and reverse (1 -> 0) transports, and the same pair with depth=0 and with
    depth="auto" on copy engines only; record a failure instead of stopping."""
    from syncless.pp import make_transport

    plan = rig.plan
    specs = (
        ("fwd", [0, 1], 1, plan.max_rows, None),  # rank 1 receives the forward direction
        ("bwd", [1, 0], 0, plan.latency_max_rows, None),  # rank 0 receives the echo
        ("fwd0", [0, 1], 1, plan.max_rows, 0),  # bandwidth and the ping-pong again with depth=0
        ("bwd0", [1, 0], 0, plan.latency_max_rows, 0),
        ("fwda", [0, 1], 1, plan.max_rows, "auto"),  # and with depth="auto" (opt-in, beside the default)
        ("bwda", [1, 0], 0, plan.latency_max_rows, "auto"),
    )
    for name, order, receiver, rows, depth in specs:
        # depth=0 and "auto" copy straight into the persistent tensors: in an allocation of their own.
        shared = depth in (0, "auto")
        tensors = empty_payload(rows, rig.device, own_allocation=shared) if rig.rank == receiver else None
        transport = error = None
        # depth=0 and "auto" are measured only on copy engines: without them there is nothing of them to measure.
        extra = {} if depth is None else {"depth": depth, "backend": "copy_engine"}
        try:
            transport = make_transport(
                None, tensors, stage_ranks=order, timeout_s=plan.transport_timeout_s, **extra
            )
        # Any failure is reported and 'ours' is skipped, so the baselines still
        # run; make_transport fails on every rank alike, checked just below.
        except Exception as err:  # noqa: BLE001
            error = f"{type(err).__name__}: {err}"
        errors = rig.gather(error)
        if (errors[0] is None) != (errors[1] is None):
            raise RuntimeError(f"make_transport ({name}) failed on one rank only: {errors}")
        if error is not None:
            if rig.sender:
                rig.report.note(f"make_transport ({name}, ranks {order}) failed, 'ours' skipped there: {error}")
            continue
        setattr(rig, name, transport)
        if tensors is not None:
            rig.persistent[name] = tensors


def _build_spin(rig: Rig) -> None:
    import torch

    if rig.sender:
        return
    try:
        rig.spin = SpinKernel(rig.rank, torch.cuda.get_device_capability(rig.device))
    except (MissingDependencyError, CudaError, RuntimeError) as err:
        rig.report.note(f"full-SM kernel unavailable, pending-receive interference not measured: {err}")


def _run_sections(rig: Rig) -> None:
    progress = rig.report.progress if rig.sender else (lambda text: None)
    backend = getattr(rig.fwd, "backend", None) if rig.fwd is not None else "unavailable"
    progress(f"set up; transport under test: {backend}; measuring bandwidth")
    bandwidth = run_bandwidth(rig)
    progress("measuring one-way latency (ping-pong)")
    run_latency(rig, ("nccl", "ours", "ours_depth0", "ours_auto"))
    progress("measuring one-way latency again, each rank on a stream of its own")
    run_latency(rig, tuple(method + OWN_STREAM for method in ("nccl", "ours", "ours_depth0", "ours_auto")))
    progress("measuring GEMM interference on the sender")
    run_gemm(rig, bandwidth)
    progress("measuring the full-SM kernel with a pending receive")
    run_pending(rig)
    if rig.raw is not None:
        progress("measuring the raw peer copy + flag ping-pong (reference floor)")
        run_latency(rig, ("raw_flags", "raw_flags" + OWN_STREAM))


def _tear_down(rig: Rig) -> None:
    import torch.distributed as dist

    rig.sync("tear-down")
    for transport in (rig.fwd, rig.bwd, rig.fwd0, rig.bwd0, rig.fwda, rig.bwda):
        if transport is not None:
            transport.close()
    if rig.raw is not None:
        rig.raw.close_peer()
        rig.barrier()  # both mappings are closed before either buffer is freed
        rig.raw.free()
    if rig.spin is not None:
        rig.spin.unload()
    dist.destroy_process_group()
