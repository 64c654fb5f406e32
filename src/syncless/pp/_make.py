"""``make_transport``: choose and build a pipeline transport, the same way on every stage."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from syncless._core import config
from syncless._core.errors import ConfigError, CopyEngineUnavailable
from syncless._core.logs import log_once
from syncless.pp import _faults
from syncless.pp import _wire as wire
from syncless.pp._base import Transport
from syncless.pp._copy_engine_setup import INJECTABLE_FAILURES, open_copy_engine
from syncless.pp._group import TRANSPORT_TAG, agree, cpu_group, release_cpu_group, resolve_stages
from syncless.pp._layout import AUTO_DEPTH, TensorSpec, check_depth, persistent_device, specs_from_persistent
from syncless.pp._torch_dist import TorchDistTransport, backend_for

logger = logging.getLogger("syncless.pp")

BACKENDS = ("auto", "copy_engine", "torch_distributed")

#: What each stage's part of make_transport's first exchange must be (it comes from another process).
LAYOUT_CHECK = (
    wire.is_tuple_of(
        lambda specs: type(specs) is dict and all(type(s) is TensorSpec for s in specs.values()),
        lambda depth: type(depth) is int or depth == AUTO_DEPTH,
        wire.is_int,
        wire.is_tuple_of(wire.is_str, wire.is_sequence_of(wire.is_int), wire.is_str, wire.is_str, wire.is_int),
    ),
    'a (dict of name -> TensorSpec, depth (an int or "auto"), auto slots, (backend, stage ranks, device type, '
    "data backend, process id)) tuple",
)

#: What every stage must pass alike besides ``depth``, in the order of the exchange's fourth item (whose
#: fifth field, the process id, differs: the torch.distributed transport records its send link by it).
AGREED = ("backend (or SYNCLESS_PP_TRANSPORT)", "stage_ranks", "device type", "data backend")


def _check_agreement(stages: Any, choices: list[tuple[Any, ...]]) -> None:
    """Raise the same ValueError on every stage when the stages passed different arguments.

    Each stage computed ``choices`` from the same exchange, so every stage raises alike (and none has
    started anything the others have not: the private group stays as usable as after any set-up error).
    ``stage_ranks`` is checked first and named by global rank, since the stages' names differ between
    ranks that disagree on the order.
    """
    orders = [tuple(c[1]) for c in choices]
    if len(set(orders)) > 1:
        by_rank = sorted(zip(stages.ranks, orders))
        listing = ", ".join(f"rank {rank}: {order}" for rank, order in by_rank)
        raise ValueError(f"make_transport: every stage must pass the same stage_ranks; got {listing}")
    for position in (0, 3, 2):  # the data backend before the device type: it is what would break the link
        what = AGREED[position]
        values = [repr(c[position]) for c in choices]
        if len(set(values)) == 1:
            continue
        listing = ", ".join(f"{stages.name(i)}: {v}" for i, v in enumerate(values))
        extra = ""
        if what == "data backend":
            devices = ", ".join(f"{stages.name(i)}: {c[2]}" for i, c in enumerate(choices))
            extra = (f" (the device types are {devices}): the data of one link must go over one backend, so "
                     "put every stage's persistent tensors on the same kind of device")
        elif what == "device type":
            extra = " (from `persistent`, or `device` on a stage without one): put every stage on one kind of device"
        raise ValueError(f"make_transport: every stage must pass the same {what}; got {listing}{extra}")


def _resolve_device(persistent: Mapping[str, torch.Tensor] | None, device: Any) -> torch.device:
    held = persistent_device(persistent)
    if device is None:
        if held is not None:
            chosen = held
        elif torch.cuda.is_available():
            chosen = torch.device("cuda", torch.cuda.current_device())
        else:
            chosen = torch.device("cpu")
    else:
        chosen = torch.device(device)
    if chosen.type == "cuda" and chosen.index is None:
        chosen = torch.device("cuda", torch.cuda.current_device())
    elif chosen.type == "cpu":
        chosen = torch.device("cpu")  # "cpu:0" is the CPU too, and CPU tensors report plain "cpu"
    if held is not None and held != chosen:
        raise ValueError(f"device={chosen} but the persistent tensors are on {held}")
    return chosen


def _groups_of(group: Any) -> tuple[Any, Any]:
    """Return ``(CPU group, device group)`` for ``make_transport``'s ``group`` (one process group: both).

    vLLM's and SGLang's ``GroupCoordinator`` hold both: a gloo ``cpu_group`` and the ``device_group``
    (NCCL) over the same ranks.

    Raises:
        TypeError: ``group`` is neither a process group nor an object with both groups.
        ValueError: its two groups hold different ranks.
    """
    import torch.distributed as dist

    if group is None:
        group = dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group, group
    cpu, device = getattr(group, "cpu_group", None), getattr(group, "device_group", None)
    if isinstance(cpu, dist.ProcessGroup) and isinstance(device, dist.ProcessGroup):
        cpu_ranks, device_ranks = dist.get_process_group_ranks(cpu), dist.get_process_group_ranks(device)
        if sorted(cpu_ranks) != sorted(device_ranks):
            raise ValueError(
                f"make_transport: {type(group).__name__}.cpu_group holds ranks {cpu_ranks} but its device_group "
                f"{device_ranks}; pass one process group (the pipeline group of this rank)"
            )
        return cpu, device
    held = ", ".join(f"{name}={type(value).__name__}" for name, value in (("cpu_group", cpu), ("device_group", device))
                     if value is not None)
    raise TypeError(
        f"make_transport takes a torch.distributed ProcessGroup (or None for the world), or a coordinator with "
        f"both cpu_group and device_group process groups (vLLM's and SGLang's GroupCoordinator); got "
        f"{type(group).__name__}{f' ({held})' if held else ''}: pass pp_group.device_group (or the coordinator)"
    )


def make_transport(
    group: Any,
    persistent: Mapping[str, torch.Tensor] | None,
    *,
    stage_ranks: Sequence[int] | None = None,
    backend: str | None = None,
    timeout_s: float | None = None,
    device: Any = None,
    depth: int | str = 2,
    _inject_failure: str | None = None,
) -> Transport:
    """Build the transport between this stage and its neighbours; collective over ``group``.

    Every stage calls it with the same ``group``, ``stage_ranks``,
    ``backend`` and ``depth``, and the same number of times (each call makes
    a new private gloo group over the stages' ranks, never reused: after a
    failure every stage simply calls ``make_transport`` again, on the same
    group or a new one; ``docs/pp.md``: rebuilding). Blocks the host for the
    group's rendezvous and a few exchanges over it, and on the copy-engine
    path until a private stream has zeroed this stage's buffer and run a
    16-byte trial of batched copies into the next stage's scratch bytes.
    Enqueues nothing on the caller's streams.

    Args:
        group: a torch.distributed process group, None for the world, or a coordinator holding
            ``cpu_group`` and ``device_group`` (vLLM's and SGLang's ``GroupCoordinator``: the
            torch.distributed transport then sends CUDA data over ``device_group`` and CPU data over
            ``cpu_group``).
        persistent: name -> this stage's preallocated receive tensors
            (leading dimension = the most rows a step may carry, contiguous);
            None or ``{}`` on the first stage.
        stage_ranks: global ranks in pipeline order; default the group's ranks
            ascending. Stage i sends to stage i+1. Two stages may share a GPU.
        backend: ``"auto"`` (copy engines when every stage can use them,
            else torch.distributed, logged once with the reason),
            ``"copy_engine"`` or ``"torch_distributed"``; None reads
            ``SYNCLESS_PP_TRANSPORT``.
        timeout_s: how long a stage waits for its peer before raising
            :class:`~syncless.PeerTimeoutError`, from 0.1 s to one day; None reads
            ``SYNCLESS_PP_TIMEOUT_S``.
        device: this stage's device when ``persistent`` does not say it
            (the first stage); default the current CUDA device, else the CPU.
        depth: how many steps may be in flight on each link (an int >= 0).
            The copy-engine transport keeps ``depth`` receive slots on the
            receiver (each as large as its persistent tensors), so the peer
            copy of step N overlaps the receiver's compute and its copy of
            step N-1 out of its slot, and the sender's stream waits only when
            the receiver's is ``depth`` steps behind. ``0`` keeps no slots:
            the sender copies straight into the persistent tensors once the
            receiver's stream reached ``recv()`` for that step, which saves
            the receiver's copy (the lowest latency when the receiver is
            already waiting: ``docs/pp.md`` has the figures) but holds the
            sender until then. The persistent tensors must then sit in
            allocations that hold nothing else (``alloc_persistent`` makes
            them) and that CUDA IPC can share (not
            ``expandable_segments``), else set-up raises
            :class:`~syncless.CopyEngineUnavailable` (``"auto"`` falls back).
            ``"auto"`` (opt-in) chooses per step: straight into the
            persistent tensors when the receiver's host has already posted
            ``recv()`` for that step and they are shareable (as for ``0``),
            else through one of ``SYNCLESS_PP_AUTO_SLOTS`` slots (as for
            ``depth >= 1``); persistent tensors that cannot be shared are
            no error there, the link then always uses the slots
            (``transport.direct_unavailable_reason`` says why).
            The torch.distributed transport checks it and ignores it (its
            backend queues the sends itself).
        _inject_failure: tests only: ``"mem_ops"`` or ``"peer_open"`` makes
            this rank's copy-engine set-up fail at that step.

    Raises:
        CopyEngineUnavailable: ``backend="copy_engine"`` and some stage cannot
            use copy engines (no NVLink, ``CUDA_DEVICE_MAX_CONNECTIONS=1``, ...);
            raised on every stage with the same message.
        ValueError, TypeError: bad arguments (on every stage, naming the stage),
            stages passing different ``depth`` included; ``group`` that is no process group nor a
            coordinator holding both (``TypeError``, on this stage, before any collective).
        ConfigError: ``timeout_s`` (or ``SYNCLESS_PP_TIMEOUT_S``) is out of bounds (also a ``ValueError``).
        PeerTimeoutError: a stage did not take part in set-up.
        TransportSetupError: set-up failed otherwise on some stage (raised alike everywhere), e.g. a
            stage shared depth-0 targets outside the memory it shared.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("make_transport needs torch.distributed: call torch.distributed.init_process_group first")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} or None; got {backend!r}")
    if _inject_failure is not None and _inject_failure not in INJECTABLE_FAILURES:
        raise ValueError(f"_inject_failure must be one of {INJECTABLE_FAILURES}; got {_inject_failure!r}")
    choice = config.resolve("SYNCLESS_PP_TRANSPORT", backend)
    if timeout_s is None:
        timeout = float(config.read("SYNCLESS_PP_TIMEOUT_S"))
    else:
        timeout = config.check_pp_timeout(timeout_s, "timeout_s")
    groups = _groups_of(group)
    stages = resolve_stages(dist.get_process_group_ranks(groups[1]), dist.get_rank(), stage_ranks)
    side = cpu_group(stages.ranks, timeout)  # a new one for every transport: see cpu_group
    try:
        return _build(side, groups, stages, persistent, choice, timeout, device, depth, _inject_failure)
    except BaseException:
        # Every stage raises here alike (the outcomes are agreed) or after its own timeout: each destroys
        # its group, so the stages hold the same groups for the next make_transport (see cpu_group).
        release_cpu_group(side, f"{stages.name()} make_transport")
        raise


