"""The pp report: tables, ratios, goals, notes and the plot, from made-up results (CPU only)."""

import json
import math

import pytest

from syncless.bench._pp_launch import Outcome
from syncless.bench._pp_plan import KIB, MIB, make_plan
from syncless.bench._pp_summary import (
    BANDWIDTH_COLUMNS,
    HOST_CPU_COLUMNS,
    INTERFERENCE_COLUMNS,
    LATENCY_COLUMNS,
    build_output,
    ceiling_notes,
    goals,
    number,
    quality_flags,
    ratio,
)
from syncless.bench._report import render_markdown, write_output


def fake_results(plan, *, ours_bw=380.0, raw_bw=390.0, nccl_bw=330.0, direct_bw=385.0, ours_lat=30.0, nccl_lat=45.0,
                 direct_lat=28.0, gemm=(1.50, 1.62, 1.56), spin=(2.0, 4.1, 2.03), cpu=(12.0, 20.0, 30.0, 40.0)):
    """Results shaped like the workers' posts; numbers scale with the payload where it matters."""
    bandwidth = {"raw": {}, "nccl": {}, "ours": {}, "ours_depth0": {}}
    host_cpu = {"ours": {}, "nccl": {}}
    for nbytes in plan.payloads:
        for method, value in (("raw", raw_bw), ("nccl", nccl_bw), ("ours", ours_bw), ("ours_depth0", direct_bw)):
            bandwidth[method][nbytes] = {"gbps": value * nbytes / max(plan.payloads), "ahead": [True, True],
                                         "data_ok": True}
        host_cpu["ours"][nbytes] = {"send": {"thread_us": cpu[0]}, "recv": {"thread_us": cpu[2]}}
        host_cpu["nccl"][nbytes] = {"send": {"thread_us": cpu[1]}, "recv": {"thread_us": cpu[3]}}
    latency = {}
    for suffix, saved_us in (("", 0.0), ("@own", 2.0)):  # a created stream saves 2 us everywhere
        for method, value in (("nccl", nccl_lat), ("ours", ours_lat), ("ours_depth0", direct_lat),
                              ("raw_flags", ours_lat * 0.9)):
            for nbytes in plan.latency_payloads:
                latency.setdefault(method + suffix, {})[nbytes] = {"one_way_us": value - saved_us, "all_ahead": True,
                                                                   "data_ok": True}
    alone, with_nccl, with_ours = gemm
    return {
        "setup": {"rank0": {"torch": "2.11.0", "nccl": "2.28.9", "cuda_bindings": "13.3.1", "nccl_nvls_enable": "0",
                            "transport_fwd": {"backend": "copy_engine", "fallback_reason": None}}},
        "bandwidth": bandwidth,
        "host_cpu": host_cpu,
        "latency": latency,
        "gemm": {
            "alone": {"ms_per_gemm": alone, "slowdown_pct": 0.0, "covered": True},
            "nccl": {"ms_per_gemm": with_nccl, "slowdown_pct": (with_nccl / alone - 1) * 100, "covered": True},
            "ours": {"ms_per_gemm": with_ours, "slowdown_pct": (with_ours / alone - 1) * 100, "covered": True},
        },
        "pending": {
            "alone": {"kernel_ms": spin[0], "ratio": 1.0},
            "nccl": {"kernel_ms": spin[1], "ratio": spin[1] / spin[0], "pending": True, "data_ok": True},
            "ours": {"kernel_ms": spin[2], "ratio": spin[2] / spin[0], "pending": True, "data_ok": True},
        },
    }


def goal_map(goal_list):
    return {g.description: g for g in goal_list}


def test_ratio_and_number_treat_missing_values_as_nan():
    assert ratio(3.0, 2.0) == 1.5
    for bad in [(1.0, 0.0), (float("nan"), 1.0), (1.0, float("nan")), (1.0, -2.0)]:
        assert math.isnan(ratio(*bad))
    tree = {"a": {1: {"x": 2.5, "flag": True}}}
    assert number(tree, "a", 1, "x") == 2.5
    assert math.isnan(number(tree, "a", 2, "x"))
    assert math.isnan(number(tree, "a", 1, "flag"))  # a bool is not a measurement


