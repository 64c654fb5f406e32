"""Run a function on N local ranks, each a spawned process with torch.distributed set up.

Used by the demo and by the multi-process tests (``tests/support/ranks.py``
only sets the tests' defaults); the pipeline benchmark has its own launcher,
which streams progress and keeps partial results. Every run has a hard
deadline: a rank that raises, hangs or dies is reported with its traceback or
exit code, and all ranks are killed, instead of a run that never ends.

How a rank ends, in this order, because a dead peer can make the last two
steps hang: it puts its result on the queue and waits until the queue's
feeder thread has handed it over; it tears down its process group (errors
ignored); it exits with ``os._exit`` (interpreter shutdown runs CUDA and NCCL
exit hooks, which can block after a peer died). The parent has the result by
then, and it kills whatever is still alive when it is done.
"""

from __future__ import annotations

import datetime
import importlib.util
import inspect
import os
import pickle
import queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from syncless._core.errors import SynclessError

# NVLink multicast can take shared machines out of service; keep it off in every rank.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

#: How long the parent waits for a result that may still be in flight from a rank that just exited.
RESULT_GRACE_S = 0.5

_started_at = time.monotonic()
_rank: int | None = None


class RankFailed(SynclessError):
    """A rank raised, died without a result, or outlived the deadline; the message holds each rank's story.

    Attributes:
        failures: rank -> what went wrong there (the error's first line, then its traceback).
        stopped: ranks killed after the failure, before they had a result.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None, stopped: Sequence[int] = ()):
        super().__init__(message)
        self.failures = dict(failures or {})
        self.stopped = list(stopped)


class RanksTimedOut(RankFailed):
    """The run passed its deadline; every rank still alive was killed."""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def say(message: str) -> None:
    """Print one progress line to stderr, prefixed with this rank and the seconds since it started; flush."""
    who = "parent" if _rank is None else f"rank {_rank}"
    print(f"[{who} +{time.monotonic() - _started_at:.1f}s] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class _ByFile:
    """A function the child loads again from its source file (a test module has no importable name)."""

    file: str
    qualname: str

    def load(self) -> Callable[..., Any]:
        name = f"_syncless_ranks_{abs(hash(self.file))}"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, self.file)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {self.file} to find {self.qualname}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        target: Any = module
        for part in self.qualname.split("."):
            target = getattr(target, part)
        return target


@dataclass(frozen=True)
class _RankPlan:
    """What every rank needs besides its number (pickled once per rank)."""

    target: Callable[..., Any] | _ByFile
    world_size: int
    backend: str
    init_method: str
    devices: tuple[int, ...] | None
    env: dict[str, str]
    args: tuple[Any, ...]
    group_timeout_s: float
    progress: bool
    parent_pid: int


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when the parent that started it exits (however it exits).

    Without it, a launcher killed by SIGTERM or SIGKILL leaves its ranks
    running, re-parented to PID 1. Elsewhere the parent's ``finally`` is the
    only clean-up.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import ctypes.util

    pr_set_pdeathsig = 1
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:  # no libc to load: keep the parent's finally as the only clean-up
        return
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def _rank_main(plan: _RankPlan, rank: int, results: Any) -> None:
    global _rank, _started_at
    _rank, _started_at = rank, time.monotonic()
    # Ctrl-C reaches the whole process group: the parent handles it and stops every rank, so a rank
    # ignores it rather than print a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(plan.parent_pid)
    os.environ.update(plan.env)
    try:
        import torch
        import torch.distributed as dist

        if plan.devices is not None:
            torch.cuda.set_device(plan.devices[rank])
        dist.init_process_group(plan.backend, init_method=plan.init_method, rank=rank, world_size=plan.world_size,
                                timeout=datetime.timedelta(seconds=plan.group_timeout_s))
        if plan.progress:
            say(f"process group up ({plan.backend})")
        fn = plan.target.load() if isinstance(plan.target, _ByFile) else plan.target
        value = fn(rank, plan.world_size, *plan.args)
        if plan.progress:
            say("done")
        # The queue pickles on its feeder thread, which only prints a failure and drops the item; pickle here
        # first, so a result that cannot travel comes back as this rank's error instead of as no result.
        pickle.dumps(value)
        results.put((rank, "ok", value))
    except BaseException as err:  # noqa: BLE001 - every failure goes back to the parent with its traceback
        results.put((rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        results.close()
        results.join_thread()  # the result is with the parent before anything below can hang
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except BaseException:  # noqa: BLE001 - the result is reported; teardown must not replace it
            pass
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Iterable[Any] = (),
    backend: str = "gloo",
    init: str = "tcp",
    devices: Sequence[int] | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 300.0,
    may_die: Iterable[int] = (),
    load_by_file: bool = False,
    progress: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; blocks until all report.

    Args:
        fn: a module-level function. Pickled by name, unless ``load_by_file``: then each rank loads
            it again from its source file (for test modules, which have no importable name).
        backend: ``gloo``, ``nccl`` or ``cpu:gloo,cuda:nccl``.
        init: where the ranks meet: ``tcp`` (127.0.0.1, a free port) or ``file`` (a fresh temporary file).
        devices: each rank's CUDA device, set before its process group is created (NCCL needs it).
        env: environment variables for the ranks, on top of :data:`SAFE_ENV`.
        timeout_s: deadline for the whole run (the process group's own timeout is at least 30 s).
        may_die: ranks allowed to end without a result (a test that kills one); their result is None.
        progress: each rank prints a line when its group is up and when it is done (see :func:`say`).

    Returns:
        Each rank's return value, in rank order.

    Raises:
        RankFailed: a rank raised (its traceback is in the message) or exited without a result and
            was not in ``may_die``; every rank is killed first.
        RanksTimedOut: the deadline passed; every rank still alive is killed first.
        ValueError: ``init`` is neither ``tcp`` nor ``file``, or ``load_by_file`` and ``fn`` has no source file.
    """
    import torch.multiprocessing as mp

    name = getattr(fn, "__qualname__", repr(fn))
    target: Callable[..., Any] | _ByFile = fn
    if load_by_file:
        file = inspect.getsourcefile(fn)
        if file is None:
            raise ValueError(f"load_by_file: {name} has no source file to load it from")
        target = _ByFile(file, name)
    rendezvous_dir = None
    if init == "tcp":
        init_method = f"tcp://127.0.0.1:{free_port()}"
    elif init == "file":
        rendezvous_dir = tempfile.mkdtemp(prefix="syncless-ranks-")
        init_method = f"file://{os.path.join(rendezvous_dir, 'rendezvous')}"
    else:
        raise ValueError(f"init must be 'tcp' or 'file'; got {init!r}")
    plan = _RankPlan(target, world_size, backend, init_method, tuple(devices) if devices is not None else None,
                     {**SAFE_ENV, **(env or {})}, tuple(args), max(timeout_s, 30.0), progress, os.getpid())
    allowed_deaths = set(may_die)
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_rank_main, args=(plan, rank, results), name=f"syncless-rank{rank}",
                                 daemon=True)
                 for rank in range(world_size)]
    # A rank must ignore Ctrl-C from its first instruction: the terminal sends it to the whole process group,
    # and a rank still importing torch (its target is unpickled before _rank_main runs) printed a
    # KeyboardInterrupt traceback of its own (seen in CI). An ignored SIGINT is inherited through the spawn's
    # exec and Python then leaves it ignored; the parent ignores it only while it starts the ranks.
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main_thread else None
    try:
        for process in processes:
            process.start()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if progress:
        say(f"started {world_size} ranks of {name} (timeout {timeout_s:g} s)")
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        _collect(processes, results, outcomes, allowed_deaths, deadline)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(timeout=10)
        if rendezvous_dir is not None:
            shutil.rmtree(rendezvous_dir, ignore_errors=True)
    failures = {r: text for r, (status, text) in outcomes.items() if status == "error"}
    missing = [r for r in range(world_size) if r not in outcomes]
    if failures or missing:
        stories = [f"--- rank {r} failed:\n{text}" for r, text in sorted(failures.items())]
        if missing and not failures:
            alive_at_deadline = ", ".join(str(r) for r in missing)
            raise RanksTimedOut(f"{name}: ranks [{alive_at_deadline}] gave no result within {timeout_s:g} s (killed)")
        if missing:
            stories.append(f"--- ranks {missing} were stopped after the failure above")
        raise RankFailed(f"{name}: a rank failed:\n" + "\n".join(stories), failures, missing)
    return [outcomes[r][1] if outcomes[r][0] == "ok" else None for r in range(world_size)]


