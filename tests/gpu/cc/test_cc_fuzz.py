"""The differential fuzzer for syncless.cc on one GPU: plain torch is the oracle (see cc_fuzz.py, cc_fuzz_gen.py, cc_fuzz_run.py).

``SYNCLESS_FUZZ_PROGRAMS`` programs (default 20,000; ``SYNCLESS_FUZZ_TIME_S``
stops it early, at a round of 400, and it reports how many ran), seeds
``SYNCLESS_FUZZ_SEED + i``, spread round-robin over the four configurations
shim x emulation (off/off runs the oracle's program a second time: a
generator that made a racy program shows up there). Each run's host-visible
results must be bit-identical to the oracle's. A failure prints its seed,
its configuration, and a minimized program. Reproduce one program with
``SYNCLESS_FUZZ_SEED=<seed> SYNCLESS_FUZZ_PROGRAMS=4`` (program 0 runs in
the plain configuration; use ``<seed> - k`` to land it on configuration k).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # cc_fuzz and cc_fuzz_run live next to this file
import cc_fuzz as fuzz  # noqa: E402
from cc_fuzz_gen import program_for  # noqa: E402
from cc_fuzz_run import Runner, TorchBackend  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

# (name, shim, emulation)
CONFIGS = (("plain", False, False), ("shim", True, False), ("emulation", False, True), ("shim+emulation", True, True))
MAX_MINIMIZED = 3


def _configure(cc, shim: bool, emulation: bool) -> None:
    cc.uninstall()
    if shim and emulation:
        cc.install("emulate")
    elif shim:
        cc.install("on")
    elif emulation:
        cc.emulate()


def _outcome(runner, spec):
    try:
        return runner.run(spec)
    except Exception as err:  # noqa: BLE001 - an exception is an outcome to compare with the oracle's
        return [f"raised {type(err).__name__}: {err}"]


def _sum_stats(total, more):
    """Add two ``cc.stats()`` snapshots (None: nothing yet)."""
    if total is None:
        return more
    left_alone = dict(total.left_alone)
    for reason, count in more.left_alone.items():
        left_alone[reason] = left_alone.get(reason, 0) + count
    return dataclasses.replace(total, staged=total.staged + more.staged, in_place=total.in_place + more.in_place,
                               offloaded=total.offloaded + more.offloaded,
                               emulated_waits=total.emulated_waits + more.emulated_waits, left_alone=left_alone)


def _first_difference(expected, got) -> str:
    if len(expected) != len(got):
        return f"{len(got)} results instead of {len(expected)}: {got[-1] if got else ''}"
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return f"result {i} differs: oracle {a} / got {b}"
    return "no difference"


def test_differential_fuzz():
    import torch

    import syncless.cc as cc
    from syncless._core import config

    n_programs = config.read("SYNCLESS_FUZZ_PROGRAMS")
    seed0 = config.read("SYNCLESS_FUZZ_SEED")
    budget_s = config.read("SYNCLESS_FUZZ_TIME_S")
    dev = torch.device("cuda", 0)
    cc.uninstall()
    cc.reset_stats()
    runner = Runner(TorchBackend(cc, dev))
    started = time.monotonic()
    specs = []
    failures = []  # (index, config index, difference)
    oracle_errors = []
    ran = {name: 0 for name, _, _ in CONFIGS}
    stats = {name: None for name, _, _ in CONFIGS}
    copies = 0
    chunk = 400  # programs per round: the oracle runs them, then each configuration its quarter
    try:
        for first in range(0, n_programs, chunk):
            if budget_s and time.monotonic() - started > budget_s:
                print(f"cc fuzz: time budget of {budget_s:g} s spent after {len(specs)} programs", flush=True)
                break
            batch = [program_for(seed0 + i) for i in range(first, min(first + chunk, n_programs))]
            specs.extend(batch)
            cc.uninstall()
            oracle = [_outcome(runner, spec) for spec in batch]
            oracle_errors += [(spec.seed, out[0]) for spec, out in zip(batch, oracle) if out and out[0].startswith("raised")]
            for c, (name, shim, emulation) in enumerate(CONFIGS):
                _configure(cc, shim, emulation)
                cc.reset_stats()
                for k in range(c, len(batch), len(CONFIGS)):
                    got = _outcome(runner, batch[k])
                    ran[name] += 1
                    copies += fuzz.count_copies(batch[k].ops)
                    if got != oracle[k]:
                        failures.append((first + k, c, _first_difference(oracle[k], got)))
                stats[name] = _sum_stats(stats[name], cc.stats())
            if len(specs) % 4000 == 0:
                print(f"cc fuzz: {len(specs)}/{n_programs} programs, {len(failures)} failures "
                      f"({time.monotonic() - started:.0f} s)", flush=True)
    finally:
        cc.uninstall()
    for name, _, _ in CONFIGS:
        print(f"cc fuzz: {name}: {ran[name]} programs, {stats[name]}", flush=True)
    n_programs = len(specs)
    per_config = {name: (ran[name], stats[name]) for name, _, _ in CONFIGS}

    if failures:
        listed = ", ".join(f"{specs[i].seed}/{CONFIGS[c][0]}" for i, c, _ in failures[:20])
        print(f"\ncc fuzz: {len(failures)} failing runs (seed/configuration): {listed}", flush=True)
    for i, c, difference in failures[:MAX_MINIMIZED]:
        name, shim, emulation = CONFIGS[c]

        def still_fails(candidate, shim=shim, emulation=emulation):
            for _ in range(3):  # a race may need a few tries
                cc.uninstall()
                expected = _outcome(runner, candidate)
                _configure(cc, shim, emulation)
                got = _outcome(runner, candidate)
                cc.uninstall()
                if got != expected:
                    return True
            return False

        small = fuzz.minimize(specs[i], still_fails)
        print(f"\ncc fuzz FAILURE: seed {specs[i].seed}, configuration {name}: {difference}\n"
              f"minimized program ({len(small.ops)} of {len(specs[i].ops)} ops):\n{small.describe()}", flush=True)

    elapsed = time.monotonic() - started
    print(f"cc fuzz: programs {n_programs}, runs compared {sum(r for r, _ in per_config.values())}, "
          f"copies {copies}, configurations {len(CONFIGS)}, failures {len(failures)}, "
          f"oracle exceptions {len(oracle_errors)}, {elapsed:.0f} s", flush=True)
    assert not oracle_errors, f"the oracle itself raised (a generator bug): {oracle_errors[:3]}"
    assert not failures, f"{len(failures)} programs differ from plain torch; first: seed {specs[failures[0][0]].seed}"
    if n_programs >= 400:  # the fuzzer must reach every path of the shim, or it proves little
        shim_stats = per_config["shim+emulation"][1]
        assert shim_stats.offloaded > 0 and shim_stats.staged > 0 and shim_stats.in_place > 0, shim_stats
        assert shim_stats.emulated_waits > 0, shim_stats