def test_tables_hold_every_payload_and_the_ratios():
    plan = make_plan(quick=False)
    output = build_output(plan, Outcome(results=fake_results(plan), complete=True))
    (bw_caption, bw_cols, bw_rows), (_, lat_cols, lat_rows), (_, int_cols, int_rows), (_, cpu_cols, cpu_rows) = (
        output.tables
    )
    assert "GB/s" in bw_caption
    assert list(bw_cols) == BANDWIDTH_COLUMNS and list(lat_cols) == LATENCY_COLUMNS
    assert list(int_cols) == INTERFERENCE_COLUMNS and list(cpu_cols) == HOST_CPU_COLUMNS
    assert BANDWIDTH_COLUMNS[4] == "ours depth=0 GB/s" and BANDWIDTH_COLUMNS[7:9] == ["ours depth=0 / raw",
                                                                                     "ours depth=0 / NCCL"]
    assert [row[0].split(" ")[0:2] for row in bw_rows] == [["64", "KiB"], ["1", "MiB"], ["8", "MiB"], ["16", "MiB"],
                                                          ["64", "MiB"], ["256", "MiB"]]
    last = bw_rows[-1]
    assert last[1:5] == [390.0, 330.0, 380.0, 385.0]
    assert last[5] == pytest.approx(380 / 390) and last[6] == pytest.approx(380 / 330)
    assert last[7] == pytest.approx(385 / 390) and last[8] == pytest.approx(385 / 330)
    # every size of issue 18's latency table, on both stream modes
    sizes = ["64 KiB", "1 MiB", "8 MiB", "64 MiB", "256 MiB"]
    assert [(row[0], row[1].split(" (")[0]) for row in lat_rows] == [("default", s) for s in sizes] + [
        ("own", s) for s in sizes]
    assert lat_rows[4][2:6] == [45.0, 30.0, 28.0, 27.0]
    assert lat_rows[4][6] == pytest.approx(30 / 45) and lat_rows[4][7] == pytest.approx(28 / 45)
    assert lat_rows[9][2:6] == [43.0, 28.0, 26.0, 25.0] and lat_rows[9][6] == pytest.approx(28 / 43)
    gemm_row, spin_row = int_rows
    assert gemm_row[1:4] == [1.50, 1.62, 1.56] and gemm_row[4] == pytest.approx(1.62 / 1.5)
    assert gemm_row[5] == pytest.approx(1.56 / 1.5)
    assert spin_row[1:4] == [2.0, 4.1, 2.03] and spin_row[4] == pytest.approx(4.1 / 2.0)
    assert spin_row[5] == pytest.approx(2.03 / 2.0)
    assert cpu_rows[2][1:] == [12.0, 20.0, 30.0, 40.0]


BW_NCCL = "sustained bandwidth at {}: ours / NCCL (target: at least 1.0x at every size)"
BW_RAW = "sustained bandwidth at {}: ours / raw peer copy (target: at least 0.9x from 1 MiB up)"
LAT_SMALL = "one-way GPU latency at {}{}: ours / NCCL (target: at most 1.0x below 1 MiB)"
LAT_LARGE = "one-way GPU latency at {}{}: ours / NCCL (target: at most 0.8x from 1 MiB up)"
OWN = ", each rank on its own stream"
FULL_BW = ["64 KiB", "1 MiB", "8 MiB", "16 MiB", "64 MiB", "256 MiB"]
FULL_LAT = ["64 KiB", "1 MiB", "8 MiB", "64 MiB", "256 MiB"]


def issue_18_descriptions():
    """Every goal row of a full plan, in order: bandwidth per size, latency per stream mode and size, kept goals."""
    out = []
    for size in FULL_BW:
        out.append(BW_NCCL.format(size))
        if size != "64 KiB":
            out.append(BW_RAW.format(size))
    for where in ("", OWN):
        out += [(LAT_SMALL if size == "64 KiB" else LAT_LARGE).format(size, where) for size in FULL_LAT]
    return out + [
        "GEMM slowdown on the sending GPU while streaming: ours (target: NCCL's slowdown)",
        "full-SM kernel on the receiving GPU with a receive pending: ours / alone",
        "host CPU per send() at 8 MiB: ours (target: NCCL isend batch)",
        "host CPU per recv() at 8 MiB: ours (target: NCCL irecv batch + wait)",
    ]


