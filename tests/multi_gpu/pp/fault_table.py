"""Fault table of the pipeline transports: one row per transport x fault x phase.

    PYTHONPATH=src python3 tests/multi_gpu/pp/fault_table.py OUT_DIR                 # GPUs: copy engines + NCCL
    PYTHONPATH=src python3 tests/multi_gpu/pp/fault_table.py OUT_DIR --device cpu    # gloo rows
    ... --transports copy_engine --faults sigint,stall --phases close,between --timeout-s 3 --steps 500

Each row runs two pipeline stages (ranks 0 and 1, one per GPU) through
``syncless._core.launch.run_ranks`` and injects one fault into one stage
(the victim) at a named phase (``syncless.pp._faults``; ``between`` is
between two steps, injected by this harness):

- ``sigkill``: the victim kills itself; a standby rank (rank 2, on the
  victim's GPU) then takes its stage in the rebuilt transport, in a new
  world (the survivor and the standby destroy their process groups and
  ``init_process_group`` again, as an elastic restart does);
- ``sigint``: the victim interrupts itself (``KeyboardInterrupt``: it restores
  Python's handler, which the launcher's ranks ignore), closes its transport
  (a second ``close()`` if the first was interrupted) and rebuilds;
- ``stall``: the victim sleeps for the timeout + 2 s, then goes on, fails,
  closes and rebuilds.

Set-up rows (phase ``setup:arguments``, stage 1 at fault): ``peer never arrives``
(stage 1 skips ``make_transport``: stage 0 must raise ``PeerTimeoutError`` within
the bound; both then rebuild in a new world), ``mismatched arguments`` (stage 1
passes another backend) and ``malformed persistent`` (stage 1 passes a list):
both stages must raise the same ``ValueError`` / ``TypeError`` within the bound,
and a rebuild on the same group must run its steps bit-exact.

Columns: what the survivor raised and how long after the fault (the bound is
timeout + 2 s); its device memory after ``close()`` against its baseline
(back to baseline, or what the transport reported as leaked by design);
whether a rebuilt transport then ran ``--steps`` bit-exact random-row steps.
Each row is printed as it completes and the table is rewritten (``table.md``
and ``table.json`` in OUT_DIR) after every row.

Rebuilding (as ``docs/pp.md`` describes it): every stage closes or aborts the
broken transport, the stages meet (here through files; in an engine, a
barrier on a healthy group), and every stage calls ``make_transport`` again:
the copy-engine rows on the same process group, the NCCL rows on a new one
(an unmatched NCCL operation of the failed step may still sit in the old
group's communicator).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import sys
import tempfile
import time
from typing import Any

SETUP_PHASES_CE = ("setup:check", "setup:allocate", "setup:open", "setup:accept")
SETUP_PHASES_TD = ("setup:layout",)
STEP_PHASES = ("step:before_meta", "step:after_meta", "between", "close")
FAULTS = ("sigkill", "sigint", "stall")
#: Set-up rows: what stage 1 does wrong at make_transport, and what both stages must raise (within the bound).
SETUP_FAULTS = {
    "peer never arrives": "PeerTimeoutError",  # stage 1 never calls make_transport (stage 0 only raises)
    "mismatched arguments": "ValueError",  # stage 1 passes another backend
    "malformed persistent": "TypeError",  # stage 1 passes a list for `persistent`
}
SETUP_PHASE = "setup:arguments"
#: Which stage is the victim at each phase (0 sends, 1 receives; only stage 1 accepts a connection).
VICTIM = {
    "setup:layout": 1, "setup:check": 0, "setup:allocate": 1, "setup:open": 0, "setup:accept": 1,
    "step:before_meta": 0, "step:after_meta": 0, "between": 1, "close": 0, SETUP_PHASE: 1,
}
#: Steps run before the fault (the fault comes at this step's send or after this step's recv).
FAULT_STEP = 10
MAX_ROWS = 64
SLACK_S = 2.0  # the survivor must raise within timeout + this
MEMORY_SLACK_NBYTES = 1 << 20  # driver bookkeeping; under the 2 MiB granularity, so no unreported buffer hides


# -- the data: fresh random rows per step, reproducible on both stages ----------------------------------

SPEC = {"hidden": ("bfloat16", (96,)), "ids": ("int64", ())}


def _persistent(torch: Any, device: Any) -> dict[str, Any]:
    return {name: torch.empty((MAX_ROWS, *row), dtype=getattr(torch, dtype), device=device)
            for name, (dtype, row) in SPEC.items()}


def _poison(tensors: dict[str, Any]) -> None:
    for t in tensors.values():
        t.fill_(float("nan") if t.dtype.is_floating_point else -7)


def _step_data(torch: Any, device: Any, seed: int, step: int) -> dict[str, Any]:
    rng = random.Random(seed * 1_000_003 + step)
    rows = {name: rng.randint(0, MAX_ROWS) for name in SPEC}
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 7919 + step)
    hidden = torch.randn((rows["hidden"], 96), generator=gen, device=device).to(torch.bfloat16)
    ids = torch.randint(-(2**40), 2**40, (rows["ids"],), generator=gen, device=device)
    return {"hidden": hidden, "ids": ids}


def _mismatches(torch: Any, got: dict[str, Any], want: dict[str, Any]) -> int:
    bad = 0
    for name, expected in want.items():
        if got[name].shape != expected.shape:
            return -1
        bits = torch.int16 if expected.dtype == torch.bfloat16 else torch.int64
        bad += int((got[name].contiguous().view(bits) != expected.contiguous().view(bits)).sum())
    return bad


# -- one rank -------------------------------------------------------------------------------------------


class _Fault:
    """Acts once, in the victim, at the armed phase."""

    def __init__(self, kind: str, phase: str, timeout_s: float, sync_dir: str):
        self.kind, self.phase, self.timeout_s, self.sync_dir = kind, phase, timeout_s, sync_dir
        self.armed = False

    def __call__(self, phase: str) -> None:
        if self.armed and phase == self.phase:
            self.fire()

    def fire(self) -> None:
        from syncless._core.launch import say

        self.armed = False
        # Written whole, then renamed: the other stage may read it at any moment (and must never see it empty).
        pending = pathlib.Path(self.sync_dir, f"fault_time.{os.getpid()}")
        pending.write_text(repr(time.time()))
        os.replace(pending, pathlib.Path(self.sync_dir, "fault_time"))
        say(f"fault: {self.kind} at {self.phase}")
        if self.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        elif self.kind == "sigint":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the KeyboardInterrupt comes from the handler, in this frame
        else:
            time.sleep(self.timeout_s + SLACK_S)


def _meet(sync_dir: str, name: str, ranks: list[int], rank: int, timeout_s: float = 120.0) -> None:
    """A file barrier among ``ranks`` (which survives any process group)."""
    pathlib.Path(sync_dir, f"{name}.{rank}").write_text("here")
    end = time.monotonic() + timeout_s
    while not all(pathlib.Path(sync_dir, f"{name}.{r}").exists() for r in ranks):
        if time.monotonic() > end:
            raise TimeoutError(f"rank {rank}: the others did not reach {name!r} within {timeout_s:g} s")
        time.sleep(0.01)


def _fault_time(sync_dir: str) -> float | None:
    path = pathlib.Path(sync_dir, "fault_time")
    return float(path.read_text()) if path.exists() else None


def _used_bytes(torch: Any, device: Any) -> int | None:
    """Device memory in use outside torch's caching allocator, once this rank's current stream is idle.

    The allocator's own cache may grow between two readings (it never gives memory back unasked, and
    ``empty_cache`` could wait for a stuck stream), so what it reserved is subtracted. None on the CPU,
    or when the current stream stays busy for 10 s (a receive of a dead NCCL peer).
    """
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    end = time.monotonic() + 10.0
    while not event.query():
        if time.monotonic() > end:
            return None
        time.sleep(0.005)
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def _run_steps(torch: Any, transport: Any, stage: int, device: Any, seed: int, first: int, last: int,
               fault: _Fault | None, src: dict[str, Any] | None, persistent: dict[str, Any] | None) -> int:
    """Run steps ``first..last`` as ``stage``; arm ``fault`` at FAULT_STEP; return mismatching elements."""
    bad = 0
    for step in range(first, last + 1):
        if fault is not None and step == FAULT_STEP and fault.phase.startswith("step:"):
            fault.armed = True
        if stage == 0:
            data = _step_data(torch, device, seed, step)
            tensors = {}
            for name, value in data.items():
                src[name][: value.shape[0]].copy_(value)
                tensors[name] = src[name][: value.shape[0]]
            transport.send(tensors)
            _poison(src)  # the caller reuses its buffers at once
        else:
            _poison(persistent)
            got = transport.recv()
            bad += _mismatches(torch, got, _step_data(torch, device, seed, step))
        if fault is not None and step == FAULT_STEP and fault.phase == "between":
            fault.fire()
    return bad


def fault_row(rank: int, world: int, row: dict[str, Any]) -> dict[str, Any]:
    """One rank of one row; see the module docstring. Ranks 0 and 1 are the stages, rank 2 the standby."""
    import torch
    import torch.distributed as dist

    from syncless._core.launch import say
    from syncless.pp import TransportError, _faults, make_transport

    kind, phase, transport_kind = row["fault"], row["phase"], row["transport"]
    timeout_s, sync_dir = row["timeout_s"], row["sync_dir"]
    if kind == "sigint" and rank == VICTIM[phase]:
        # The launcher's ranks ignore SIGINT (a Ctrl-C at the terminal is the parent's to handle), so the
        # victim's os.kill(SIGINT) would do nothing and the row would test no fault at all. The fault is
        # a KeyboardInterrupt, as in a process run from a shell or by torchrun: restore Python's handler.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    device = torch.device("cuda", torch.cuda.current_device()) if row["device"] == "cuda" else torch.device("cpu")
    victim = VICTIM[phase]
    out: dict[str, Any] = {"rank": rank}

    def fresh_group(ranks: list[int]) -> Any:
        return dist.new_group(ranks=ranks, use_local_synchronization=True)

    if rank == 2:  # the standby: waits for the survivor's call, then takes the dead victim's stage
        _meet(sync_dir, "rebuild", [1 - victim, 2], 2, timeout_s=40)
        out.update(_rebuild(torch, make_transport, _new_world(dist, row, victim), [0, 1], victim, device, row))
        return out

    stage = rank
    persistent = _persistent(torch, device) if stage == 1 else None
    src = _persistent(torch, device) if stage == 0 else None
    pair = fresh_group([0, 1])
    # Warm-up: the driver's IPC and peer machinery and NCCL's buffers stay; the baseline comes after them.
    warm = make_transport(pair, persistent, backend=transport_kind, timeout_s=timeout_s, device=device)
    _run_steps(torch, warm, stage, device, 99, 1, 20, None, src, persistent)
    warm.close()
    _meet(sync_dir, "warm", [0, 1], rank)  # (no collective: it would start the NCCL communicator in CE rows)
    baseline = _used_bytes(torch, device)
    out["baseline_used"] = baseline
    fault = _Fault(kind, phase, timeout_s, sync_dir) if rank == victim else None
    _faults.install(fault)
    transport = None
    raised = None
    start = time.monotonic()
    try:
        if fault is not None and phase.startswith("setup:"):
            fault.armed = True
        transport = make_transport(pair, persistent, backend=transport_kind, timeout_s=timeout_s, device=device)
        out["backend"] = transport.backend
        if phase == "close":
            _run_steps(torch, transport, stage, device, 7, 1, FAULT_STEP, None, src, persistent)
            if fault is not None:
                fault.armed = True
            if stage == 0 and device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            close_start = time.monotonic()
            transport.close()
            out["close_s"] = time.monotonic() - close_start
        else:
            # Past the fault the survivor goes on until its transport raises (or far past the bound).
            _steps_until_failure(torch, transport, stage, device, fault, src, persistent, timeout_s)
    except BaseException as err:  # noqa: BLE001 - the row records what was raised, interrupts included
        raised = err
    finally:
        _faults.install(None)
    now = time.time()
    since = _fault_time(sync_dir)
    out["raised"] = None if raised is None else f"{type(raised).__name__}: {str(raised)[:300]}"
    out["raised_type"] = None if raised is None else type(raised).__name__
    out["is_transport_error"] = isinstance(raised, TransportError)
    if since is None and phase == "close" and raised is None:
        out["seconds_after_fault"] = 0.0  # this stage's close() ended before the victim's fault
    else:
        out["seconds_after_fault"] = None if since is None else round(max(now - since, 0.0), 2)
    out["seconds_in_call"] = round(time.monotonic() - start, 2)
    say(f"stage {stage}: raised {out['raised']!r} ({out['seconds_after_fault']} s after the fault)")
    # Close (the survivor, and a victim that lived through its fault); a close() interrupted by the fault
    # itself is resumed by the second call.
    close_start = time.monotonic()
    for attempt in range(2):
        if transport is None:
            break
        try:
            transport.close()
            break
        except BaseException as err:  # noqa: BLE001 - recorded; the second attempt resumes
            out[f"close_error_{attempt}"] = repr(err)
    out["close_total_s"] = round(time.monotonic() - close_start, 2)
    # A failed set-up reports what it kept by design on its error; a built transport on itself.
    out["leaked_nbytes"] = getattr(raised, "leaked_nbytes", 0) if transport is None else transport.leaked_nbytes
    out["error_attr"] = None if transport is None or transport.error is None else type(transport.error).__name__
    after = _used_bytes(torch, device)
    out["after_used"] = after
    if baseline is not None and after is not None:
        out["memory_delta"] = after - baseline  # bytes still in use against the baseline
    survivor = 1 - victim
    if kind == "sigkill":
        if rank != survivor:
            raise AssertionError("a killed victim cannot get here")
        _meet(sync_dir, "rebuild", [survivor, 2], rank, timeout_s=40)
        out.update(_rebuild(torch, make_transport, _new_world(dist, row, survivor), [0, 1], stage, device, row))
        return out
    _meet(sync_dir, "rebuild", [0, 1], rank, timeout_s=40)
    group = pair if transport_kind == "copy_engine" else fresh_group([0, 1])
    out.update(_rebuild(torch, make_transport, group, [0, 1], rank, device, row))
    return out


def setup_row(rank: int, world: int, row: dict[str, Any]) -> dict[str, Any]:
    """One rank of a set-up row (``SETUP_FAULTS``): stage 1 gets set-up wrong, then both rebuild correctly.

    A peer that never arrived is replaced in a new world (a real one is dead or was never started); the
    other rows rebuild on the same group, which must still work.
    """
    import torch
    import torch.distributed as dist

    from syncless._core.launch import say
    from syncless.pp import make_transport

    fault, timeout_s, sync_dir = row["fault"], row["timeout_s"], row["sync_dir"]
    device = torch.device("cuda", torch.cuda.current_device()) if row["device"] == "cuda" else torch.device("cpu")
    out: dict[str, Any] = {"rank": rank}
    persistent = _persistent(torch, device) if rank == 1 else None
    kwargs = {"backend": row["transport"], "timeout_s": timeout_s, "device": device}
    raised = None
    start = time.monotonic()
    try:
        if fault == "peer never arrives" and rank == 1:
            say("stage 1: not taking part in make_transport")
        else:
            if fault == "mismatched arguments" and rank == 1:
                kwargs["backend"] = "torch_distributed" if row["transport"] == "copy_engine" else "auto"
            if fault == "malformed persistent" and rank == 1:
                persistent = list(persistent.values())
            transport = make_transport(None, persistent, **kwargs)
            transport.close()
    except BaseException as err:  # noqa: BLE001 - the row records what was raised
        raised = err
    out["seconds_in_call"] = round(time.monotonic() - start, 2)
    out["raised"] = None if raised is None else f"{type(raised).__name__}: {str(raised)[:300]}"
    out["raised_type"] = None if raised is None else type(raised).__name__
    say(f"stage {rank}: raised {out['raised']!r} after {out['seconds_in_call']} s")
    _meet(sync_dir, "rebuild", [0, 1], rank, timeout_s=40)
    group = _new_world(dist, row, rank) if fault == "peer never arrives" else None
    out.update(_rebuild(torch, make_transport, group, [0, 1], rank, device, row))
    return out


def judge_setup(row: dict[str, Any]) -> dict[str, Any]:
    """Verdict of a set-up row: the expected error on every stage that took part, in time; a rebuild that works."""
    ranks = row.get("ranks")
    if ranks is None:
        row.update(survivor_raised="(harness failed)", verdict="FAIL",
                   problems=["harness: " + row["harness_error"][-300:]])
        return row
    expected = SETUP_FAULTS[row["fault"]]
    taking_part = [0] if row["fault"] == "peer never arrives" else [0, 1]
    problems = []
    for index in taking_part:
        got = ranks[index].get("raised_type")
        if got != expected:
            problems.append(f"stage {index} raised {ranks[index].get('raised')!r}, not a {expected}")
    seconds = max(ranks[i]["seconds_in_call"] for i in taking_part)
    if seconds > row["timeout_s"] + SLACK_S:
        problems.append(f"stage 0 took {seconds} s (bound {row['timeout_s'] + SLACK_S:g} s)")
    rebuilt = [r for r in ranks if "rebuilt_ok" in r]
    exact = all(r["rebuilt_ok"] for r in rebuilt) and ranks[1].get("rebuilt_mismatches") == 0
    rebuild = f"{row['steps']} steps bit-exact" if len(rebuilt) == 2 and exact else "; ".join(
        r.get("rebuilt_error", f"mismatches {r.get('rebuilt_mismatches')}") for r in rebuilt) or "not run"
    if rebuild != f"{row['steps']} steps bit-exact":
        problems.append(f"rebuild: {rebuild}")
    row.update(survivor_raised=", ".join(str(ranks[i].get("raised_type")) for i in taking_part), seconds=seconds,
               memory="n/a (set-up)", rebuild=rebuild, verdict="ok" if not problems else "FAIL", problems=problems)
    return row


def _new_world(dist: Any, row: dict[str, Any], new_rank: int) -> Any:
    """After a SIGKILL: a new process group of the survivor and the standby (new rank = its stage); returns it.

    The standby made fewer groups than the survivor, and torch names a group made with
    ``use_local_synchronization`` by how many this process holds, so the two would never meet in a
    ``new_group``: they start a new world instead, as an elastic restart would.
    """
    import datetime

    dist.destroy_process_group()
    dist.init_process_group(row["backend"], init_method=f"file://{row['sync_dir']}/world2", rank=new_rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    return None


def _steps_until_failure(torch: Any, transport: Any, stage: int, device: Any, fault: _Fault | None,
                         src: Any, persistent: Any, timeout_s: float) -> None:
    """Run steps; the victim faults at FAULT_STEP; stop when the transport raises or 3 timeouts passed."""
    deadline = None
    step = 0
    while True:
        step += 1
        _run_steps(torch, transport, stage, device, 7, step, step, fault, src, persistent)
        if step == FAULT_STEP:
            deadline = time.monotonic() + 3 * timeout_s + 10
        if deadline is not None and time.monotonic() > deadline:
            return  # nothing raised: the row says so
        if step > FAULT_STEP:
            time.sleep(0.001)


def _rebuild(torch: Any, make_transport: Any, group: Any, order: list[int], rank: int, device: Any,
             row: dict[str, Any]) -> dict[str, Any]:
    """Build a new transport over ``order`` and run the row's steps bit-exact; return what happened."""
    from syncless._core.launch import say

    stage = order.index(rank)
    persistent = _persistent(torch, device) if stage == 1 else None
    src = _persistent(torch, device) if stage == 0 else None
    result: dict[str, Any] = {}
    try:
        # A stuck stream of the old transport (an NCCL receive of a dead peer) must not hold the new one.
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else _nothing():
            transport = make_transport(group, persistent, stage_ranks=order, backend=row["transport"],
                                       timeout_s=row["timeout_s"], device=device)
            bad = _run_steps(torch, transport, stage, device, 4242, 1, row["steps"], None, src, persistent)
            if device.type == "cuda":
                stream.synchronize()
            transport.close()
        result["rebuilt_backend"] = transport.backend
        result["rebuilt_mismatches"] = bad if stage == 1 else None
        result["rebuilt_leaked_nbytes"] = transport.leaked_nbytes
        result["rebuilt_ok"] = True
        say(f"rebuilt: {row['steps']} steps, {bad} mismatching elements")
    except BaseException as err:  # noqa: BLE001 - the row records it
        result["rebuilt_ok"] = False
        result["rebuilt_error"] = f"{type(err).__name__}: {str(err)[:300]}"
    return result


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# -- the parent: rows, the table ------------------------------------------------------------------------


