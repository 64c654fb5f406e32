"""Probe 6: where the relay's time goes in a ping-pong on torch's default stream.

Runs `syncless bench pp`'s own rig (two processes, one per GPU) with its
sections replaced by: one-way latency (NCCL, ours depth 2, ours depth 0) on
the legacy default stream for three ways of sending from it, interleaved over
rounds, then sustained bandwidth of ours for the same three:

- head:    send() as at 7289c42 (relay: wait for the caller's work, then the receiver's flag)
- flag1st: send() of this tree (relay: the receiver's flag first, then the caller's work)
- direct:  no relay (the peer copy is issued on the legacy default stream itself)

Needs probe6_head_copy_engine.py beside it (7289c42's _copy_engine.py).
Command: PYTHONPATH=src python3 bench/results/2026-11-30-h200x2-probes/probe6_relay_order.py
"""

import importlib.util
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = ("head", "flag1st", "direct")
ROUNDS = 3


def _variant(name):
    import syncless.pp._copy_engine as ce

    if not hasattr(ce, "_probe_new_send"):
        spec = importlib.util.spec_from_file_location("probe6_head", HERE / "probe6_head_copy_engine.py")
        head = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(head)
        ce._probe_new_send = ce.CopyEngineTransport.send
        ce._probe_head_send = head.CopyEngineTransport.send
    ce.CopyEngineTransport.send = ce._probe_head_send if name == "head" else ce._probe_new_send
    ce.LEGACY_DEFAULT_STREAM = -1 if name == "direct" else 0


def probe_sections(rig):
    from syncless.bench._pp_measure import bandwidth_nccl, bandwidth_ours, latency
    from syncless.bench._pp_plan import size_label

    say = rig.report.progress if rig.sender else (lambda text: None)
    table = {}
    for round_index in range(ROUNDS):
        for name in VARIANTS:
            _variant(name)
            for i, nbytes in enumerate(rig.plan.latency_payloads):
                for method in ("nccl", "ours", "ours_depth0"):
                    us = latency(rig, nbytes, 700 + i, method)
                    table.setdefault((name, method, nbytes), []).append(us)
                    say(f"round {round_index} {name:8s} {size_label(nbytes):7s} {method:12s} {us:6.1f} us")
    _variant("flag1st")
    for i, nbytes in enumerate(rig.plan.latency_payloads):
        us = latency(rig, nbytes, 800 + i, "ours_depth0@own")
        say(f"own stream {size_label(nbytes):7s} ours_depth0  {us:6.1f} us")
    for key, values in sorted(table.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        say(f"median {key[0]:8s} {size_label(key[2]):7s} {key[1]:12s} {statistics.median(values):6.1f} us  {values}")
    for nbytes in rig.plan.payloads:
        nccl = rig.gather(bandwidth_nccl(rig, nbytes, 900))[1]
        say(f"bandwidth {size_label(nbytes):7s} nccl     {nccl:6.1f} GB/s")
        for name in VARIANTS:
            _variant(name)
            ours = rig.gather(bandwidth_ours(rig, nbytes, 901))[1]
            say(f"bandwidth {size_label(nbytes):7s} {name:8s} {ours:6.1f} GB/s  ({ours / nccl:.3f}x NCCL)")
    _variant("flag1st")


def probe_child(rank, port, plan, queue):
    from syncless.bench import _pp_worker

    _pp_worker._run_sections = probe_sections
    _pp_worker.child_main(rank, port, plan, queue)


def main():
    from syncless.bench import _pp_launch, _pp_worker
    from syncless.bench._pp_plan import MIB, Plan

    plan = Plan(quick=False, payloads=(8 * MIB, 64 * MIB, 256 * MIB), cpu_nbytes=8 * MIB, hard_timeout_s=400.0)
    _pp_worker.child_main = probe_child
    outcome = _pp_launch.launch(plan, lambda text: print(text, flush=True))
    print(f"complete: {outcome.complete}; failure: {outcome.failure}", flush=True)
    for text in (*outcome.notes, *outcome.errors.values()):
        print(text, flush=True)


if __name__ == "__main__":
    sys.exit(main())
