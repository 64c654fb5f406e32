"""The cc fuzzer's CPU half: its programs are legal, its interpreter runs them, its minimizer shrinks.

The key check: every generated program gives the same results under many
random schedules of a simulated GPU (streams run in any order CUDA allows).
A program that raced (a read not ordered after its write) would differ
between schedules, and on the GPU would be a false alarm.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "gpu" / "cc"))
import cc_fuzz as fuzz  # noqa: E402
from cc_fuzz_gen import program_for  # noqa: E402
from cc_fuzz_run import Runner, SimBackend  # noqa: E402

Op = fuzz.Op


def _spec(ops, pinned=(True, True, False, True)):
    return fuzz.ProgramSpec(seed=5, host_pinned=pinned, host_dtypes=("float32",) * fuzz.N_HOST,
                            dev_dtypes=("float32",) * fuzz.N_DEV, ops=list(ops))


def test_programs_are_reproducible_and_legal():
    for seed in range(200):
        a, b = program_for(seed), program_for(seed)
        assert a.describe() == b.describe()
        assert fuzz.is_legal(a), a.describe()


def test_generated_programs_cover_every_kind_of_op():
    seen = set()

    def walk(ops):
        for op in ops:
            seen.add(op.kind)
            walk(op.body)

    for seed in range(400):
        walk(program_for(seed).ops)
    kinds = {"SLEEP", "KERNEL", "FILL", "H2D", "H2D_FRESH", "D2H", "D2H_FRESH", "D2D", "WAIT_STREAM", "RECORD",
             "WAIT_EVENT", "EVENT_SYNC", "EVENT_SPIN", "EVENT_QUERY", "STREAM_SYNC", "DEVICE_SYNC", "HOST_READ",
             "HOST_WRITE", "RECORD_STREAM", "FREE", "ALLOC", "REGISTER", "THREAD", "CONCURRENT", "BLOCKING_READ"}
    assert kinds <= seen, kinds - seen


def test_every_schedule_of_the_simulated_gpu_gives_the_same_results():
    sequential = Runner(SimBackend(None))
    for seed in range(300):
        spec = program_for(seed)
        expected = sequential.run(spec)
        for schedule in range(4):
            got = Runner(SimBackend(schedule_seed=seed * 10 + schedule)).run(spec)
            assert got == expected, f"seed {seed}, schedule {schedule}:\n{spec.describe()}"


def test_simulator_catches_a_racy_program():
    """The check above can fail: an unordered host read of an async D2H differs between schedules."""
    racy = _spec([
        Op("SLEEP", ("D2", 10)),
        Op("KERNEL", ("D2", 0, ("full",), 1, 0)),
        Op("D2H", ("D2", 0, ("full",), 0, ("full",), True)),
        Op("HOST_READ", (0, ("full",))),  # no synchronize: a race
        Op("DEVICE_SYNC", (0,)),
    ])
    assert not fuzz.is_legal(racy)
    outcomes = {tuple(Runner(SimBackend(schedule)).run(racy)) for schedule in range(40)}
    assert len(outcomes) > 1


@pytest.mark.parametrize("fix", [
    [Op("STREAM_SYNC", ("D2",))],
    [Op("DEVICE_SYNC", (1,))],
    [Op("RECORD", (0, "D2", 1)), Op("EVENT_SYNC", (0,))],
    [Op("WAIT_STREAM", ("S0", "D2")), Op("RECORD", (1, "S0", 0)), Op("EVENT_SPIN", (1,))],
])
def test_model_accepts_each_way_of_ordering_a_host_read(fix):
    ops = [Op("KERNEL", ("S0", 0, ("full",), 1, 100)), Op("WAIT_STREAM", ("D2", "S0")),
           Op("D2H", ("D2", 0, ("full",), 0, ("full",), True))]
    assert not fuzz.is_legal(_spec(ops + [Op("HOST_READ", (0, ("full",)))]))
    assert fuzz.is_legal(_spec(ops + fix + [Op("HOST_READ", (0, ("full",)))]))


def test_model_orders_the_d2h_after_every_producer():
    """Issue 14's pattern is legal only with both waits (the program the fuzzer must get right)."""
    two_producers = [
        Op("KERNEL", ("S0", 1, ("full",), 2, 40000)),  # slow write on p1
        Op("WAIT_STREAM", ("D2", "S0")),
        Op("WAIT_STREAM", ("D2", "S1")),
        Op("D2H", ("D2", 1, ("full",), 0, ("full",), True)),
        Op("RECORD", (0, "D2", 0)),
        Op("EVENT_SYNC", (0,)),
        Op("HOST_READ", (0, ("full",))),
    ]
    assert fuzz.is_legal(_spec(two_producers))
    assert not fuzz.is_legal(_spec(two_producers[:1] + two_producers[2:]))  # only the idle producer