def test_goals_state_issue_18_targets_for_every_size_and_kind():
    plan = make_plan(quick=False)
    got = goals(plan, fake_results(plan))
    assert [g.description for g in got] == issue_18_descriptions()
    assert len(got) == 6 + 5 + 2 * 5 + 4
    assert not any("depth=0" in g.description for g in got)  # depth=0 is reported, not judged
    by_name = goal_map(got)
    for size in FULL_BW:
        nccl = by_name[BW_NCCL.format(size)]
        assert (nccl.target, nccl.higher_is_better) == (1.0, True) and nccl.measured == pytest.approx(380 / 330)
    for size in FULL_BW[1:]:
        raw = by_name[BW_RAW.format(size)]
        assert (raw.target, raw.higher_is_better) == (0.9, True) and raw.measured == pytest.approx(380 / 390)
    for where, nccl_us, ours_us in (("", 45.0, 30.0), (OWN, 43.0, 28.0)):
        small = by_name[LAT_SMALL.format("64 KiB", where)]
        assert (small.target, small.higher_is_better) == (1.0, False)
        assert small.measured == pytest.approx(ours_us / nccl_us)
        for size in FULL_LAT[1:]:
            large = by_name[LAT_LARGE.format(size, where)]
            assert (large.target, large.higher_is_better) == (0.8, False)
            assert large.measured == pytest.approx(ours_us / nccl_us)
    pending = by_name["full-SM kernel on the receiving GPU with a receive pending: ours / alone"]
    assert pending.target == 1.05 and pending.measured == pytest.approx(2.03 / 2.0)


def test_goals_met_with_good_numbers():
    plan = make_plan(quick=False)
    got = goals(plan, fake_results(plan))
    assert all(g.met for g in got), [g.as_dict() for g in got if not g.met]
    gemm = next(g for g in got if g.description.startswith("GEMM slowdown"))
    assert gemm.measured == pytest.approx(4.0) and gemm.target == pytest.approx(8.0) and gemm.unit == "%"
    # the targets themselves count as met: 1.0x NCCL bandwidth, 0.9x raw, 0.8x NCCL latency
    edge = goal_map(goals(plan, fake_results(plan, ours_bw=351.0, raw_bw=390.0, nccl_bw=351.0, ours_lat=36.0,
                                             nccl_lat=45.0)))
    assert all(g.met for g in edge.values()), [g.as_dict() for g in edge.values() if not g.met]


def test_goals_missed_with_bad_numbers():
    plan = make_plan(quick=False)
    # ours beats NCCL (340 / 330) but not 0.9x raw (340 / 390); one-way 44 / 45: within 1.0x but not 0.8x
    bad = fake_results(plan, ours_bw=340.0, ours_lat=44.0, gemm=(1.5, 1.55, 1.6), spin=(2.0, 4.0, 2.5),
                       cpu=(25.0, 20.0, 30.0, 29.0))
    by_name = goal_map(goals(plan, bad))
    for size in FULL_BW:
        assert by_name[BW_NCCL.format(size)].met
    for size in FULL_BW[1:]:
        assert not by_name[BW_RAW.format(size)].met
    for where in ("", OWN):
        assert by_name[LAT_SMALL.format("64 KiB", where)].met  # 44 / 45 (42 / 43 on own streams) <= 1.0
        for size in FULL_LAT[1:]:
            assert not by_name[LAT_LARGE.format(size, where)].met
    assert not next(g for d, g in by_name.items() if d.startswith("GEMM slowdown")).met
    assert not by_name["full-SM kernel on the receiving GPU with a receive pending: ours / alone"].met
    assert [g.met for d, g in by_name.items() if d.startswith("host CPU")] == [False, False]
    # below NCCL: the bandwidth goal misses at every size, and a slower one-way step misses below 1 MiB too
    worse = goal_map(goals(plan, fake_results(plan, ours_bw=320.0, ours_lat=46.0)))
    assert not any(worse[BW_NCCL.format(size)].met for size in FULL_BW)
    assert not worse[LAT_SMALL.format("64 KiB", "")].met and not worse[LAT_SMALL.format("64 KiB", OWN)].met


