"""``syncless demo``: a pipelined decode loop that uses all three capabilities.

A small transformer with random weights is split into stages over the GPUs
present (two CPU processes over gloo where there is none). Inputs are
uploaded ``non_blocking``, tokens read back on a D2H stream, activations
moved by ``make_transport``, the hot loop checked for hidden syncs in
``record`` mode, and the CC shim installed when CC is on or emulated.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import TYPE_CHECKING

from syncless._core.hardware import cuda_device_count
from syncless._core.launch import run_ranks
from syncless.demo._config import PRESETS

if TYPE_CHECKING:  # the stage code imports torch: only when the demo runs, not when the CLI starts
    from syncless.demo._stage import DemoOptions

__all__ = ["add_arguments", "plan", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``demo`` subcommand's arguments."""
    parser.add_argument("--model", choices=sorted(PRESETS), default=None,
                        help="model size (default: small on GPUs, tiny on the CPU)")
    parser.add_argument("--steps", type=int, default=None, help="decode steps measured (default: 256 on GPUs, 32 on the CPU)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=None, help="micro-batches in flight (default: one per stage)")
    parser.add_argument("--stages", type=int, default=None,
                        help="pipeline stages (default: one per GPU, 2 CPU processes without GPU); stages may share a GPU")
    parser.add_argument("--transport", choices=["auto", "copy_engine", "torch_distributed"], default=None,
                        help="pipeline transport (default: SYNCLESS_PP_TRANSPORT, auto)")
    parser.add_argument("--cc", choices=["auto", "on", "off", "emulate"], default=None,
                        help="Confidential Computing mode (default: SYNCLESS_CC, auto)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (gloo) even where GPUs are present")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="give up (and kill every stage) after this long")


def plan(args: argparse.Namespace, gpus: int) -> DemoOptions:
    """Turn arguments and the GPU count into the options every stage runs with."""
    from syncless.demo._stage import DemoOptions

    on_gpu = gpus > 0
    stages = args.stages if args.stages is not None else (gpus if on_gpu else 2)
    if stages < 1:
        raise ValueError(f"--stages must be at least 1, got {stages}")
    model = PRESETS[args.model or ("small" if on_gpu else "tiny")]
    if stages > model.layers:
        raise ValueError(f"--stages {stages} exceeds the model's {model.layers} layers; pick a larger --model")
    steps = args.steps if args.steps is not None else (256 if on_gpu else 32)
    if steps < 1 or args.batch < 1:
        raise ValueError(f"--steps and --batch must be positive, got {steps} and {args.batch}")
    micro = args.micro_batches if args.micro_batches is not None else stages
    devices = [f"cuda:{stage % gpus}" for stage in range(stages)] if on_gpu else ["cpu"] * stages
    warmup = 4
    model = dataclasses.replace(model, max_tokens=max(model.max_tokens, steps + warmup))
    return DemoOptions(model=model, steps=steps, batch=args.batch, micro_batches=micro, stages=stages, devices=devices,
                       transport=None if args.transport in (None, "auto") else args.transport, cc_mode=args.cc,
                       warmup_steps=warmup, progress_every=max(1, steps // 4))


def run(args: argparse.Namespace) -> int:
    """Run the demo and print its summary; return 0 if the hot loop had no unallowed sync."""
    from syncless.demo._stage import run_stage
    from syncless.demo._summary import format_summary

    gpus = 0 if args.cpu else cuda_device_count()
    options = plan(args, gpus)
    where = f"{gpus} GPU(s)" if gpus else "the CPU (no GPU found)"
    print(f"syncless demo: {options.stages} stage(s) on {where}, model {options.model.hidden}x{options.model.layers}, "
          f"{options.steps} steps x {options.micro_batches} micro-batch(es) x {options.batch} sequences", flush=True)
    backend = "cpu:gloo,cuda:nccl" if gpus else "gloo"
    start_s = time.perf_counter()
    results = run_ranks(run_stage, options.stages, args=(options,), backend=backend, timeout_s=args.timeout_s)
    print(format_summary(options, results, time.perf_counter() - start_s))
    return 0 if not any(r.syncs for r in results) else 1