def test_free_needs_record_stream_or_ordering():
    base = [Op("FREE", (0,)), Op("ALLOC", ("S0", 0, "float32", 3)), Op("WAIT_STREAM", ("S1", "S0")),
            Op("KERNEL", ("S1", 0, ("full",), 0, 0))]
    assert not fuzz.is_legal(_spec(base + [Op("FREE", (0,))]))  # used on S1, allocated on S0
    assert fuzz.is_legal(_spec(base + [Op("RECORD_STREAM", (0, "S1")), Op("FREE", (0,))]))
    assert fuzz.is_legal(_spec(base + [Op("WAIT_STREAM", ("S0", "S1")), Op("FREE", (0,))]))


def test_registered_target_needs_its_readers_finished():
    ops = [Op("REGISTER", (1, "S0")), Op("D2D", ("S1", 1, ("full",), 2, ("full",), False))]
    h2d = Op("H2D", ("S0", 0, ("full",), 1, ("full",), True))
    assert not fuzz.is_legal(_spec(ops + [Op("WAIT_STREAM", ("S0", "S1")), h2d]))  # ordered, not finished
    assert fuzz.is_legal(_spec(ops + [Op("STREAM_SYNC", ("S1",)), h2d]))


def test_minimizer_keeps_what_the_failure_needs_and_stays_legal():
    spec = program_for(11, n_ops=(30, 30))
    d2h_on_d2h_stream = [op for op in spec.ops if op.kind == "D2H" and op.args[0] in ("D2", "D3")]
    assert d2h_on_d2h_stream, "seed 11 has an offloadable copy"
    culprit = d2h_on_d2h_stream[0]

    def still_fails(candidate):  # a stand-in failure: "any program with this copy fails"
        return culprit in candidate.ops

    small = fuzz.minimize(spec, still_fails)
    assert culprit in small.ops and fuzz.is_legal(small)
    assert len(small.ops) < len(spec.ops) // 2
    assert small.seed == spec.seed


def test_copies_are_counted_inside_threads():
    body = (Op("D2H", ("D2", 0, ("full",), 0, ("full",), True)), Op("SLEEP", ("S0", 0)))
    assert fuzz.count_copies([Op("THREAD", (), body), Op("D2D", ("S0", 0, ("full",), 1, ("full",), True))]) == 2


def test_concurrent_bodies_must_keep_to_their_own_resources():
    body_a = Op("THREAD", (), (Op("KERNEL", ("S0", 0, ("full",), 1, 0)),))
    body_b = Op("THREAD", (), (Op("KERNEL", ("S1", 2, ("full",), 1, 0)),))
    assert fuzz.is_legal(_spec([Op("CONCURRENT", (), (body_a, body_b))]))
    crossing = Op("THREAD", (), (Op("KERNEL", ("S1", 0, ("full",), 1, 0)),))  # buffer 0 belongs to the first body
    assert not fuzz.is_legal(_spec([Op("CONCURRENT", (), (body_a, crossing))]))


def test_model_reads_a_transposed_block_in_stream_order():
    """torch moves ``h.t()`` into ``d.t()`` (one dtype) as one block, in its stream's order (seed 20267787).

    So an unordered D2H into ``h`` issued after it races (the program the GPU run reported as a shim failure
    is not legal), and a D2H into ``h`` queued on the same stream before it is ordered.
    """
    racy = [
        Op("KERNEL", ("S1", 3, ("cols", 7, 15), 0, 2000)),
        Op("WAIT_STREAM", ("S0", "S1")),
        Op("H2D", ("S0", 3, ("t",), 4, ("t",), True)),
        Op("D2H", ("D2", 2, ("full",), 3, ("full",), True)),
        Op("DEVICE_SYNC", (0,)),
    ]
    assert not fuzz.is_legal(_spec(racy))
    ordered = [
        Op("KERNEL", ("S0", 2, ("full",), 1, 2000)),
        Op("D2H", ("S0", 2, ("full",), 3, ("full",), True)),
        Op("H2D", ("S0", 3, ("t",), 4, ("t",), True)),
        Op("DEVICE_SYNC", (0,)),
    ]
    assert fuzz.is_legal(_spec(ordered))
    # With a column slice on the device side torch makes a contiguous host copy at the call: that read races.
    at_the_call = ordered[:2] + [Op("H2D", ("S0", 3, ("t",), 4, ("full",), True))] + ordered[3:]
    assert not fuzz.is_legal(_spec(at_the_call))


