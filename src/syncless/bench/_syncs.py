"""``syncless bench syncs``: what the hidden-sync detector costs, side by side with the plain path.

Measured in one run, host time per call (median of repeats of a timed loop):

* a disabled ``allowed()`` (mode off: one shared no-op context manager)
  against a bare ``with nullcontext()``; goal: at most 1.5x;
* entering and leaving a checked region (``with checking()`` and a
  ``@checked`` call) against a plain block and a plain call;
* ``Tensor.copy_`` and ``Tensor.to`` wrapped by the detector against the
  originals, outside a checked region (goal: at most 0.5 us added per call)
  and inside one (the classification runs; no goal);
* with the CUPTI backend (on a GPU with cupti-python): a kernel launch
  (``x.add_(1)``, enqueued on the current stream) outside and inside a
  checked region against the torch backend (goal: at most 0.5 us added
  inside a region), entering and leaving a region (CUPTI is subscribed and
  let go), a non-blocking pinned copy inside a region (its callback runs and
  asks the driver what memory it copies), and a detected sync: a raw
  ``cuStreamSynchronize`` on an idle stream, reported each time;
* the timeline (``syncs.record_timeline``, torch.profiler, NVTX): the check
  made per recorded sync while every sink is off (a flag read and torch's
  profiler flag), and the time each sink adds to one recorded sync (an
  ``.item()`` of an idle GPU tensor; on the CPU the stand-in warning)
  against the same sync allowed (not recorded, nothing emitted) under the
  same sinks.

On a GPU the copies are ``non_blocking`` pinned host-to-device copies of
4 KiB (enqueued on the current stream; the host only enqueues) and the real
debug mode is armed; on a CPU-only machine they are small CPU copies and a
stand-in for torch's debug-mode switch is used, so the Python side is
measured either way.
"""

from __future__ import annotations

import contextlib
import importlib.util
import statistics
import time
from collections.abc import Callable
from typing import Any

from syncless.bench._report import BenchOutput, Goal
from syncless.syncs import _backend

ALLOWED_GOAL_RATIO = 1.5
COPY_GOAL_ADDED_US = 0.5
LAUNCH_GOAL_ADDED_US = 0.5
LAUNCH_BATCH = 256  # launches per timed batch: well under the launch queue, so the host never waits for it