def _build(side: Any, groups: tuple[Any, Any], stages: Any, persistent: Mapping[str, torch.Tensor] | None, choice: str,
           timeout: float, device: Any, depth: int | str, _inject_failure: str | None) -> Transport:
    """make_transport's collective part, over this transport's private gloo group ``side``."""
    _faults.reach("setup:layout")

    resolved: dict[str, Any] = {}

    def local_layout() -> tuple[dict[str, TensorSpec], int | str, int, tuple[str, list[int], str, str, int]]:
        layout = specs_from_persistent(persistent)  # first: a malformed `persistent` is a TypeError naming it
        checked_depth = check_depth(depth)
        try:  # read inside the exchange, so that a bad value is raised alike on every stage
            slots = config.read("SYNCLESS_PP_AUTO_SLOTS") if checked_depth == AUTO_DEPTH else 0
            # Only the sender uses it (the path travels with each step), so stages may differ.
            resolved["min_nbytes"] = config.read("SYNCLESS_PP_AUTO_DIRECT_MIN_BYTES") if slots else 0
        except ConfigError as err:  # shared as the ValueError it is (agree passes on ValueError and TypeError)
            raise ValueError(str(err)) from err
        chosen = resolved["device"] = _resolve_device(persistent, device)
        group = resolved["group"] = groups[0] if chosen.type == "cpu" else groups[1]
        data_backend = "gloo" if chosen.type == "cpu" else backend_for(group, chosen.type)
        return layout, checked_depth, slots, (choice, list(stages.ranks), chosen.type, data_backend, os.getpid())

    shared = agree(side, stages, "make_transport", local_layout, check=LAYOUT_CHECK)
    _check_agreement(stages, [agreed for _, _, _, agreed in shared])
    specs = [layout for layout, _, _, _ in shared]
    depths = [stage_depth for _, stage_depth, _, _ in shared]
    # Every stage sizes its neighbours' slots from its own depth, so all must agree;
    # every rank sees the same list and raises the same error.
    if len(set(map(repr, depths))) > 1:
        listing = ", ".join(f"{stages.name(i)}: {d!r}" for i, d in enumerate(depths))
        raise ValueError(f"make_transport: every stage must pass the same depth; got {listing}")
    all_slots = [slots for _, _, slots, _ in shared]
    if len(set(all_slots)) > 1:
        listing = ", ".join(f"{stages.name(i)}: {n}" for i, n in enumerate(all_slots))
        raise ValueError(
            f'make_transport(depth="auto"): every stage must set the same SYNCLESS_PP_AUTO_SLOTS; got {listing}'
        )
    my_depth = depths[stages.index]
    my_device = resolved["device"]
    recv_specs = specs[stages.index] if stages.prev_rank is not None else {}
    send_specs = specs[stages.index + 1] if stages.next_rank is not None else None
    if stages.prev_rank is None:
        specs = [recv_specs, *specs[1:]]

    fallback_reason = None
    setup_leaked_nbytes = 0
    if choice in ("auto", "copy_engine"):
        try:
            return open_copy_engine(
                side_group=side,
                stages=stages,
                specs=specs,
                persistent=persistent or {},
                device=my_device,
                timeout_s=timeout,
                depth=my_depth,
                auto_slots=all_slots[stages.index],
                auto_direct_min_nbytes=resolved["min_nbytes"],
                inject_failure=_inject_failure,
            )
        except CopyEngineUnavailable as err:
            if choice == "copy_engine":
                raise
            fallback_reason = str(err)
            setup_leaked_nbytes = err.leaked_nbytes  # kept by the failed set-up: the fallback reports it
            log_once(
                logger,
                logging.WARNING,
                f"pp-fallback:{fallback_reason}",
                "syncless.pp: using torch.distributed instead of copy engines: %s",
                fallback_reason,
            )
    return TorchDistTransport(
        group=resolved["group"],
        side_group=side,
        stages=stages,
        tag=TRANSPORT_TAG,
        recv_specs=recv_specs,
        send_specs=send_specs,
        persistent=persistent or {},
        device=my_device,
        timeout_s=timeout,
        fallback_reason=fallback_reason,
        setup_leaked_nbytes=setup_leaked_nbytes,
        depth=my_depth,
        next_pid=shared[stages.index + 1][3][4] if stages.next_rank is not None else None,
    )
