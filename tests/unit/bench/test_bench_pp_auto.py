"""The pp report's depth="auto" columns (opt-in, beside depth 2 and depth 0, never judged), on the CPU."""

import importlib.util
import math
import pathlib

import pytest

from syncless.bench._pp_launch import Outcome
from syncless.bench._pp_measure import _FORWARD_METHODS
from syncless.bench._pp_plan import MIB, make_plan
from syncless.bench._pp_summary import BANDWIDTH_COLUMNS, LATENCY_COLUMNS, build_output, quality_flags

_spec = importlib.util.spec_from_file_location(
    "bench_pp_summary_cases", pathlib.Path(__file__).with_name("test_bench_pp_summary.py"))
summary_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summary_cases)


def with_auto(plan, results, *, auto_bw=300.0, auto_lat=20.0):
    """Add depth="auto" rows to the made-up results, shaped like the workers' posts."""
    results["bandwidth"]["ours_auto"] = {
        nbytes: {"gbps": auto_bw * nbytes / max(plan.payloads), "ahead": [True, True], "data_ok": True}
        for nbytes in plan.payloads}
    for suffix, saved_us in (("", 0.0), ("@own", 2.0)):
        results["latency"]["ours_auto" + suffix] = {
            nbytes: {"one_way_us": auto_lat - saved_us, "all_ahead": True, "data_ok": True}
            for nbytes in plan.latency_payloads}
    return results


def test_auto_columns_come_last_with_their_ratios():
    plan = make_plan(quick=False)
    results = with_auto(plan, summary_cases.fake_results(plan))
    output = build_output(plan, Outcome(results=results, complete=True))
    (_, bw_cols, bw_rows), (_, lat_cols, lat_rows) = output.tables[:2]
    assert list(bw_cols)[-3:] == ["ours auto GB/s", "ours auto / raw", "ours auto / NCCL"] == BANDWIDTH_COLUMNS[-3:]
    assert list(lat_cols)[-2:] == ["ours auto us", "ours auto / NCCL"] == LATENCY_COLUMNS[-2:]
    last = bw_rows[-1]
    assert last[1:5] == [390.0, 330.0, 380.0, 385.0]  # the columns before auto keep their places
    assert last[9] == 300.0 and last[10] == pytest.approx(300 / 390) and last[11] == pytest.approx(300 / 330)
    assert lat_rows[4][2:6] == [45.0, 30.0, 28.0, 27.0]
    assert lat_rows[4][8] == 20.0 and lat_rows[4][9] == pytest.approx(20 / 45)
    assert lat_rows[9][8] == 18.0 and lat_rows[9][9] == pytest.approx(18 / 43)


def test_auto_is_reported_but_never_judged():
    plan = make_plan(quick=True)
    plain = build_output(plan, Outcome(results=summary_cases.fake_results(plan), complete=True))
    slow = with_auto(plan, summary_cases.fake_results(plan), auto_bw=1.0, auto_lat=999.0)
    judged = build_output(plan, Outcome(results=slow, complete=True))
    assert [(g.description, g.met) for g in judged.goals] == [(g.description, g.met) for g in plain.goals]
    assert all("auto" not in g.description for g in judged.goals)
    missing = build_output(plan, Outcome(results=summary_cases.fake_results(plan), complete=True))
    assert all(math.isnan(row[9]) for row in missing.tables[0][2])  # not measured: n/a, nothing else changes


def test_auto_data_flags_and_transport_notes():
    plan = make_plan(quick=True)
    results = with_auto(plan, summary_cases.fake_results(plan))
    results["bandwidth"]["ours_auto"][8 * MIB]["data_ok"] = False
    results["latency"]["ours_auto@own"][1 * MIB]["data_ok"] = False
    flags = quality_flags(plan, results)
    assert 'bandwidth ours, depth="auto" at 8 MiB: the received bytes did NOT match what was sent' in flags
    assert 'latency ours, depth="auto", own stream at 1 MiB: the echoed bytes did NOT match what was sent' in flags
    results["setup"]["rank0"]["transport_fwda"] = {
        "backend": "copy_engine", "fallback_reason": None, "batched_copies": True,
        "direct_unavailable_reason": "steps into stage 1 (rank 1) all go through a slot: not shareable"}
    notes = build_output(plan, Outcome(results=results, complete=True)).notes
    assert any(n.startswith('transport under test (rank 0 -> 1, depth="auto"): backend copy_engine; every step '
                            "through a slot: steps into stage 1 (rank 1) all go through a slot") for n in notes)


def test_each_forward_transport_has_its_bandwidth_method():
    assert _FORWARD_METHODS == {"fwd": "ours", "fwd0": "ours_depth0", "fwda": "ours_auto"}
