"""What ``syncless bench pp`` measures: payload sizes, step counts, repeats and time limits.

Plain Python, no CUDA: the parent process builds a :class:`Plan` and hands it
to the two worker processes, so both ranks agree on every count without a
message. Every payload is one pipeline step of two bf16 tensors (hidden state
and residual) of :data:`HIDDEN` columns, so a payload of ``n`` bytes is
``n / ROW_NBYTES`` token rows: 8 MiB is a 256-token decode step, 256 MiB an
8k-token prefill.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KIB = 1 << 10
MIB = 1 << 20

HIDDEN = 8192
ELEMENT_NBYTES = 2  # bf16
TENSOR_NAMES = ("hidden", "residual")
ROW_NBYTES = len(TENSOR_NAMES) * HIDDEN * ELEMENT_NBYTES  # 32 KiB per token row

FULL_PAYLOADS = (64 * KIB, 1 * MIB, 8 * MIB, 16 * MIB, 64 * MIB, 256 * MIB)
QUICK_PAYLOADS = (64 * KIB, 8 * MIB, 64 * MIB)
#: every size of issue 18's latency table: decode steps (64 KiB to a few MiB) up to an 8k-token prefill
LATENCY_PAYLOADS = (64 * KIB, 1 * MIB, 8 * MIB, 64 * MIB, 256 * MIB)
QUICK_LATENCY_PAYLOADS = (64 * KIB, 1 * MIB, 8 * MIB)
DECODE_STEP_NBYTES = 8 * MIB

# Issue 18's goals for the default setting, judged at every measured size.
#: The tighter latency target and the raw-copy bandwidth target apply from this payload up.
GOAL_SPLIT_NBYTES = 1 * MIB
#: one-way latency, ours / NCCL: at most this below GOAL_SPLIT_NBYTES ...
LATENCY_VS_NCCL_SMALL_TARGET = 1.0
#: ... and at most this from GOAL_SPLIT_NBYTES up.
LATENCY_VS_NCCL_TARGET = 0.8
#: sustained bandwidth, ours / NCCL: at least this at every size.
BANDWIDTH_VS_NCCL_TARGET = 1.0
#: sustained bandwidth, ours / raw peer copy: at least this from GOAL_SPLIT_NBYTES up.
BANDWIDTH_VS_RAW_TARGET = 0.9
PENDING_KERNEL_TARGET = 1.05
#: latency method suffix: run the ping-pong on a created stream of each rank, not the legacy default stream
OWN_STREAM = "@own"


def rows_for(nbytes: int) -> int:
    """Return the token rows of a ``nbytes`` payload (hidden + residual, bf16, 8192 wide).

    Raises:
        ValueError: ``nbytes`` is not a positive multiple of :data:`ROW_NBYTES`.
    """
    if nbytes <= 0 or nbytes % ROW_NBYTES:
        raise ValueError(f"payload must be a positive multiple of {ROW_NBYTES} bytes (one token row); got {nbytes}")
    return nbytes // ROW_NBYTES


def latency_vs_nccl_target(nbytes: int) -> float:
    """Return the most one-way latency of ours may be, as a multiple of NCCL's, at ``nbytes``."""
    return LATENCY_VS_NCCL_TARGET if nbytes >= GOAL_SPLIT_NBYTES else LATENCY_VS_NCCL_SMALL_TARGET


def size_label(nbytes: int) -> str:
    """Return ``"64 KiB"``, ``"8 MiB"`` and so on (binary units)."""
    if nbytes >= MIB and nbytes % MIB == 0:
        return f"{nbytes // MIB} MiB"
    if nbytes >= KIB and nbytes % KIB == 0:
        return f"{nbytes // KIB} KiB"
    return f"{nbytes} B"


def payload_label(nbytes: int) -> str:
    """Return the size label with what the payload stands for, e.g. ``"8 MiB (decode, 256 tokens)"``."""
    rows = rows_for(nbytes)
    if nbytes == DECODE_STEP_NBYTES:
        return f"{size_label(nbytes)} (decode, {rows} tokens)"
    if rows >= 4096:
        return f"{size_label(nbytes)} (prefill, {rows} tokens)"
    return f"{size_label(nbytes)} ({rows} tokens)"


