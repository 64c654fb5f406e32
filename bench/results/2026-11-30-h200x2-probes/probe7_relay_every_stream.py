"""Probe 7: should a depth >= 1 step go through the relay stream from every caller's stream?

Same rig as probe 6. Two ways of sending, interleaved over rounds:

- legacy_only: send() at d6c57b1 (relay only from the legacy default stream; the flag first)
- every:       the candidate (a depth >= 1 step always goes through the relay stream)

Measured: one-way latency of ours (depth 2) on a created stream of each rank
and on the default stream, with NCCL beside it; sustained bandwidth of ours
with the callers on a created stream of their own.

Needs probe7_head_copy_engine.py beside it (d6c57b1's _copy_engine.py).
Command: PYTHONPATH=src python3 bench/results/2026-11-30-h200x2-probes/probe7_relay_every_stream.py
"""

import importlib.util
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = ("legacy_only", "every")
ROUNDS = 3


def _variant(name):
    import syncless.pp._copy_engine as ce

    if not hasattr(ce, "_probe_new_send"):
        spec = importlib.util.spec_from_file_location("probe7_head", HERE / "probe7_head_copy_engine.py")
        head = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(head)
        ce._probe_new_send = ce.CopyEngineTransport.send
        ce._probe_head_send = head.CopyEngineTransport.send
    ce.CopyEngineTransport.send = ce._probe_head_send if name == "legacy_only" else ce._probe_new_send


def probe_sections(rig):
    import torch

    from syncless.bench._pp_measure import bandwidth_nccl, bandwidth_ours, latency
    from syncless.bench._pp_plan import size_label

    say = rig.report.progress if rig.sender else (lambda text: None)
    table = {}
    for round_index in range(ROUNDS):
        for name in VARIANTS:
            _variant(name)
            for i, nbytes in enumerate(rig.plan.latency_payloads):
                for method in ("nccl@own", "ours@own", "ours"):
                    us = latency(rig, nbytes, 700 + i, method)
                    table.setdefault((name, method, nbytes), []).append(us)
                    say(f"round {round_index} {name:11s} {size_label(nbytes):7s} {method:10s} {us:6.1f} us")
    for key, values in sorted(table.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        say(f"median {key[0]:11s} {size_label(key[2]):7s} {key[1]:10s} {statistics.median(values):6.1f} us  {values}")
    if rig.own_stream is None:
        rig.own_stream = torch.cuda.Stream(rig.device)
    with torch.cuda.stream(rig.own_stream):
        for nbytes in rig.plan.payloads:
            nccl = rig.gather(bandwidth_nccl(rig, nbytes, 900))[1]
            say(f"own-stream bandwidth {size_label(nbytes):7s} nccl        {nccl:6.1f} GB/s")
            for name in VARIANTS:
                _variant(name)
                ours = rig.gather(bandwidth_ours(rig, nbytes, 901))[1]
                say(f"own-stream bandwidth {size_label(nbytes):7s} {name:11s} {ours:6.1f} GB/s ({ours / nccl:.3f}x NCCL)")
    _variant("every")


def probe_child(rank, port, plan, queue):
    from syncless.bench import _pp_worker

    _pp_worker._run_sections = probe_sections
    _pp_worker.child_main(rank, port, plan, queue)


def main():
    from syncless.bench import _pp_launch, _pp_worker
    from syncless.bench._pp_plan import KIB, MIB, Plan

    plan = Plan(quick=False, payloads=(64 * KIB, 8 * MIB, 64 * MIB, 256 * MIB), cpu_nbytes=8 * MIB,
                hard_timeout_s=300.0)
    _pp_worker.child_main = probe_child
    outcome = _pp_launch.launch(plan, lambda text: print(text, flush=True))
    print(f"complete: {outcome.complete}; failure: {outcome.failure}", flush=True)
    for text in (*outcome.notes, *outcome.errors.values()):
        print(text, flush=True)


if __name__ == "__main__":
    sys.exit(main())
