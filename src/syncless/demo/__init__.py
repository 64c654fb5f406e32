"""``syncless demo``: one pipelined decode, run with syncless's transport and with torch.distributed.

A transformer with random weights is split into stages over the GPUs
present (two CPU processes over gloo where there is none). The same decode
loop runs twice in the same processes: first with ``make_transport``'s
choice (copy engines where eligible), then with its ``torch_distributed``
backend (NCCL ``isend``/``irecv`` on GPUs, gloo on the CPU). Inputs are
uploaded ``non_blocking``, tokens read back on a D2H stream, the hot loop
checked for hidden syncs in ``record`` mode, and the CC shim installed when
CC is on or emulated. With two GPU stages it also times a kernel that needs
every SM on the receiving stage while a receive is pending, against the
kernel alone (``syncless.bench``'s measurement). See ``docs/pp.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import TYPE_CHECKING

from syncless._core import config
from syncless._core.hardware import cuda_device_count
from syncless._core.launch import RanksTimedOut, run_ranks
from syncless._core.exits import UsageError
from syncless.demo._config import (
    DEFAULT_CPU_BATCH,
    DEFAULT_CPU_MODEL,
    DEFAULT_CPU_STEPS,
    DEFAULT_GPU_BATCH,
    DEFAULT_GPU_MODEL,
    DEFAULT_GPU_STEPS,
    PRESETS,
    split_layers,
    stage_nbytes,
)

if TYPE_CHECKING:  # the stage code imports torch: only when the demo runs, not when the CLI starts
    from syncless.demo._stage import DemoOptions

__all__ = ["add_arguments", "plan", "run"]

#: The labels of the two runs, in the order they run.
SYNCLESS_RUN = "syncless"
BASELINE_RUN = "torch.distributed"


def whole_number(minimum: int):
    """An argparse type: an int of at least ``minimum``, with a message that names the value and the bound."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds greater than 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``demo`` subcommand's arguments."""
    parser.add_argument("--model", choices=sorted(PRESETS), default=None,
                        help=f"model size (default: {DEFAULT_GPU_MODEL} on GPUs, {DEFAULT_CPU_MODEL} on the CPU)")
    parser.add_argument("--steps", type=whole_number(1), default=None,
                        help=f"decode steps measured per run (default: {DEFAULT_GPU_STEPS} on GPUs, "
                             f"{DEFAULT_CPU_STEPS} on the CPU)")
    parser.add_argument("--batch", type=whole_number(1), default=None,
                        help=f"sequences per micro-batch (default: {DEFAULT_GPU_BATCH} on GPUs, "
                             f"{DEFAULT_CPU_BATCH} on the CPU)")
    parser.add_argument("--micro-batches", type=whole_number(1), default=None,
                        help="micro-batches in flight (default: one per stage)")
    parser.add_argument("--stages", type=whole_number(1), default=None,
                        help="pipeline stages (default: one per GPU, 2 CPU processes without GPU); stages may share "
                             "a GPU; at most the model's layer count")
    parser.add_argument("--transport", choices=["auto", "copy_engine", "torch_distributed"], default=None,
                        help="syncless's run: which transport make_transport builds (default: SYNCLESS_PP_TRANSPORT, "
                             "auto: copy engines where eligible)")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false",
                        help="skip the second run with torch.distributed (default: run it)")
    parser.add_argument("--plant-sync", action="store_true",
                        help="add a .item() to the last stage's hot loop, to see the detector catch it (default: off)")
    parser.add_argument("--cc", choices=["auto", "on", "off", "emulate"], default=None,
                        help="Confidential Computing mode on GPUs (default: SYNCLESS_CC, auto)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (gloo) even where GPUs are present")
    parser.add_argument("--timeout-s", type=positive_seconds, default=600.0,
                        help="give up, and stop every stage, after this many seconds (default: 600)")


def shares_a_gpu(devices: list[str]) -> bool:
    """Whether two stages run on one GPU (NCCL, the baseline's backend there, refuses that)."""
    gpus = [d for d in devices if d.startswith("cuda")]
    return len(set(gpus)) < len(gpus)


