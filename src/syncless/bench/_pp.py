"""``syncless bench pp``: the copy-engine transport against NCCL and the raw peer copy, in one run.

Two worker processes, one per GPU, measure on the same machine in the same
run (see :mod:`._pp_measure` and :mod:`._pp_interfere` for how):

1. sustained bandwidth from 64 KiB to 256 MiB per step: ours
   (``transport.send``/``recv``), torch.distributed NCCL send/recv, and a raw
   peer ``cuMemcpyAsync`` into a CUDA-IPC-opened buffer;
2. one-way GPU latency by ping-pong at 64 KiB, 1 MiB and 8 MiB (ours, ours
   with ``depth=0``, NCCL, and the raw copy + flag floor), on the default
   stream and again with each rank on a stream of its own;
3. interference: a bf16 GEMM on the sending GPU while the link streams, and a
   kernel that needs every SM on the receiving GPU while a receive is pending;
4. host CPU time per ``send()`` / ``recv()`` against NCCL's calls (timed
   inside the bandwidth loops).

Needs two CUDA GPUs of one node. The parent process only starts the
workers, relays their progress and writes the report; it blocks until they
finish or are stopped by the plan's time limits.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from syncless._core.errors import MissingDependencyError
from syncless._core.hardware import cuda_device_count
from syncless.bench._pp_launch import launch
from syncless.bench._pp_plan import make_plan
from syncless.bench._pp_summary import build_output
from syncless.bench._report import BenchOutput

REQUIRED_GPUS = 2


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> BenchOutput:
    """Run the pp benchmark (``args.quick`` for a smoke run) and return its report.

    Blocks the host for the whole run (about 3 minutes full, under 1 quick).

    Raises:
        MissingDependencyError: fewer than two CUDA GPUs are visible.
    """
    plan = make_plan(quick=bool(getattr(args, "quick", False)))
    available = cuda_device_count()
    if available < REQUIRED_GPUS:
        raise MissingDependencyError(
            f"syncless bench pp needs {REQUIRED_GPUS} CUDA GPUs of one node (one worker process per GPU); "
            f"found {available}. Run it on a machine with two NVLink-connected GPUs "
            "(CUDA_VISIBLE_DEVICES must expose both)."
        )
    progress(
        f"{'quick' if plan.quick else 'full'} run: payloads {len(plan.payloads)}, "
        f"hard limit {plan.hard_timeout_s:.0f} s"
    )
    outcome = launch(plan, progress)
    return build_output(plan, outcome)