def test_model_reads_the_host_when_the_shim_does():
    """The fuzzer's model and the shim use one rule for when a staged copy reads its host source.

    Every view pair the generator makes, with every dtype pair (``non_blocking=True``), on CPU tensors:
    the model's ``h2d_reads_host_now`` must equal the shim's ``_torch_reads_source_now``. (They differed on
    a full-width column slice with a cast: contiguous, so torch reads it in stream order.)
    """
    import random

    import torch

    from syncless.cc._staging import _torch_reads_source_now

    rng = random.Random(7)
    pairs = {fuzz.random_view_pair(rng) for _ in range(3000)}
    pairs |= {(("cols", 0, fuzz.SIDE), ("cols", 0, fuzz.SIDE)), (("t",), ("t",))}
    differ = []
    for dst_view, src_view in sorted(pairs, key=repr):
        for dst_dtype in fuzz.DTYPES:
            for src_dtype in fuzz.DTYPES:
                dst = fuzz.apply_view(torch.empty(fuzz.SIDE, fuzz.SIDE, dtype=getattr(torch, dst_dtype)), dst_view)
                src = fuzz.apply_view(torch.empty(fuzz.SIDE, fuzz.SIDE, dtype=getattr(torch, src_dtype)), src_view)
                model = fuzz.h2d_reads_host_now(src_view, dst_view, True, src_dtype, dst_dtype)
                if model != _torch_reads_source_now(dst, src):
                    differ.append((dst_view, src_view, dst_dtype, src_dtype, model))
    assert not differ, differ[:5]


def test_model_reads_a_fresh_h2ds_host_source_when_the_shim_does(monkeypatch):
    """The same for a fresh H2D (``.to``/``.cuda``), every host view and form the generator makes, every dtype pair.

    The shim's rule is ``_staging.land_converted``'s choice: the source staged as it lies (read in stream order)
    or a clone made at the call. A stand-in for the transfer records which it was handed.
    """
    import torch

    from syncless.cc import _staging

    handed = []

    def fake_land(src, index, next_fn=None, **kwargs):
        handed.append(src)
        return src.clone()

    monkeypatch.setattr(_staging, "land", fake_land)
    differ = []
    for hv in (("full",), ("t",)):
        for form in range(fuzz.FRESH_FORMS):
            for host_dtype in fuzz.DTYPES:
                for dtype in (None,) + fuzz.DTYPES:
                    base = torch.empty(fuzz.SIDE, fuzz.SIDE, dtype=getattr(torch, host_dtype))
                    src = fuzz.apply_view(base, hv)
                    handed.clear()
                    fmt = torch.contiguous_format if form == 3 else None
                    _staging.land_converted(src, 0, None if dtype is None else getattr(torch, dtype), fmt)
                    shim = handed[0].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
                    model = fuzz.h2d_reads_host_now(hv, fuzz.fresh_result_view(hv, form), True, host_dtype,
                                                    dtype or host_dtype)
                    if model != shim:
                        differ.append((hv, form, host_dtype, dtype, model))
    assert not differ, differ[:5]


def _d2h_then(ops_after, oracle="cc"):
    spec = _spec([Op("D2H", ("D2", 0, ("full",), 0, ("full",), True))] + ops_after + [Op("DEVICE_SYNC", (0,))])
    spec.oracle = oracle
    return spec


