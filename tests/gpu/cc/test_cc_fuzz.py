"""The differential fuzzer for syncless.cc on one GPU, with two oracles (see cc_fuzz.py, cc_fuzz_gen.py, cc_fuzz_run.py).

``SYNCLESS_FUZZ_PROGRAMS`` programs (default 20,000; ``SYNCLESS_FUZZ_TIME_S``
stops it early, at a round of 400, and it reports how many ran), seeds
``SYNCLESS_FUZZ_SEED + i``. Half are generated for each oracle:

- ``torch``: plain torch is the oracle; the programs are spread round-robin
  over the four configurations shim x emulation (off/off runs the oracle's
  program a second time: a generator that made a racy program shows up there).
- ``cc``: CC without the shim (``cc.emulate()`` alone, where every
  host<->device copy has finished when its call returns) is the oracle; the
  programs read offloaded results after any call that covers them by the
  seed's rule, so they may race under plain torch. They run under
  ``cc.install("emulate")`` (three in four) or emulation alone again.

Each run's host-visible results must be bit-identical to its oracle's. A
failure prints its seed, oracle, configuration and a minimized program; the
end prints the counts per oracle and per configuration. Reproduce one program
with ``SYNCLESS_FUZZ_SEED=<seed> SYNCLESS_FUZZ_PROGRAMS=1``.
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
TORCH_CONFIGS = (("plain", False, False), ("shim", True, False), ("emulation", False, True),
                 ("shim+emulation", True, True))
CC_CONFIGS = (("emulation", False, True), ("shim+emulation", True, True), ("shim+emulation", True, True),
              ("shim+emulation", True, True))
# oracle -> (its own setup: shim, emulation; the configurations compared with it)
ORACLES = {"torch": ((False, False), TORCH_CONFIGS), "cc": ((False, True), CC_CONFIGS)}
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
    counts = {f.name: getattr(total, f.name) + getattr(more, f.name) for f in dataclasses.fields(total)
              if f.name != "left_alone"}
    return dataclasses.replace(total, left_alone=left_alone, **counts)


def _first_difference(expected, got) -> str:
    if len(expected) != len(got):
        return f"{len(got)} results instead of {len(expected)}: {got[-1] if got else ''}"
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return f"result {i} differs: oracle {a} / got {b}"
    return "no difference"


def _names(oracle):
    return list(dict.fromkeys(name for name, _, _ in ORACLES[oracle][1]))


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
    failures = []  # (spec, oracle, config, difference)
    oracle_errors = []
    ran = {(o, name): 0 for o in ORACLES for name in _names(o)}
    stats = dict.fromkeys(ran)
    copies = 0
    chunk = 400  # programs per round: each oracle runs its share, then each configuration its part of that
    try:
        for first in range(0, n_programs, chunk):
            if budget_s and time.monotonic() - started > budget_s:
                print(f"cc fuzz: time budget of {budget_s:g} s spent after {len(specs)} programs", flush=True)
                break
            batch = [program_for(seed0 + i) for i in range(first, min(first + chunk, n_programs))]
            specs.extend(batch)
            for oracle, ((o_shim, o_emulation), configs) in ORACLES.items():
                mine = [spec for spec in batch if spec.oracle == oracle]
                _configure(cc, o_shim, o_emulation)
                expected = [_outcome(runner, spec) for spec in mine]
                oracle_errors += [(spec.seed, oracle, out[0]) for spec, out in zip(mine, expected)
                                  if out and out[0].startswith("raised")]
                for c, (name, shim, emulation) in enumerate(configs):
                    _configure(cc, shim, emulation)
                    cc.reset_stats()
                    for k in range(c, len(mine), len(configs)):
                        got = _outcome(runner, mine[k])
                        ran[oracle, name] += 1
                        copies += fuzz.count_copies(mine[k].ops)
                        if got != expected[k]:
                            failures.append((mine[k], oracle, c, _first_difference(expected[k], got)))
                    stats[oracle, name] = _sum_stats(stats[oracle, name], cc.stats())
            if len(specs) % 4000 == 0:
                print(f"cc fuzz: {len(specs)}/{n_programs} programs, {len(failures)} failures "
                      f"({time.monotonic() - started:.0f} s)", flush=True)
    finally:
        cc.uninstall()
    for (oracle, name), count in ran.items():
        print(f"cc fuzz: oracle {oracle}, {name}: {count} programs, {stats[oracle, name]}", flush=True)
    n_programs = len(specs)
    per_oracle = {o: sum(1 for spec in specs if spec.oracle == o) for o in ORACLES}

    if failures:
        listed = ", ".join(f"{spec.seed}/{oracle}/{ORACLES[oracle][1][c][0]}" for spec, oracle, c, _ in failures[:20])
        print(f"\ncc fuzz: {len(failures)} failing runs (seed/oracle/configuration): {listed}", flush=True)
    for spec, oracle, c, difference in failures[:MAX_MINIMIZED]:
        (o_shim, o_emulation), configs = ORACLES[oracle]
        name, shim, emulation = configs[c]

        def still_fails(candidate, shim=shim, emulation=emulation, o_shim=o_shim, o_emulation=o_emulation):
            for _ in range(3):  # a race may need a few tries
                _configure(cc, o_shim, o_emulation)
                expected = _outcome(runner, candidate)
                _configure(cc, shim, emulation)
                got = _outcome(runner, candidate)
                cc.uninstall()
                if got != expected:
                    return True
            return False

        small = fuzz.minimize(spec, still_fails)
        print(f"\ncc fuzz FAILURE: seed {spec.seed}, oracle {oracle}, configuration {name}: {difference}\n"
              f"minimized program ({len(small.ops)} of {len(spec.ops)} ops):\n{small.describe()}", flush=True)

    elapsed = time.monotonic() - started
    print(f"cc fuzz: programs {n_programs} (oracle torch {per_oracle['torch']}, oracle cc {per_oracle['cc']}), "
          f"runs compared {sum(ran.values())}, copies {copies}, "
          f"configurations {sum(len(_names(o)) for o in ORACLES)}, failures {len(failures)}, "
          f"oracle exceptions {len(oracle_errors)}, {elapsed:.0f} s", flush=True)
    assert not oracle_errors, f"an oracle itself raised (a generator bug): {oracle_errors[:3]}"
    assert not failures, (f"{len(failures)} programs differ from their oracle; first: seed {failures[0][0].seed}, "
                          f"oracle {failures[0][1]}")
    if n_programs >= 400:  # the fuzzer must reach every path of the shim, or it proves little
        for oracle in ORACLES:
            shim_stats = stats[oracle, "shim+emulation"]
            assert shim_stats.offloaded > 0 and shim_stats.staged > 0 and shim_stats.in_place > 0, (oracle, shim_stats)
            assert shim_stats.emulated_waits > 0, (oracle, shim_stats)