def test_missing_measurements_show_as_nan_and_miss_their_goals():
    plan = make_plan(quick=True)
    results = fake_results(plan)
    del results["bandwidth"]["ours"]
    del results["bandwidth"]["ours_depth0"]
    del results["latency"]["ours@own"][1 * MIB]
    del results["latency"]["nccl"][64 * KIB]
    del results["pending"]
    output = build_output(plan, Outcome(results=results, complete=False, failure="rank 1 failed: boom"))
    bw_rows = output.tables[0][2]
    assert all(math.isnan(value) for row in bw_rows for value in row[3:])
    assert all(math.isfinite(value) for row in bw_rows for value in row[1:3])
    by_name = goal_map(output.goals)
    for size in ("64 KiB", "8 MiB", "64 MiB"):
        assert not by_name[BW_NCCL.format(size)].met and math.isnan(by_name[BW_NCCL.format(size)].measured)
    for size in ("8 MiB", "64 MiB"):
        assert not by_name[BW_RAW.format(size)].met
    for description in (LAT_LARGE.format("1 MiB", OWN), LAT_SMALL.format("64 KiB", "")):
        assert math.isnan(by_name[description].measured) and not by_name[description].met
    assert by_name[LAT_LARGE.format("1 MiB", "")].met and by_name[LAT_SMALL.format("64 KiB", OWN)].met
    assert math.isnan(by_name["full-SM kernel on the receiving GPU with a receive pending: ours / alone"].measured)
    assert output.notes[0].startswith("INCOMPLETE RUN: rank 1 failed: boom")
    assert output.data["complete"] is False and output.data["failure"] == "rank 1 failed: boom"


def test_depth0_bandwidth_alone_missing_leaves_the_goals_alone():
    plan = make_plan(quick=True)
    results = fake_results(plan)
    del results["bandwidth"]["ours_depth0"]  # no depth=0 transport: NaN in the table, every goal still judged
    output = build_output(plan, Outcome(results=results, complete=True))
    bw_rows = output.tables[0][2]
    assert all(math.isnan(row[4]) and math.isnan(row[7]) and math.isnan(row[8]) for row in bw_rows)
    assert all(math.isfinite(row[3]) for row in bw_rows)
    assert all(g.met for g in output.goals)


def test_quality_flags_name_each_broken_condition():
    plan = make_plan(quick=True)
    results = fake_results(plan)
    assert quality_flags(plan, results) == []
    results["bandwidth"]["ours"][8 * MIB]["data_ok"] = False
    results["bandwidth"]["ours_depth0"][64 * MIB]["data_ok"] = False
    results["bandwidth"]["nccl"][64 * KIB]["ahead"] = [True, False]
    results["latency"]["ours"][1 * MIB]["all_ahead"] = False
    results["gemm"]["ours"]["covered"] = False
    results["pending"]["nccl"]["pending"] = False
    flags = quality_flags(plan, results)
    assert len(flags) == 6
    assert any("ours at 8 MiB" in f and "did NOT match" in f for f in flags)
    assert "bandwidth ours, depth=0 at 64 MiB: the received bytes did NOT match what was sent" in flags
    assert any("NCCL send/recv at 64 KiB" in f and "1 of 2 repeats" in f for f in flags)
    assert any("latency ours at 1 MiB" in f for f in flags)
    assert any(f.startswith("GEMM interference with ours") for f in flags)
    assert any(f.startswith("pending receive with NCCL") for f in flags)


def test_notes_carry_transport_choice_and_worker_notes():
    plan = make_plan(quick=True)
    results = fake_results(plan)
    results["setup"]["rank0"]["transport_fwd"] = {"backend": "torch_distributed", "fallback_reason": "no NVLink"}
    results["setup"]["rank0"]["transport_bwd0"] = {"backend": "copy_engine", "fallback_reason": None,
                                                    "batched_copies": False}  # rank 0 receives: not its to say
    results["setup"]["rank0"]["transport_fwd0"] = {"backend": "copy_engine", "fallback_reason": None,
                                                   "batched_copies": True}
    output = build_output(plan, Outcome(results=results, notes=["rank 1: something odd"], complete=True))
    assert any("backend torch_distributed; fallback reason: no NVLink" in n for n in output.notes)
    assert "transport under test (rank 1 -> 0 (echo), depth=0): backend copy_engine" in output.notes
    assert ("transport under test (rank 0 -> 1, depth=0): backend copy_engine; one batched copy per step: yes "
            "(not from torch's default stream, where the driver refuses batches)" in output.notes)  # fmt: skip
    assert output.notes[-1] == "rank 1: something odd"
    assert "quick run" in output.title


