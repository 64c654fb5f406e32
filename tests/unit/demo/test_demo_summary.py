"""The demo's closing summary, from made-up stage reports (CPU only)."""

import dataclasses

from syncless.demo._config import PRESETS
from syncless.demo._stage import DemoOptions, RunResult, StageResult
from syncless.demo._summary import format_summary, unplanted_sync_count

OPTIONS = DemoOptions(model=PRESETS["tiny"], steps=50, batch=3, micro_batches=4, stages=2, devices=["cpu", "cpu"],
                      runs=["syncless", "torch.distributed"])
CC = {"mode": "emulate", "reason": "SYNCLESS_CC=emulate"}
PLANTED = {"site": "src/syncless/demo/_stage.py:214", "count": 400, "operation": "Tensor.item",
           "function": "_planted_sync"}


def run(label, transport, **changes):
    result = RunResult(label=label, transport=transport, transport_reason=None, tokens_generated=0, elapsed_s=1.5,
                       syncs=[], sync_report="", sync_checked=True, sample=[])
    return dataclasses.replace(result, **changes)


def stages(ours=None, theirs=None, pending=None):
    """Two stage reports: only the last stage counts tokens and keeps a sample."""
    ours, theirs = ours or {}, theirs or {}
    first = StageResult(rank=0, device="cuda:0", layers=[0, 1], cc=CC,
                        runs=[run("syncless", "copy_engine"), run("torch.distributed", "torch_distributed")])
    last_runs = [
        run("syncless", "copy_engine", **{"tokens_generated": 600, "elapsed_s": 2.0, "sample": [[1, 2]], **ours}),
        run("torch.distributed", "torch_distributed",
            **{"tokens_generated": 600, "elapsed_s": 3.0, "sample": [[1, 2]], **theirs}),
    ]
    return [first, StageResult(rank=1, device="cuda:1", layers=[2, 3], cc=CC, runs=last_runs, pending=pending)]


def test_summary_puts_both_runs_side_by_side_with_their_ratio():
    text = format_summary(OPTIONS, stages(), wall_s=7.31)
    assert "  stage 0: cuda:0, layers 0-1\n  stage 1: cuda:1, layers 2-3\n" in text
    assert "50 steps x 4 micro-batches x 3 sequences per run; 7.3 s in all" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.startswith(("  syncless ", "  torch.distributed ")) and " / " not in line}
    assert rows["syncless"][:5] == ["syncless", "copy_engine", "600", "2.00", "300"]
    assert rows["torch.distributed"][:5] == ["torch.distributed", "torch_distributed", "600", "3.00", "200"]
    assert rows["syncless"][5:] == ["none"]
    assert "  syncless / torch.distributed: 1.50x the tokens/s" in text
    assert "same transport" not in text
    assert "  confidential computing: emulate (SYNCLESS_CC=emulate)" in text
    assert text.endswith("  last tokens (first 8 sequences): [1, 2] (the same in both runs)")


def test_a_zero_elapsed_time_gives_no_rate_instead_of_an_error():
    text = format_summary(OPTIONS, stages(ours={"elapsed_s": 0.0}), wall_s=1.0)
    assert "nan" in text and "syncless / torch.distributed: nanx" in text


def test_the_planted_sync_is_shown_with_its_site_and_does_not_count_as_a_finding():
    options = dataclasses.replace(OPTIONS, plant_sync=True)
    results = stages(ours={"syncs": [PLANTED], "sync_report": "table"}, theirs={"syncs": [PLANTED]})
    text = format_summary(options, results, wall_s=1.0)
    assert "--plant-sync: the planted .item() was caught at src/syncless/demo/_stage.py:214 (800 times" in text
    assert unplanted_sync_count(results) == 0
    other = dict(PLANTED, function="decode", count=3)
    assert unplanted_sync_count(stages(ours={"syncs": [PLANTED, other]})) == 3


def test_a_planted_sync_that_was_missed_is_said_so():
    text = format_summary(dataclasses.replace(OPTIONS, plant_sync=True), stages(), wall_s=1.0)
    assert "the planted .item() was NOT caught" in text


def test_unchecked_syncs_give_the_reason():
    results = stages(ours={"sync_checked": False}, theirs={"sync_checked": False})
    for r in results:
        for one in r.runs:
            one.sync_checked = False
    results[0].sync_unchecked_reason = "CPU-only build"
    assert "  hidden syncs: not checked (CPU-only build)" in format_summary(OPTIONS, results, wall_s=1.0)


def test_pending_receive_interference_is_reported_against_the_kernel_alone():
    pending = {"alone_ms": 2.0, "nccl_ratio": 2.01, "ours_ratio": 1.0, "ours_backend": "copy_engine",
               "pending_ok": True, "data_ok": True, "payload_nbytes": 8 << 20}
    text = format_summary(OPTIONS, stages(pending=pending), wall_s=1.0)
    assert ("full-SM kernel on stage 1 while a 8 MiB receive is pending, time vs alone (2.00 ms): NCCL 2.01x, "
            "copy_engine 1.00x") in text
    skipped = format_summary(OPTIONS, stages(pending={"skipped": "no NVRTC"}), wall_s=1.0)
    assert "full-SM kernel while a receive is pending: not measured (no NVRTC)" in skipped


def test_two_runs_over_the_same_transport_give_no_ratio_and_say_why():
    """On a CPU both runs use torch_distributed: no ratio of a transport against itself (#28 item 5), and no
    claim that the gap is noise either (#35 item 12: it was one-sided in 4 of 4 runs): nothing can be concluded."""
    results = stages(ours={"elapsed_s": 0.5})
    for stage in results:
        stage.runs[0] = dataclasses.replace(stage.runs[0], transport="torch_distributed")
    text = format_summary(OPTIONS, results, wall_s=3.0)
    assert "x the tokens/s" not in text
    assert ("  syncless / torch.distributed: no ratio: both runs used torch_distributed here, each measured once, "
            "one after the other; nothing about syncless can be concluded from their tokens/s on a CPU (the "
            "transports differ on GPUs with copy engines)") in text
    assert "noise" not in text