def rows_for(device: str, transports: list[str], faults: list[str], phases: list[str] | None) -> list[dict[str, Any]]:
    """Every (transport, fault, phase) row asked for, in table order."""
    rows = []
    for transport in transports:
        setup = SETUP_PHASES_CE if transport == "copy_engine" else SETUP_PHASES_TD
        for phase in (*setup, *STEP_PHASES):
            if phases and phase not in phases:
                continue
            for fault in faults:
                if fault not in SETUP_FAULTS:
                    rows.append({"device": device, "transport": transport, "fault": fault, "phase": phase})
        for fault in faults:
            if fault in SETUP_FAULTS and (not phases or SETUP_PHASE in phases):
                rows.append({"device": device, "transport": transport, "fault": fault, "phase": SETUP_PHASE})
    return rows


def run_row(row: dict[str, Any], timeout_s: float, steps: int) -> dict[str, Any]:
    """Run one row in fresh processes; return the row with its outcome and verdict."""
    from syncless._core.launch import RankFailed, run_ranks

    sync_dir = tempfile.mkdtemp(prefix="syncless-fault-")
    setup = row["fault"] in SETUP_FAULTS
    world = 3 if row["fault"] == "sigkill" else 2
    victim = VICTIM[row["phase"]]
    cuda = row["device"] == "cuda"
    devices = [0, 1, victim][:world] if cuda else None
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    plan = {**row, "timeout_s": timeout_s, "sync_dir": sync_dir, "steps": steps, "backend": backend}
    started = time.monotonic()
    try:
        results = run_ranks(setup_row if setup else fault_row, world, args=(plan,), backend=backend, init="file",
                            devices=devices, timeout_s=45 + 6 * timeout_s,
                            may_die={victim} if row["fault"] == "sigkill" else (),
                            load_by_file=True, progress=True, env={"PYTHONUNBUFFERED": "1"})
        outcome = {"ranks": results}
    except RankFailed as err:
        outcome = {"ranks": None, "harness_error": str(err)[-2000:]}
    outcome["wall_s"] = round(time.monotonic() - started, 1)
    if setup:
        return judge_setup({**row, "timeout_s": timeout_s, "steps": steps, **outcome})
    return judge({**row, "timeout_s": timeout_s, "steps": steps, **outcome})


