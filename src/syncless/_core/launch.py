"""Run a function on N local ranks, each a spawned process with torch.distributed set up.

Used by the demo (the pipeline benchmark has its own launcher, which streams
progress and keeps partial results; the tests have ``tests/support/ranks.py``,
which loads test functions by file). Every run has a hard deadline: a rank
that hangs or dies is reported with what it printed last, and all ranks are
killed, instead of a run that never ends.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from syncless._core.errors import SynclessError

# NVLink multicast can take shared machines out of service; keep it off in every rank.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class RankFailed(SynclessError):
    """A rank raised, died or outlived the deadline; the message holds each rank's story."""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, init_method: str, backend: str,
               timeout_s: float, env: dict[str, str], args: Sequence[Any], results: Any) -> None:
    os.environ.update(env)
    try:
        import torch.distributed as dist

        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException:  # report every failure of a rank, whatever it was, to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *, args: Sequence[Any] = (), backend: str = "gloo",
              timeout_s: float = 300.0, env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes.

    ``fn`` must be importable by name (a module-level function). Each rank
    joins one torch.distributed group (``backend``: ``gloo``, ``nccl`` or
    ``cpu:gloo,cuda:nccl``) over a fresh TCP port on 127.0.0.1.

    Returns:
        Each rank's return value, in rank order.

    Raises:
        RankFailed: a rank raised (its traceback is in the message), exited
            without a result, or the deadline ``timeout_s`` passed; all ranks
            are killed first.
    """
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    rank_env = {**SAFE_ENV, **(env or {})}
    processes = [
        context.Process(target=_rank_main, args=(fn, rank, world_size, init_method, backend, timeout_s, rank_env, args, results),
                        name=f"syncless-rank{rank}", daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    timed_out = False
    try:
        while len(outcomes) < world_size:
            try:
                rank, status, value = results.get(timeout=0.2)
                outcomes[rank] = (status, value)
                if status == "error":
                    break
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(processes) if r not in outcomes and p.exitcode is not None]
            if dead and results.empty():
                time.sleep(0.5)  # a result may still be in flight
                if results.empty():
                    for r in dead:
                        outcomes[r] = ("error", f"rank {r} exited with code {processes[r].exitcode} without a result")
                    break
            if time.monotonic() > deadline:
                timed_out = True
                break
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(timeout=10)
    failures = {r: v for r, (s, v) in outcomes.items() if s == "error"}
    missing = [r for r in range(world_size) if r not in outcomes]
    if failures or missing:
        parts = [f"--- rank {r} failed:\n{text}" for r, text in sorted(failures.items())]
        if missing and timed_out:
            parts.append(f"--- ranks {missing} gave no result within {timeout_s:.0f} s (killed)")
        elif missing:
            parts.append(f"--- ranks {missing} were stopped after the failure above")
        raise RankFailed("a rank failed:\n" + "\n".join(parts))
    return [outcomes[r][1] for r in range(world_size)]