def test_written_report_has_json_markdown_and_png(tmp_path):
    plan = make_plan(quick=False)
    output = build_output(plan, Outcome(results=fake_results(plan), complete=True))
    meta = {"date_utc": "2026-12-01 00:00:00", "command": "syncless bench pp", "host": "h", "platform": "p",
            "python": "3.12", "torch": "2.11", "cuda": "13.0", "gpus": ["H200", "H200"]}
    paths = write_output(output, tmp_path, meta)
    document = json.loads(paths["json"].read_text())
    assert document["data"]["complete"] is True
    assert document["data"]["results"]["bandwidth"]["ours"][str(256 * MIB)]["gbps"] == pytest.approx(380.0)
    assert document["data"]["results"]["bandwidth"]["ours_depth0"][str(256 * MIB)]["gbps"] == pytest.approx(385.0)
    assert [g["description"] for g in document["goals"]] == issue_18_descriptions()
    assert all(g["met"] for g in document["goals"])
    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    markdown = paths["md"].read_text()
    assert "| 256 MiB (prefill, 8192 tokens) | 390 | 330 | 380 | 385 |" in markdown
    assert "| ours depth=0 GB/s |" in markdown and "ours depth=0 / NCCL" in markdown
    assert "MISSED" not in markdown
    assert "![" in render_markdown(output, meta)


def test_plot_survives_missing_values(tmp_path):
    plan = make_plan(quick=True)
    output = build_output(plan, Outcome(results={}, complete=False, failure="hard time limit"))
    target = tmp_path / "pp.png"
    output.plot(target)
    assert target.read_bytes()[:4] == b"\x89PNG"
    assert all(not g.met for g in output.goals)


def test_ceiling_note_appears_wherever_the_raw_copy_is_short_of_nccl():
    plan = make_plan(quick=False)
    assert ceiling_notes(plan, fake_results(plan)) == []  # raw 390 / NCCL 330 = 1.18x everywhere
    assert ceiling_notes(plan, fake_results(plan, raw_bw=392.0, nccl_bw=360.0)) == []  # 1.089x: above 1.0x now
    short = fake_results(plan, raw_bw=380.0, nccl_bw=400.0)
    lines = ceiling_notes(plan, short)  # the fake scales both methods alike: same ratio at every payload
    assert lines == [n for n in build_output(plan, Outcome(results=short, complete=True)).notes if "ceiling" in n]
    assert len(lines) == len(plan.payloads) and "64 KiB" in lines[0] and "256 MiB" in lines[-1]  # every payload
    assert all("0.950x NCCL" in line and "reach 1.0x" in line for line in lines)


def test_host_cpu_goals_judge_each_call_against_nccls_at_cpu_nbytes():
    plan = make_plan(quick=False)
    results = fake_results(plan, cpu=(12.0, 20.0, 30.0, 29.0))  # send beats NCCL, recv does not
    for nbytes in plan.payloads:
        if nbytes != plan.cpu_nbytes:  # other payloads would flip both verdicts if they were read instead
            results["host_cpu"]["ours"][nbytes] = {"send": {"thread_us": 99.0}, "recv": {"thread_us": 1.0}}
    by_name = goal_map(goals(plan, results))
    send = by_name["host CPU per send() at 8 MiB: ours (target: NCCL isend batch)"]
    recv = by_name["host CPU per recv() at 8 MiB: ours (target: NCCL irecv batch + wait)"]
    assert (send.measured, send.target, send.unit, send.met) == (12.0, 20.0, "us", True)
    assert (recv.measured, recv.target, recv.unit, recv.met) == (30.0, 29.0, "us", False)


def test_quality_flags_catch_bad_echo_and_bad_pending_data():
    plan = make_plan(quick=True)
    results = fake_results(plan)
    results["latency"]["ours@own"][8 * MIB]["data_ok"] = False
    results["pending"]["ours"]["data_ok"] = False
    assert quality_flags(plan, results) == [
        "latency ours, own stream at 8 MiB: the echoed bytes did NOT match what was sent",
        "pending receive with ours: the received bytes did NOT match",
    ]
