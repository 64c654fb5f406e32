"""One pipeline stage of the demo: its part of the model and its decode loop, run once per transport.

Each rank runs :func:`run_stage`. It builds its part of the model once, then
runs the same decode loop for each entry of ``options.runs``: first with
``make_transport``'s choice (copy engines where eligible), then with its
``torch_distributed`` backend. Activations go stage to stage through the
transport; the last stage's sampled tokens go back to the first stage
through a second transport, and to the host on a D2H stream. Several
micro-batches are in flight so every stage has work while the others run.

Streams on a GPU rank, one step of one micro-batch (stage 0 of 2)::

    current  |upload pos (H2D, non_blocking)|embed+layers|wait empty|copy->peer|full=N|...
    d2h      (last stage only)          wait current |tokens -> pinned host|

The host never waits inside the hot loop: it only enqueues, and the syncs
it would make are recorded by the detector (``--plant-sync`` adds one on
purpose, in :func:`_planted_sync`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from syncless.demo._config import ModelConfig, split_layers
from syncless.demo._model import Stage

#: The baseline run's label, and the backend make_transport builds for it.
BASELINE_BACKEND = "torch_distributed"


@dataclass
class DemoOptions:
    """What the demo runs (picklable: sent to every rank)."""

    model: ModelConfig
    model_name: str = "custom"
    steps: int = 64
    batch: int = 8
    micro_batches: int = 2
    stages: int = 2
    devices: list[str] = field(default_factory=list)
    runs: list[str] = field(default_factory=lambda: ["syncless"])
    transport: str | None = None
    cc_mode: str | None = None
    dtype: str = "bfloat16"
    warmup_steps: int = 4
    seed: int = 0
    progress_every: int = 16
    plant_sync: bool = False
    measure_pending: bool = False


@dataclass
class RunResult:
    """One decode run (one transport) as one stage saw it."""

    label: str
    transport: str | None
    transport_reason: str | None
    tokens_generated: int
    elapsed_s: float
    syncs: list[dict[str, Any]]
    sync_report: str
    sync_checked: bool
    sample: list[list[int]]


@dataclass
class StageResult:
    """What one stage reports back to the launcher."""

    rank: int
    device: str
    layers: list[int]
    cc: dict[str, Any]
    runs: list[RunResult]
    sync_unchecked_reason: str | None = None
    pending: dict[str, Any] | None = None


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if device.type == "cpu":
        return torch.float32  # bf16 matmuls on CPU are slow and add nothing to the demo
    return getattr(torch, name)


def _quiet_repeated_warnings() -> None:
    """Leave the transport's fallback and the detector's "nothing to check" to the summary.

    Each would otherwise print once per transport and per process; the
    summary states each once, with its reason.
    """
    logging.getLogger("syncless.pp").setLevel(logging.ERROR)
    logging.getLogger("syncless.syncs").setLevel(logging.ERROR)


def run_stage(rank: int, world_size: int, options: DemoOptions) -> StageResult:
    """Build this rank's stage, decode once per entry of ``options.runs``, return its report."""
    from syncless import cc, syncs

    _quiet_repeated_warnings()
    device = torch.device(options.devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        decision = cc.decide_mode(options.cc_mode)
        cc_state = {"mode": decision.mode, "reason": decision.reason}
        cc.install(decision.mode)  # "off" patches nothing; "emulate" adds the emulator beneath the shim
    else:
        from syncless._core import config

        requested = options.cc_mode or config.read("SYNCLESS_CC")
        ignored = f"; SYNCLESS_CC={requested} does not apply" if requested in ("on", "emulate") else ""
        cc_state = {"mode": "off", "reason": f"CPU run: no host<->device copies{ignored}"}

    cfg = options.model
    layer_ranges = split_layers(cfg.layers, world_size)
    stage = Stage(cfg, layer_ranges[rank], first=rank == 0, last=rank == world_size - 1,
                  batch=options.batch * options.micro_batches, device=device, dtype=_dtype(options.dtype, device),
                  seed=options.seed)
    d2h_stream = None
    if rank == world_size - 1 and device.type == "cuda":
        d2h_stream = cc.new_d2h_stream(device) if cc.is_installed() else torch.cuda.Stream(device)

    backends = [options.transport if label == options.runs[0] else BASELINE_BACKEND for label in options.runs]
    links = _make_links(rank, world_size, options, backends, device)
    runs = []
    try:
        for label, (activations, token_link) in zip(options.runs, links):
            runs.append(_decode(rank, world_size, options, label, stage, device, activations, token_link, d2h_stream))
    except BaseException:
        # The runs not reached: their transports go without the collective close (a stage has failed).
        for pair in links[len(runs) + 1:]:
            for link in pair:
                if link is not None:
                    link.abort()
        raise
    unchecked = None
    if not any(run.sync_checked for run in runs):
        from syncless.syncs import _debugmode

        if device.type != "cuda":
            unchecked = "CPU run: nothing here waits for a GPU"
        else:
            unchecked = _debugmode.backend().unavailable_reason() or f"SYNCLESS_SYNC_CHECK is {syncs.mode()}"
    pending = None
    if options.measure_pending:
        from syncless.demo._pending import measure_pending

        pending = measure_pending(rank, device)
    return StageResult(rank=rank, device=str(device), layers=list(layer_ranges[rank]), cc=cc_state, runs=runs,
                       sync_unchecked_reason=unchecked, pending=pending)


def _make_links(rank: int, world_size: int, options: DemoOptions, backends: list[str | None],
                device: torch.device) -> list[tuple[Any, Any]]:
    """Make every run's transports before the first run: (activations, token link) per entry of ``backends``.

    Each ``make_transport`` makes a gloo group of its own, which torch names
    by its ranks and by how many groups the process already holds; so
    whenever one over every stage is made, every stage must hold the same
    number of groups. The token links are over the first and last stages
    only, so they come after every transport over all stages (made one run
    at a time instead, the second run's activation set-up hangs with more
    than two stages). The first and last stages' group is made by every
    rank in between, as ``dist.new_group`` requires.
    """
    from syncless import pp

    if world_size == 1:
        return [(None, None) for _ in backends]
    cfg = options.model
    first, last = rank == 0, rank == world_size - 1
    rows, micro = options.batch, options.micro_batches
    dtype = _dtype(options.dtype, device)

    def hidden_in() -> dict[str, torch.Tensor] | None:
        return None if first else {"hidden": torch.empty(rows, cfg.hidden, device=device, dtype=dtype)}

    # device=: the first stage holds no persistent tensors, and its default (the current CUDA device where there
    # is one) would disagree with the others' on a GPU machine running the demo on its CPU.
    activations = [pp.make_transport(None, hidden_in(), backend=backend, device=device) for backend in backends]
    ends = dist.new_group([0, world_size - 1])
    token_links: list[Any] = [None] * len(backends)
    if first or last:
        for index, backend in enumerate(backends):
            tokens_in = {"ids": torch.empty(rows, device=device, dtype=torch.int64)} if first else None
            # Each step's `micro` tokens are received only in the next step, so the link holds that many.
            token_links[index] = pp.make_transport(ends, tokens_in, stage_ranks=[world_size - 1, 0],
                                                   backend=backend, depth=max(2, micro), device=device)
    return list(zip(activations, token_links))


def _decode(rank: int, world_size: int, options: DemoOptions, label: str, stage: Stage, device: torch.device,
            activations: Any, token_link: Any, d2h_stream: Any) -> RunResult:
    """Run warm-up and ``options.steps`` measured decode steps over this run's transports; close them.

    ``activations`` and ``token_link`` come from :func:`_make_links` (None
    where this stage has no such link).
    """
    from syncless import syncs

    cfg = options.model
    first, last = rank == 0, rank == world_size - 1
    rows, micro = options.batch, options.micro_batches

    generator = torch.Generator().manual_seed(options.seed + 17)
    prompts = [torch.randint(0, cfg.vocab, (rows,), generator=generator) for _ in range(micro)]
    local_tokens: list[torch.Tensor | None] = [None] * micro
    readbacks: deque[tuple[torch.Tensor, Any]] = deque(maxlen=4)  # the summary shows the last few
    total_steps = options.warmup_steps + options.steps
    plant = options.plant_sync and last

    def upload(host: torch.Tensor) -> torch.Tensor:
        """Pinned host tensor -> device, ``non_blocking`` (enqueued on the current stream)."""
        if device.type == "cuda":
            host = host.pin_memory()
        return host.to(device, non_blocking=True)

    def one_step(step: int) -> None:
        position = step % cfg.max_tokens
        # Every row of a step decodes at the same position: one upload serves all micro-batches.
        positions = upload(torch.full((rows,), position, dtype=torch.int64)) if first else None
        for slot in range(micro):
            if first:
                if step == 0:
                    x = upload(prompts[slot])
                elif world_size == 1:
                    x = local_tokens[slot]
                else:
                    x = token_link.recv()["ids"]
            else:
                x = activations.recv()["hidden"]
            out = stage(x, positions, position, slot * rows)
            if not last:
                activations.send({"hidden": out})
                continue
            if plant:
                _planted_sync(out)
            if world_size == 1:
                local_tokens[slot] = out
            elif step < total_steps - 1:  # the first stage takes no tokens after the final step
                token_link.send({"ids": out})
            readbacks.append(_read_back(out, d2h_stream))

    try:
        with torch.inference_mode():
            for step in range(options.warmup_steps):
                one_step(step)
            _settle(device)
            readbacks.clear()
            syncs.reset()
            syncs.set_mode("record")
            # The gate opens after warm-up: set-up may synchronize freely. A CPU stage has no GPU to wait for
            # (its .item() is a plain read), so it is not checked, on a CUDA build too.
            checked = syncs.enable() if device.type == "cuda" else False
            start_s = time.perf_counter()
            for step in range(options.warmup_steps, total_steps):
                with syncs.checking():
                    one_step(step)
                done = step + 1 - options.warmup_steps
                if last and done % options.progress_every == 0:
                    print(f"  {label}: {done}/{options.steps} steps enqueued ({time.perf_counter() - start_s:.1f} s)",
                          flush=True)
            _settle(device)
            elapsed_s = time.perf_counter() - start_s
            syncs.disable()
        report = syncs.report()
        sample = _collect_tokens(readbacks) if last else []
    finally:
        for link in (activations, token_link):
            if link is not None:
                link.close()
    return RunResult(
        label=label,
        transport=activations.backend if activations else None,
        transport_reason=activations.fallback_reason if activations else None,
        tokens_generated=options.steps * micro * rows if last else 0,
        elapsed_s=elapsed_s, sample=sample, sync_report=report.format(), sync_checked=checked,
        syncs=[{"site": s.site, "count": s.count, "operation": s.first.operation, "function": s.first.function}
               for s in report.sites],
    )


def _planted_sync(tokens: torch.Tensor) -> int:
    """Read one token on the host: the hidden sync ``--plant-sync`` adds, for the detector to catch."""
    return int(tokens[0].item())


def _read_back(tokens: torch.Tensor, d2h_stream: Any) -> tuple[torch.Tensor, Any]:
    """Copy ``tokens`` to pinned host memory on ``d2h_stream``; never blocks the host."""
    if d2h_stream is None:
        return tokens.clone(), None
    d2h_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(d2h_stream):
        host = tokens.to("cpu", non_blocking=True)
        done = torch.cuda.Event()
        done.record(d2h_stream)
    tokens.record_stream(d2h_stream)
    return host, done


def _collect_tokens(readbacks: Iterable[tuple[torch.Tensor, Any]]) -> list[list[int]]:
    """After the loop: wait for the last read-backs and return them for the summary."""
    sample = []
    for host, done in readbacks:
        if done is not None:
            done.synchronize()
        sample.append(host[:8].tolist())
    return sample


def _settle(device: torch.device) -> None:
    """Wait for this rank's current stream, then line the ranks up (outside the hot loop).

    The token link has a slot for every micro-batch, so the last stage's
    sends of the step before never wait here for the first stage, which
    receives them only after this point. Not a device-wide synchronize: the
    transports' private streams are none of the demo's business.
    """
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    dist.barrier()