def _ns_per_call(body: Callable[[int], None], loops: int, repeats: int) -> float:
    """Median over ``repeats`` of the time per iteration of ``body(loops)``."""
    body(max(loops // 10, 1))  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        body(loops)
        samples.append((time.perf_counter_ns() - start) / loops)
    return statistics.median(samples)


def _context_loop(factory: Callable[[], Any]) -> Callable[[int], None]:
    def body(n: int) -> None:
        for _ in range(n):
            with factory():
                pass

    return body


def _call_loop(fn: Callable[[], Any]) -> Callable[[int], None]:
    def body(n: int) -> None:
        for _ in range(n):
            fn()

    return body


COPY_BATCH = 256  # copies per timed batch: well under the GPU's launch queue, so the host never waits for it


def _copy_ops(torch: Any, on_gpu: bool) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """Each measured copy as (original, wrapped) callables on the same tensors.

    The original calls the function beneath every syncless layer directly, so
    both run in the same process state and can be interleaved batch by batch.
    """
    from syncless._core import patching

    copy_original = patching.original(torch.Tensor, "copy_")
    to_original = patching.original(torch.Tensor, "to")
    if on_gpu:
        device = torch.device("cuda", 0)
        src = torch.randn(1024).pin_memory()  # 4 KiB
        dst = torch.empty(1024, device=device)
        to_args: tuple[Any, ...] = (device,)
        kwargs = {"non_blocking": True}
    else:
        src = torch.randn(1024)
        dst = torch.empty(1024)
        to_args = (torch.float64,)
        kwargs = {}
    return {
        "Tensor.copy_": (lambda: copy_original(dst, src, **kwargs), lambda: dst.copy_(src, **kwargs)),
        "Tensor.to": (lambda: to_original(src, *to_args, **kwargs), lambda: src.to(*to_args, **kwargs)),
    }


def _interleaved_copy_ns(torch: Any, on_gpu: bool, original: Callable[[], Any], wrapped: Callable[[], Any],
                         batches: int, in_region: Callable[[], Any] | None = None) -> tuple[float, float]:
    """Median ns per call of ``original`` and ``wrapped``, timed in alternating batches.

    The GPU queue is drained (outside the timed part) before every batch, so
    what is timed is the host's cost of enqueuing, not the copies themselves.
    """
    from syncless.syncs import allowed

    samples: dict[str, list[float]] = {"original": [], "wrapped": []}
    for index in range(batches + 2):
        order = (("original", original), ("wrapped", wrapped))
        for name, op in order if index % 2 else reversed(order):
            if on_gpu:
                with allowed():  # a deliberate wait, outside the timed part
                    torch.cuda.synchronize()
            region = in_region() if (in_region is not None and name == "wrapped") else contextlib.nullcontext()
            with region:
                start = time.perf_counter_ns()
                for _ in range(COPY_BATCH):
                    op()
                elapsed = time.perf_counter_ns() - start
            if index >= 2:  # the first two rounds warm up
                samples[name].append(elapsed / COPY_BATCH)
    return statistics.median(samples["original"]), statistics.median(samples["wrapped"])


def _batch_ns(torch: Any, op: Callable[[], Any], batches: int, batch: int, region: Callable[[], Any] | None) -> float:
    """Median ns per ``op`` over ``batches`` timed batches (the GPU drained before each, outside the timing)."""
    from syncless.syncs import allowed

    samples = []
    with (region() if region is not None else contextlib.nullcontext()):
        for index in range(batches + 2):
            with allowed():
                torch.cuda.synchronize()
            start = time.perf_counter_ns()
            for _ in range(batch):
                op()
            if index >= 2:
                samples.append((time.perf_counter_ns() - start) / batch)
    return statistics.median(samples)


def measure_cupti(torch: Any, batches: int, progress: Callable[[str], None]) -> tuple[list[list[Any]], dict[str, Any]]:
    """The CUPTI backend's costs (see the module docstring); the detector is enabled in record mode.

    Returns (rows, data); rows are ``[what, torch backend ns, cupti backend ns, added us]``.
    """
    from cuda.bindings import driver

    from syncless import syncs

    x = torch.zeros(1, device="cuda")
    pinned = torch.randn(1024).pin_memory()
    target = torch.empty(1024, device="cuda")
    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)

    def launch() -> None:
        x.add_(1)

    def pinned_copy() -> None:
        target.copy_(pinned, non_blocking=True)

    def raw_sync() -> None:
        driver.cuStreamSynchronize(stream)

    def region() -> None:
        with syncs.checking():
            pass

    results: dict[str, dict[str, float]] = {}
    for backend in ("torch", "cupti"):
        syncs.disable()
        syncs.set_backend(backend)
        syncs.reset()
        if not syncs.enable():
            raise RuntimeError("the detector could not be enabled for the benchmark")
        if backend == "cupti" and syncs.backend_choice().active != "cupti":
            raise RuntimeError(f"CUPTI was not used: {syncs.backend_choice().reason}")
        launch()
        results[backend] = {
            "launch, outside a region": _batch_ns(torch, launch, batches, LAUNCH_BATCH, None),
            "launch, inside a region": _batch_ns(torch, launch, batches, LAUNCH_BATCH, syncs.checking),
            "non-blocking pinned copy_ inside a region": _batch_ns(torch, pinned_copy, batches, LAUNCH_BATCH, syncs.checking),
            "enter + leave a checked region": _batch_ns(torch, region, batches, 64, None),
            "raw cuStreamSynchronize (idle) inside a region": _batch_ns(torch, raw_sync, batches, 64, syncs.checking),
        }
        progress(f"{backend} backend: " + ", ".join(f"{k} {v:.0f} ns" for k, v in results[backend].items()))
        reported = syncs.report()
        expected = 0 if backend == "torch" else 1
        if len(reported.sites) != expected:
            raise RuntimeError(f"{backend} backend: expected {expected} reported site (the raw sync):\n" + reported.format())
        results[backend]["syncs reported"] = reported.total
    if syncs.backend_choice().active != "cupti":
        raise RuntimeError(f"CUPTI was not used: {syncs.backend_choice().reason}")
    # Back to the torch backend for what is measured next (the timeline's rows are the torch backend's: with CUPTI
    # left on, each of their syncs paid its callback, 172 us against 13 us on the H200, run 38).
    syncs.disable()
    syncs.set_backend("torch")
    syncs.reset()
    if not syncs.enable():
        raise RuntimeError("the detector could not be enabled again with the torch backend")
    rows = [[what, results["torch"][what], results["cupti"][what], (results["cupti"][what] - results["torch"][what]) / 1000]
            for what in results["torch"] if what != "syncs reported"]
    return rows, {"cupti": results}


def measure_timeline(torch: Any, on_gpu: bool, repeats: int, progress: Callable[[str], None]) -> list[list[Any]]:
    """What the timeline costs per recorded sync (see the module docstring); the detector is enabled in record mode.

    Returns rows ``[what, ns per sync allowed, ns per sync recorded, us added by the sink]``: what a sink adds is
    the recorded sync's time with it against without any sink (the first row: the check alone).
    """
    import functools
    import warnings

    from syncless import syncs
    from syncless.syncs import _hook, _timeline

    if on_gpu:
        value = torch.ones(1, device="cuda")
        sync = value.item
    else:  # what torch issues for a sync, from C code on the caller's line (the detector's CPU tests do this)
        sync = functools.partial(warnings.warn, _hook.TORCH_SYNC_TEXT, UserWarning)
    per_batch = 200

    def syncs_in(block: Callable[[], Any]) -> Callable[[int], None]:
        def body(n: int) -> None:
            for _ in range(n):
                with syncs.checking(), block():
                    for _ in range(per_batch):
                        sync()
        return body

    def per_sync(block: Callable[[], Any]) -> float:
        return _ns_per_call(syncs_in(block), 1, repeats) / per_batch

    def profiler() -> Any:
        return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    saved = (_timeline.state.nvtx, _timeline.state.recording)
    rows: list[list[Any]] = []
    try:
        syncs.set_nvtx(False)
        syncs.record_timeline(False)
        check = _ns_per_call(_call_loop(_timeline.is_live), 100_000, repeats)
        rows.append(["the check per recorded sync, every sink off (no work after it)", 0.0, check, check / 1000])
        sinks: list[tuple[str, Callable[[], None], Callable[[], Any]]] = [
            ("sinks off", lambda: None, contextlib.nullcontext),
            ("record_timeline(True)", lambda: syncs.record_timeline(True), contextlib.nullcontext),
            ("torch.profiler active (CPU activities)", lambda: None, profiler),
        ]
        if on_gpu:
            sinks.append(("NVTX on (torch.cuda.nvtx)", lambda: syncs.set_nvtx(True), contextlib.nullcontext))
        recorded_off = None
        for what, switch_on, outer in sinks:
            switch_on()
            with outer():
                allowed_ns = per_sync(syncs.allowed)
                recorded_ns = per_sync(contextlib.nullcontext)
            syncs.set_nvtx(False)
            syncs.record_timeline(False)
            syncs.reset()
            recorded_off = recorded_ns if recorded_off is None else recorded_off
            rows.append([f"one sync, {what}", allowed_ns, recorded_ns, (recorded_ns - recorded_off) / 1000])
            progress(f"timeline, {what}: {allowed_ns:.0f} ns allowed, {recorded_ns:.0f} ns recorded")
    finally:
        syncs.set_nvtx(saved[0])
        syncs.record_timeline(saved[1])
    return rows


def run(args: Any, progress: Callable[[str], None]) -> BenchOutput:
    """Measure the detector's costs; see the module docstring."""
    import torch

    from syncless import syncs
    from syncless.syncs import _debugmode

    on_gpu = torch.cuda.is_available()
    loops = 20_000 if args.quick else 200_000
    copy_batches = 20 if args.quick else 200
    repeats = 5 if args.quick else 15
    where = f"GPU ({torch.cuda.get_device_name(0)})" if on_gpu else "CPU only (stand-in debug-mode switch)"
    progress(f"measuring on {where}, {loops} loops x {repeats} repeats")

    mode_before, enabled_before = syncs.mode(), syncs.is_enabled()
    if enabled_before:
        syncs.disable()
    rows_allowed, rows_region, rows_copy, rows_cupti, rows_timeline = [], [], [], [], []
    cupti_skipped = ""
    backend_before = _backend.backend.requested
    data: dict[str, Any] = {"on_gpu": on_gpu, "loops": loops, "copy_batches": copy_batches, "copy_batch": COPY_BATCH, "repeats": repeats}
    with contextlib.ExitStack() as stack:
        if not on_gpu:
            stack.enter_context(_debugmode.fake())
        try:
            # 1. allowed() with the mode off against a bare nullcontext.
            syncs.set_mode("off")
            bare = _ns_per_call(_context_loop(contextlib.nullcontext), loops, repeats)
            disabled = _ns_per_call(_context_loop(syncs.allowed), loops, repeats)
            rows_allowed.append(["with nullcontext()", bare, 1.0])
            rows_allowed.append(["with allowed()  (mode off)", disabled, disabled / bare])
            progress(f"allowed() off: {disabled:.0f} ns vs nullcontext {bare:.0f} ns")

            # 2. entering and leaving a checked region, detector on.
            def plain() -> None:
                return None

            syncs.set_mode("record")
            syncs.set_backend("torch")  # sections 2 and 3 measure the torch layers; section 4 adds CUPTI
            wrapped_plain = syncs.checked(plain)
            if not syncs.enable():
                raise RuntimeError("the detector could not be enabled for the benchmark")
            base_block = _ns_per_call(_context_loop(contextlib.nullcontext), loops, repeats)
            region = _ns_per_call(_context_loop(syncs.checking), loops, repeats)
            base_call = _ns_per_call(_call_loop(plain), loops, repeats)
            checked_call = _ns_per_call(_call_loop(wrapped_plain), loops, repeats)
            rows_region += [
                ["with nullcontext()", base_block, 0.0],
                ["with checking()", region, region - base_block],
                ["plain call", base_call, 0.0],
                ["@checked call", checked_call, checked_call - base_call],
            ]
            progress(f"checked region: {region:.0f} ns, @checked call: {checked_call:.0f} ns")

            # 3. wrapped copies against the originals, outside and inside a region, interleaved.
            for name, (original_op, wrapped_op) in _copy_ops(torch, on_gpu).items():
                original, outside = _interleaved_copy_ns(torch, on_gpu, original_op, wrapped_op, copy_batches)
                original_in, inside = _interleaved_copy_ns(torch, on_gpu, original_op, wrapped_op, copy_batches,
                                                           in_region=syncs.checking)
                rows_copy.append([name, original, outside, (outside - original) / 1000, inside,
                                  (inside - original_in) / 1000])
                progress(f"{name}: original {original:.0f} ns, wrapped {outside:.0f} ns, in region {inside:.0f} ns")
            report = syncs.report()
            if report:
                raise RuntimeError("the benchmark's own copies were reported:\n" + report.format())

            # 4. the CUPTI backend, where there is a GPU and cupti-python. Before the timeline's torch.profiler
            # row: once a profiler has run, kineto keeps CUPTI subscribed for the rest of the process (seen on the
            # H200: the CUPTI backend then fell back to torch's), and CUPTI allows one subscriber.
            if on_gpu and importlib.util.find_spec("cupti") is not None:
                rows_cupti, cupti_data = measure_cupti(torch, copy_batches, progress)
                data.update(cupti_data)
            elif on_gpu:
                cupti_skipped = "cupti-python is not installed (pip install 'syncless[cupti]')"
            else:
                cupti_skipped = "no GPU"

            # 5. the timeline's sinks, per recorded sync (torch backend).
            rows_timeline = measure_timeline(torch, on_gpu, repeats, progress)
        finally:
            # Put the caller's settings back; if the run was stopped inside a region (a signal), say so instead of
            # raising over the error that stopped it.
            syncs.disable()
            syncs.reset()
            try:
                syncs.set_backend(backend_before)
            except RuntimeError as err:
                progress(f"could not restore the sync backend: {err}")
            syncs.set_mode(mode_before)
            if enabled_before:
                syncs.enable()

    data.update(allowed=rows_allowed, region=rows_region, copies=rows_copy, timeline=rows_timeline)
    worst_added_us = max(row[3] for row in rows_copy)
    goals = [
        Goal(f"disabled allowed() vs bare nullcontext ({'GPU' if on_gpu else 'CPU'})", rows_allowed[1][2], ALLOWED_GOAL_RATIO, "x"),
        Goal("wrapped Tensor.copy_/Tensor.to, outside a region: added time per call", worst_added_us, COPY_GOAL_ADDED_US, "us"),
    ]
    if rows_cupti:
        launch_added_us = rows_cupti[1][3]
        goals.append(Goal("CUPTI backend: kernel launch inside a checked region, added vs torch backend",
                          launch_added_us, LAUNCH_GOAL_ADDED_US, "us"))
    copy_kind = "4 KiB pinned non_blocking H2D" if on_gpu else "4 KiB CPU copy / dtype conversion"
    tables = [
        ("allowed() with the mode off", ["block", "ns per use", "ratio to nullcontext"], rows_allowed),
        ("Entering and leaving a checked region (detector on)", ["what", "ns per use", "added ns"], rows_region),
        (f"Copies: {copy_kind}", ["op", "original ns", "wrapped ns", "added us", "in region ns", "added in region us"], rows_copy),
    ]
    if rows_timeline:
        tables.append(("The timeline: per recorded sync, against the same sync allowed (torch backend)",
                       ["what", "sync allowed ns", "sync recorded ns", "added by the sink us"], rows_timeline))
    if rows_cupti:
        tables.append(("CUPTI backend against the torch backend (host ns per call; a region holds CUPTI while active)",
                       ["what", "torch backend ns", "cupti backend ns", "added us"], rows_cupti))

    def plot(path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = [r[0] for r in rows_allowed] + [r[0] for r in rows_region]
        values = [r[1] for r in rows_allowed] + [r[1] for r in rows_region]
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
        left.barh(labels, values, color=["#999999", "#1f77b4"] + ["#999999", "#1f77b4"] * 2)
        left.set_xlabel("ns per use")
        left.set_title("context managers and checked calls")
        names = [r[0] for r in rows_copy]
        positions = range(len(names))
        width = 0.27
        for offset, column, label in ((-width, 1, "original"), (0.0, 2, "wrapped, outside region"), (width, 4, "wrapped, in region")):
            right.bar([p + offset for p in positions], [r[column] for r in rows_copy], width, label=label)
        right.set_xticks(list(positions), names)
        right.set_ylabel("ns per call")
        right.set_title(f"copies ({copy_kind})")
        right.legend()
        fig.suptitle(f"syncless.syncs overhead, {where}")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    return BenchOutput(
        name="syncs",
        title="Hidden-sync detector overhead",
        data=data,
        tables=tables,
        goals=goals,
        plot=plot,
        notes=[
            f"Measured on {where}; median of {repeats} timed loops each.",
            "Outside a checked region a wrapped copy costs one ContextVar read and a Python call; inside one the "
            "copy is classified (argument parsing, is_pinned, layout), which is the price of checking, not of "
            "running unchecked.",
            "With SYNCLESS_SYNC_CHECK=off (the default) nothing is wrapped at all.",
            ("CUPTI backend: the 'raw cuStreamSynchronize' row's added time is the cost of detecting and recording "
             "one sync; a kernel launch never reaches Python (only the blocking calls' callbacks are enabled)."
             if rows_cupti else f"CUPTI backend not measured: {cupti_skipped}."),
        ],
    )