@dataclass(frozen=True)
class Plan:
    """Every count and limit of one benchmark run; identical in the parent and both workers.

    Attributes:
        quick: a smoke run (fewer sizes and repeats), not for quoting.
        payloads: bandwidth payload sizes in bytes.
        latency_payloads: ping-pong payload sizes in bytes.
        bandwidth_reps: timed repeats per payload and method (the median is reported).
        bandwidth_target_nbytes: bytes moved per timed repeat (sets the step count).
        bandwidth_min_steps, bandwidth_max_steps: bounds on steps per timed repeat.
        warmup_steps: untimed steps before each payload's repeats.
        latency_iters: round trips per timed ping-pong repeat (fewer at large sizes: see
            :meth:`latency_iters_for`).
        latency_min_iters: fewest round trips per timed ping-pong repeat.
        latency_target_nbytes: bytes each way per timed ping-pong repeat, beyond which
            :attr:`latency_iters` is cut (a 256 MiB round trip takes about 2 ms).
        latency_reps: good (queued-ahead) ping-pong repeats wanted.
        gemm_n: GEMM size (bf16 ``n x n @ n x n``).
        gemm_window_ms: GPU time of one GEMM loop.
        gemm_rounds: rounds of (alone, NCCL, ours), in rotating order.
        interference_nbytes: payload streamed during the GEMM loop.
        spin_kernel_ms: target duration of the full-SM kernel alone.
        spin_kernels_per_trial: kernels launched while one receive is pending.
        spin_trials: trials per mode (alone, NCCL, ours).
        pending_nbytes: payload of the pending receive.
        cpu_nbytes: payload at which host CPU time per call is judged.
        transport_timeout_s: ``timeout_s`` given to ``make_transport``.
        gpu_wait_timeout_s: longest wait for a GPU section to drain before a worker gives up.
        dist_timeout_s: torch.distributed timeout (gloo barriers, object exchange).
        hard_timeout_s: the parent kills both workers after this long in total.
        idle_timeout_s: the parent kills both workers after this long without a message.
    """

    quick: bool
    payloads: tuple[int, ...]
    latency_payloads: tuple[int, ...] = LATENCY_PAYLOADS
    bandwidth_reps: int = 5
    bandwidth_target_nbytes: int = 2 << 30
    bandwidth_min_steps: int = 20
    bandwidth_max_steps: int = 100
    warmup_steps: int = 3
    latency_iters: int = 40
    latency_min_iters: int = 8
    latency_target_nbytes: int = 2 << 30
    latency_reps: int = 5
    gemm_n: int = 8192
    gemm_window_ms: float = 60.0
    gemm_rounds: int = 3
    interference_nbytes: int = 64 * MIB
    spin_kernel_ms: float = 2.0
    spin_kernels_per_trial: int = 3
    spin_trials: int = 5
    pending_nbytes: int = DECODE_STEP_NBYTES
    cpu_nbytes: int = DECODE_STEP_NBYTES
    transport_timeout_s: float = 30.0
    gpu_wait_timeout_s: float = 30.0
    dist_timeout_s: float = 120.0
    hard_timeout_s: float = 420.0
    idle_timeout_s: float = 90.0

    def __post_init__(self) -> None:
        for nbytes in (*self.payloads, *self.latency_payloads, self.interference_nbytes, self.pending_nbytes):
            rows_for(nbytes)
        if self.cpu_nbytes not in self.payloads:
            raise ValueError(f"cpu_nbytes must be one of the payloads {list(self.payloads)}; got {self.cpu_nbytes}")
        if self.interference_nbytes > self.max_nbytes:
            raise ValueError(
                f"interference_nbytes must be at most the largest payload {self.max_nbytes}; "
                f"got {self.interference_nbytes}"
            )

    @property
    def max_nbytes(self) -> int:
        """Largest payload of any section: sizes the forward transport and the raw buffers."""
        return max(*self.payloads, *self.latency_payloads, self.pending_nbytes)

    @property
    def max_rows(self) -> int:
        """Rows of the forward transport's persistent tensors."""
        return rows_for(self.max_nbytes)

    @property
    def latency_max_rows(self) -> int:
        """Rows of the reverse (rank 1 -> rank 0) transport's persistent tensors."""
        return rows_for(max(self.latency_payloads))

    def steps_for(self, nbytes: int) -> int:
        """Return the steps of one timed bandwidth repeat at ``nbytes`` (bounded both ways)."""
        steps = math.ceil(self.bandwidth_target_nbytes / nbytes)
        return max(self.bandwidth_min_steps, min(self.bandwidth_max_steps, steps))

    def latency_iters_for(self, nbytes: int) -> int:
        """Return the round trips of one timed ping-pong repeat at ``nbytes`` (bounded both ways)."""
        iters = self.latency_target_nbytes // nbytes
        return max(self.latency_min_iters, min(self.latency_iters, iters))

    def as_dict(self) -> dict[str, object]:
        """Return the plan as plain data for the JSON report."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def make_plan(quick: bool) -> Plan:
    """Return the full plan (a few minutes on 2 H200s) or the quick one (under a minute)."""
    if not quick:
        return Plan(quick=False, payloads=FULL_PAYLOADS)
    return Plan(
        quick=True,
        payloads=QUICK_PAYLOADS,
        latency_payloads=QUICK_LATENCY_PAYLOADS,
        bandwidth_reps=2,
        bandwidth_target_nbytes=1 << 30,
        bandwidth_max_steps=60,
        warmup_steps=2,
        latency_iters=20,
        latency_reps=3,
        gemm_window_ms=25.0,
        gemm_rounds=1,
        spin_kernels_per_trial=2,
        spin_trials=3,
        hard_timeout_s=150.0,
        idle_timeout_s=75.0,
    )