def judge(row: dict[str, Any]) -> dict[str, Any]:
    """Add the table's columns and a verdict to a finished row."""
    victim = VICTIM[row["phase"]]
    survivor_index = 1 - victim
    ranks = row.get("ranks")
    bound = row["timeout_s"] + SLACK_S
    problems = []
    if ranks is None:
        row.update(survivor_raised="(harness failed)", verdict="FAIL",
                   problems=["harness: " + row["harness_error"][-300:]])
        return row
    s = ranks[survivor_index]
    if row["phase"] == "close":
        raised = f"close() returned in {s.get('close_s', s.get('close_total_s')):.2f} s"
        seconds = s.get("seconds_after_fault")
        if s.get("raised") is not None:
            problems.append(f"close() raised {s['raised']}")
    else:
        raised = s.get("raised_type") or "nothing"
        seconds = s.get("seconds_after_fault")
        if not s.get("is_transport_error"):
            problems.append(f"the survivor raised {s.get('raised')!r}, not a TransportError")
    if seconds is None or seconds > bound:
        problems.append(f"the survivor took {seconds} s (bound {bound:g} s)")
    delta, leaked = s.get("memory_delta"), s.get("leaked_nbytes", 0)
    if row["device"] != "cuda":
        memory = "n/a (CPU)"
    elif delta is None:
        memory = "unreadable (stream stuck)"
        problems.append("device memory could not be read: the survivor's stream is stuck")
    elif abs(delta) <= MEMORY_SLACK_NBYTES and leaked == 0:
        memory = f"baseline ({delta / 2**20:+.1f} MiB)"
    elif leaked and -MEMORY_SLACK_NBYTES <= delta <= leaked + MEMORY_SLACK_NBYTES:
        memory = f"leaked by design {leaked} B ({delta / 2**20:+.1f} MiB)"
    else:
        memory = f"UNEXPLAINED {delta / 2**20:+.1f} MiB (reported leak {leaked} B)"
        problems.append(memory)
    rebuilt = [r for r in ranks if r is not None and "rebuilt_ok" in r]
    receiver = [r for r in rebuilt if r.get("rebuilt_mismatches") is not None]
    exact = receiver and receiver[0]["rebuilt_mismatches"] == 0
    if len(rebuilt) == 2 and all(r["rebuilt_ok"] for r in rebuilt) and exact:
        rebuild = f"{row['steps']} steps bit-exact"
    else:
        stories = [r.get("rebuilt_error", f"mismatches {r.get('rebuilt_mismatches')}") for r in rebuilt]
        rebuild = "; ".join(stories) or "not run"
        problems.append(f"rebuild: {rebuild}")
    row.update(survivor_raised=raised, seconds=seconds, memory=memory, rebuild=rebuild,
               verdict="ok" if not problems else "FAIL", problems=problems)
    return row