def plan(args: argparse.Namespace, gpus: int) -> DemoOptions:
    """Turn arguments and the GPU count into the options every stage runs with.

    Raises:
        UsageError: the options cannot run together (the message says what to change).
    """
    from syncless.demo._stage import DemoOptions

    on_gpu = gpus > 0
    stages = args.stages if args.stages is not None else (gpus if on_gpu else 2)
    model_name = args.model or (DEFAULT_GPU_MODEL if on_gpu else DEFAULT_CPU_MODEL)
    model = PRESETS[model_name]
    if stages > model.layers:
        raise UsageError(f"--stages {stages} is more than the {model_name} model's {model.layers} layers; "
                         f"use --stages {model.layers} or fewer, or a larger --model")
    if not on_gpu:
        # One check for a flag and its variable: the stages would read the variable and fail (transport)
        # or ignore it (CC) only after they started.
        or_cpu = " or --cpu" if args.cpu else ""
        cc_mode, cc_from = _flag_or_setting(args.cc, "--cc", "SYNCLESS_CC")
        if cc_mode in ("on", "emulate"):
            raise UsageError(f"{cc_from} needs a GPU: a CPU run has no host<->device copies; "
                             + ("drop --cc" if cc_from.startswith("--") else "unset SYNCLESS_CC") + or_cpu)
        transport, transport_from = _flag_or_setting(args.transport, "--transport", "SYNCLESS_PP_TRANSPORT")
        if transport == "copy_engine":
            raise UsageError(f"{transport_from} needs CUDA GPUs; "
                             + ("drop it" if transport_from.startswith("--") else "unset SYNCLESS_PP_TRANSPORT")
                             + or_cpu)
    steps = args.steps if args.steps is not None else (DEFAULT_GPU_STEPS if on_gpu else DEFAULT_CPU_STEPS)
    batch = args.batch if args.batch is not None else (DEFAULT_GPU_BATCH if on_gpu else DEFAULT_CPU_BATCH)
    micro = args.micro_batches if args.micro_batches is not None else stages
    devices = [f"cuda:{stage % gpus}" for stage in range(stages)] if on_gpu else ["cpu"] * stages
    warmup = 4
    model = dataclasses.replace(model, max_tokens=max(model.max_tokens, steps + warmup))
    side_by_side = args.baseline and stages > 1 and not shares_a_gpu(devices)
    runs = [SYNCLESS_RUN, BASELINE_RUN] if side_by_side else [SYNCLESS_RUN]
    return DemoOptions(model=model, model_name=model_name, steps=steps, batch=batch, micro_batches=micro,
                       stages=stages, devices=devices, runs=runs,
                       transport=None if args.transport in (None, "auto") else args.transport, cc_mode=args.cc,
                       warmup_steps=warmup, progress_every=max(1, steps // 2), plant_sync=args.plant_sync,
                       measure_pending=on_gpu and stages == 2 and devices[0] != devices[1])


def _flag_or_setting(flag_value: str | None, flag: str, name: str) -> tuple[str, str]:
    """The value a stage will use, and where it comes from as the user wrote it (``--cc on``, ``SYNCLESS_CC=on``)."""
    if flag_value is not None:
        return flag_value, f"{flag} {flag_value}"
    value = config.read(name)
    return value, f"{name}={value}"


#: What each CPU stage process holds besides the model: an interpreter with torch imported measured
#: 0.23 GiB here; gloo and the transports' buffers come on top. Rounded up.
CPU_STAGE_OVERHEAD_NBYTES = 1 << 29


def cpu_memory_nbytes(options: DemoOptions) -> int:
    """Host bytes the stages of a CPU run need together (float32 weights and caches, plus each process's own)."""
    ranges = split_layers(options.model.layers, options.stages)
    rows = options.batch * options.micro_batches
    return sum(stage_nbytes(options.model, len(layers), first=index == 0, last=index == options.stages - 1,
                            rows=rows, element_nbytes=4) + CPU_STAGE_OVERHEAD_NBYTES
               for index, layers in enumerate(ranges))


def check_cpu_memory(options: DemoOptions, available_nbytes: int | None) -> None:
    """Refuse a CPU run whose stages would not fit in the memory available (the kernel would kill one).

    Raises:
        UsageError: it would not fit; the message gives both sizes and a preset that fits.
    """
    if available_nbytes is None:
        return
    needed = cpu_memory_nbytes(options)
    if needed <= available_nbytes:
        return
    fits = [name for name in sorted(PRESETS, key=lambda n: PRESETS[n].hidden * PRESETS[n].layers)
            if name != options.model_name
            and cpu_memory_nbytes(dataclasses.replace(options, model=PRESETS[name], model_name=name)) <= available_nbytes]
    hint = f"use --model {fits[-1]}" if fits else "free some memory"
    raise UsageError(f"the {options.model_name} model needs about {needed / (1 << 30):.1f} GiB of memory on the CPU "
                     f"({options.stages} stages, float32 weights and caches) and this machine has "
                     f"{available_nbytes / (1 << 30):.1f} GiB available; {hint}, or fewer --batch/--micro-batches")


def host_available_nbytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def run(args: argparse.Namespace) -> int:
    """Run the demo and print its summary; return 0 if the hot loop had no sync but the planted one."""
    from syncless.demo._stage import run_stage
    from syncless.demo._summary import format_summary, unplanted_sync_count

    gpus = 0 if args.cpu else cuda_device_count()
    options = plan(args, gpus)
    if gpus == 0:
        check_cpu_memory(options, host_available_nbytes())
    where = f"{gpus} GPU(s)" if gpus else "the CPU" + ("" if args.cpu else " (no GPU found)")
    runs = " and ".join(options.runs)
    if args.baseline and options.stages > 1 and shares_a_gpu(options.devices):
        runs += (f" (no {BASELINE_RUN} run: its NCCL backend refuses two ranks on one GPU, and "
                 f"{options.stages} stages share {gpus} GPU(s))")
    print(f"syncless demo: {options.stages} stage(s) on {where}, model {options.model_name} "
          f"(hidden {options.model.hidden}, {options.model.layers} layers), {options.steps} steps x "
          f"{options.micro_batches} micro-batch(es) x {options.batch} sequences, run with {runs}", flush=True)
    backend = "cpu:gloo,cuda:nccl" if gpus else "gloo"
    start_s = time.perf_counter()
    try:
        results = run_ranks(run_stage, options.stages, args=(options,), backend=backend, timeout_s=args.timeout_s)
    except RanksTimedOut as err:
        raise RanksTimedOut(f"the stages gave no result within --timeout-s {args.timeout_s:g} and were stopped; "
                            f"raise --timeout-s (the default is 600)") from err
    print(format_summary(options, results, time.perf_counter() - start_s))
    return 0 if unplanted_sync_count(results) == 0 else 1