def describe_exit(exitcode: int) -> str:
    """Say how a rank that left no result ended: its exit code, or the signal that killed it.

    A negative ``exitcode`` is a signal (multiprocessing's convention). SIGKILL with no one asking for it
    is most often the kernel's out-of-memory killer, and a killed process leaves no traceback to look for.
    """
    if exitcode >= 0:
        return f"exited with code {exitcode} without a result"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = "an unknown signal"
    hint = ": out of memory?" if -exitcode == signal.SIGKILL else ""
    return f"killed by signal {-exitcode} ({name}{hint}) without a result; a killed process leaves no traceback"


def _collect(processes: list[Any], results: Any, outcomes: dict[int, tuple[str, Any]], allowed_deaths: set[int],
             deadline: float) -> None:
    """Fill ``outcomes`` until every rank reported, one failed, or the deadline passed."""
    while len(outcomes) < len(processes):
        try:
            rank, status, value = results.get(timeout=0.2)
            outcomes[rank] = (status, value)
            if status == "error":
                return
            continue
        except queue.Empty:
            pass
        dead = [r for r, p in enumerate(processes) if r not in outcomes and p.exitcode is not None]
        if dead:
            time.sleep(RESULT_GRACE_S)  # a result may still be in flight
            while True:
                try:
                    rank, status, value = results.get_nowait()
                except queue.Empty:
                    break
                outcomes[rank] = (status, value)
            for r in dead:
                if r in outcomes:
                    continue
                if r in allowed_deaths:
                    outcomes[r] = ("died", None)
                else:
                    outcomes[r] = ("error", describe_exit(processes[r].exitcode))
            if any(status == "error" for status, _ in outcomes.values()):
                return
        if time.monotonic() > deadline:
            return