@pytest.mark.parametrize("cover", [
    [Op("RECORD", (0, "S0", 0)), Op("EVENT_SYNC", (0,))],           # any stream's event recorded after the copy
    [Op("RECORD", (1, "S1", 2)), Op("EVENT_SPIN", (1,))],
    [Op("RECORD", (0, "S1", 1)), Op("WAIT_EVENT", ("S0", 0, 0))],    # a wait on it
    [Op("WAIT_STREAM", ("S0", "S1"))],                              # records one on S1 and waits on it
    [Op("STREAM_SYNC", ("S0",))], [Op("STREAM_SYNC", ("D2",))], [Op("DEVICE_SYNC", (0,))],
])
def test_cc_model_orders_a_host_read_of_an_offloaded_copy_after_any_covering_call(cover):
    """The cc oracle (CC without the shim): a host read of a D2H stream's non_blocking result needs a call that
    covers the copy by the seed's rule; any event recorded after the copy's call does, on any stream."""
    assert not fuzz.is_legal(_d2h_then([Op("HOST_READ", (0, ("full",)))]))
    assert fuzz.is_legal(_d2h_then(cover + [Op("HOST_READ", (0, ("full",)))])), cover


@pytest.mark.parametrize("not_cover", [
    [Op("STREAM_SYNC", ("D3",))],                                  # another D2H stream's synchronize
    [Op("EVENT_QUERY", (0,))],
])
def test_cc_model_refuses_calls_that_do_not_cover_the_copy(not_cover):
    spec = _spec([Op("RECORD", (0, "S0", 0)), Op("D2H", ("D2", 0, ("full",), 0, ("full",), True))] + not_cover
                 + [Op("EVENT_SYNC", (0,)), Op("HOST_READ", (0, ("full",))), Op("DEVICE_SYNC", (0,))])
    spec.oracle = "cc"
    assert not fuzz.is_legal(spec)  # the event was recorded before the copy's call: it does not cover it


def test_cc_model_lets_a_host_read_follow_an_ordinary_streams_copy_at_once():
    """Under CC a non_blocking D2H on an ordinary stream has finished when its call returns (plain torch: a race)."""
    ops = [Op("KERNEL", ("S0", 0, ("full",), 1, 0)), Op("D2H", ("S0", 0, ("full",), 0, ("full",), True)),
           Op("HOST_READ", (0, ("full",))), Op("DEVICE_SYNC", (0,))]
    spec = _spec(ops)
    assert not fuzz.is_legal(spec)
    spec.oracle = "cc"
    assert fuzz.is_legal(spec)


def test_both_oracles_get_programs_and_the_cc_ones_rely_on_cc():
    """Half the programs are for each oracle, and many cc ones would race under plain torch: the second oracle
    checks what the first cannot."""
    specs = [program_for(seed) for seed in range(400)]
    cc_specs = [s for s in specs if s.oracle == "cc"]
    assert 120 < len(cc_specs) < 280
    racy_under_torch = [s for s in cc_specs if not fuzz.is_legal(
        fuzz.ProgramSpec(s.seed, s.host_pinned, s.host_dtypes, s.dev_dtypes, list(s.ops), "torch"))]
    assert len(racy_under_torch) > len(cc_specs) // 5


def test_the_transposed_converting_d2h_is_generated_and_read_at_once():
    """Issue 27 item 2 in the generator: a transposed source to another dtype, whose result torch fills on the
    host, so the model lets the host read it right after the call."""
    spec = _spec([Op("D2H_FRESH", ("D2", 0, 1, True, "float64", ("t",))), Op("HOST_READ", (1, ("full",))),
                  Op("DEVICE_SYNC", (0,))])
    assert fuzz.is_legal(spec)
    seen = [op for seed in range(400) for op in program_for(seed).ops if op.kind == "D2H_FRESH" and op.args[5] == ("t",)]
    assert seen


def test_the_generator_spells_blocking_copies_that_bypass_the_wrappers():
    """Issue 27 item 1 in the generator: ``dst[...] = src`` and ``UntypedStorage.copy_``, both ways."""
    seen = set()

    def walk(ops):
        for op in ops:
            if op.kind in ("H2D", "D2H"):
                seen.add((op.kind, op.args[6]))
                assert op.args[6] == "copy_" or not op.args[5], op  # only blocking copies are spelled otherwise
            walk(op.body)

    for seed in range(3000):
        walk(program_for(seed).ops)
    assert {(k, via) for k in ("H2D", "D2H") for via in ("copy_", "setitem", "storage")} <= seen
