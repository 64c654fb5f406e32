"""Run a test function in N spawned processes with torch.distributed initialized.

    from support.ranks import run_ranks, say

    def body(rank, world_size, steps):       # module level, in any test file
        say(f"step {i}")                       # "[rank 1 +2.3s] step 4", flushed at once
        return something_picklable

    results = run_ranks(body, 2, args=(100,), backend="gloo", timeout_s=60)

- Each rank runs in a fresh ``spawn`` process; the function is found again
  in the child by its file and qualified name, so it may live in a test
  module (pytest's importlib mode gives those no importable name).
- ``init="file"`` (default) rendezvouses through a fresh temporary file;
  ``init="tcp"`` through 127.0.0.1 on a free port.
- ``devices=[...]`` sets each rank's CUDA device before the process group
  is created (needed for NCCL).
- A hard timeout covers the whole run: when it passes, every rank still
  alive is killed and :class:`RanksTimedOut` names them.
- An exception in a rank is re-raised in the parent as :class:`RankFailed`
  with that rank's formatted traceback.
- ``may_die={rank, ...}`` lets ranks end without reporting (a test that
  kills a rank on purpose); their result is None.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from syncless._core.launch import SAFE_ENV, free_port

_START = time.monotonic()
_RANK: int | None = None


class RankFailed(AssertionError):
    """A rank raised; the message carries its traceback."""


class RanksTimedOut(AssertionError):
    """The run passed its hard timeout; the ranks still alive were killed."""


def say(message: str) -> None:
    """Print one progress line prefixed with this rank and the seconds since it started; flush at once."""
    who = "parent" if _RANK is None else f"rank {_RANK}"
    print(f"[{who} +{time.monotonic() - _START:.1f}s] {message}", file=sys.stderr, flush=True)


def _load(file: str, qualname: str) -> Callable[..., Any]:
    import importlib.util

    name = f"_ranks_target_{abs(hash(file))}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _child(
    file: str,
    qualname: str,
    rank: int,
    world_size: int,
    backend: str,
    init_method: str,
    devices: Sequence[int] | None,
    env: dict[str, str],
    args: tuple[Any, ...],
    results: Any,
    pg_timeout_s: float,
) -> None:
    global _RANK, _START
    _RANK = rank
    _START = time.monotonic()
    os.environ.update(env)
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        if devices is not None:
            torch.cuda.set_device(devices[rank])
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
        )
        say(f"process group up ({backend})")
        value = _load(file, qualname)(rank, world_size, *args)
        say("done")
        results.put((rank, "ok", value))
    except BaseException as err:  # noqa: BLE001 - every failure goes back to the parent with its traceback
        results.put((rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown after the result was reported must not mask it
            pass
        # Skip interpreter teardown: atexit hooks of CUDA/NCCL libraries can hang after a peer died.
        # First let the queue's feeder thread deliver the result.
        results.close()
        results.join_thread()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Iterable[Any] = (),
    backend: str = "gloo",
    init: str = "file",
    devices: Sequence[int] | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
    may_die: Iterable[int] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; return each rank's result.

    Raises:
        RankFailed: a rank raised, or died without being allowed to (``may_die``).
        RanksTimedOut: ``timeout_s`` passed; all ranks were killed.
    """
    import inspect

    file = inspect.getsourcefile(fn)
    qualname = fn.__qualname__
    tmpdir = tempfile.mkdtemp(prefix="syncless-ranks-")
    if init == "file":
        init_method = f"file://{os.path.join(tmpdir, 'rendezvous')}"
    elif init == "tcp":
        init_method = f"tcp://127.0.0.1:{free_port()}"
    else:
        raise ValueError(f"init must be 'file' or 'tcp'; got {init!r}")
    allowed_deaths = set(may_die)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = []
    for rank in range(world_size):
        proc = ctx.Process(
            target=_child,
            args=(file, qualname, rank, world_size, backend, init_method, devices, {**SAFE_ENV, **(env or {})}, tuple(args),
                  results, max(timeout_s, 30.0)),
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    say(f"started {world_size} ranks of {qualname} (timeout {timeout_s:g} s)")
    outcome: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcome) < world_size:
            try:
                rank, status, value = results.get(timeout=0.2)
                outcome[rank] = (status, value)
                if status == "error":
                    break
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if r not in outcome and not p.is_alive()]
            unexpected = [r for r in dead if r not in allowed_deaths]
            if unexpected:
                # Give a racing result a moment to arrive before calling it a crash.
                time.sleep(0.5)
                while not results.empty():
                    rank, status, value = results.get()
                    outcome[rank] = (status, value)
                unexpected = [r for r in unexpected if r not in outcome]
                if unexpected:
                    codes = {r: procs[r].exitcode for r in unexpected}
                    raise RankFailed(f"rank(s) {unexpected} died without a result (exit codes {codes})")
            for r in dead:
                if r in allowed_deaths and r not in outcome:
                    outcome[r] = ("died", None)
            if time.monotonic() > deadline:
                alive = [r for r, p in enumerate(procs) if p.is_alive()]
                raise RanksTimedOut(f"{qualname}: hard timeout of {timeout_s:g} s passed; killing ranks {alive}")
        errors = {r: v for r, (s, v) in outcome.items() if s == "error"}
        if errors:
            first = min(errors)
            raise RankFailed(f"rank {first} of {qualname} raised:\n{errors[first]}")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
    return [outcome[r][1] for r in range(world_size)]