def write_table(out_dir: pathlib.Path, rows: list[dict[str, Any]]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "table.json").write_text(json.dumps(rows, indent=1, default=str))
    lines = ["| transport | fault | phase | victim | survivor raised | s after fault | survivor memory | rebuilt "
             "| verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['transport']} | {r['fault']} | {r['phase']} | stage {VICTIM[r['phase']]} | "
                     f"{r.get('survivor_raised')} | {r.get('seconds')} | {r.get('memory')} | {r.get('rebuild')} | "
                     f"{r['verdict']}{': ' + '; '.join(r['problems']) if r['problems'] else ''} |")
    (out_dir / "table.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=pathlib.Path)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--transports", default=None, help="comma list: copy_engine, torch_distributed")
    parser.add_argument("--faults", default=",".join((*FAULTS, *SETUP_FAULTS)),
                        help="comma list (default: all): " + ", ".join((*FAULTS, *SETUP_FAULTS)))
    parser.add_argument("--phases", default=None, help="comma list of phases (default: all)")
    parser.add_argument("--timeout-s", type=float, default=3.0)
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args(argv)
    transports = (args.transports or ("copy_engine,torch_distributed" if args.device == "cuda" else
                                      "torch_distributed")).split(",")
    rows = rows_for(args.device, transports, args.faults.split(","), args.phases.split(",") if args.phases else None)
    done = []
    print(f"fault table: {len(rows)} rows, timeout {args.timeout_s:g} s -> {args.out_dir}", flush=True)
    for row in rows:
        result = run_row(row, args.timeout_s, args.steps)
        done.append(result)
        write_table(args.out_dir, done)
        print(f"ROW {result['transport']:17} {result['fault']:7} {result['phase']:17} "
              f"raised={result.get('survivor_raised')} "
              f"after={result.get('seconds')}s memory={result.get('memory')} rebuild={result.get('rebuild')} "
              f"-> {result['verdict']} {result['problems'] or ''}", flush=True)
    failed = [r for r in done if r["verdict"] != "ok"]
    print(f"fault table: {len(done) - len(failed)}/{len(done)} rows ok; {args.out_dir / 'table.md'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
