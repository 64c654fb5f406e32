"""The demo's closing summary, from made-up stage reports (CPU only)."""

import dataclasses

import pytest

from syncless.demo._config import PRESETS
from syncless.demo._stage import DemoOptions, StageResult
from syncless.demo._summary import format_summary

OPTIONS = DemoOptions(model=PRESETS["tiny"], steps=50, batch=3, micro_batches=4, stages=2, devices=["cpu", "cpu"])
CC = {"mode": "emulate", "reason": "SYNCLESS_CC=emulate"}


def stage(rank, layers, **changes):
    """A stage report as run_stage returns it: only the last stage counts tokens and keeps a sample."""
    result = StageResult(rank=rank, device=f"cuda:{rank}", layers=layers, transport="copy_engine",
                         transport_reason=None, tokens_generated=0, elapsed_s=1.5, syncs=[], sync_report="",
                         sync_checked=True, cc=CC, sample=[])
    return dataclasses.replace(result, **changes)


def two_stages(**last_changes):
    last = {"tokens_generated": 600, "elapsed_s": 2.0, "sample": [[1, 2], [3, 4]], **last_changes}
    return [stage(0, [0, 1]), stage(1, [2, 3], **last)]


def test_summary_reports_the_last_stage_tokens_and_rate():
    text = format_summary(OPTIONS, two_stages(), wall_s=7.31)
    assert "  stage 0: cuda:0, layers 0-1\n  stage 1: cuda:1, layers 2-3\n" in text
    assert "  transport: copy_engine\n" in text
    assert ("  decode: 600 tokens in 2.00 s = 300 tokens/s (50 steps x 4 micro-batches x 3 sequences; 7.3 s with "
            "start-up)") in text
    assert "  hidden syncs in the hot loop: none (checked in record mode)" in text
    assert "  confidential computing: emulate (SYNCLESS_CC=emulate)" in text
    assert text.endswith("  last tokens (first 8 sequences): [3, 4]")


def test_a_zero_elapsed_time_gives_no_rate_instead_of_an_error():
    assert "600 tokens in 0.00 s = nan tokens/s" in format_summary(OPTIONS, two_stages(elapsed_s=0.0), wall_s=1.0)


def test_one_stage_has_no_transport():
    only = stage(0, [0, 1, 2, 3], transport=None, tokens_generated=8, sample=[[5]])
    text = format_summary(OPTIONS, [only], wall_s=1.0)
    assert "  transport: none (one stage)" in text and "fallback" not in text


def test_a_fallback_transport_says_why():
    results = two_stages()
    results[0] = stage(0, [0, 1], transport="torch_distributed", transport_reason="no peer access")
    assert "  transport: torch_distributed (fallback: no peer access)" in format_summary(OPTIONS, results, wall_s=1.0)


@pytest.mark.parametrize("rows, total", [([{"site": "a.py:3"}], 1), ([{"count": 3}, {"count": 2}], 5)])
def test_syncs_are_counted_and_each_stage_report_is_shown(rows, total):
    results = [stage(0, [0, 1], syncs=rows, sync_report="hidden sync at a.py:3\n  .item()"), *two_stages()[1:]]
    text = format_summary(OPTIONS, results, wall_s=1.0)
    assert f"  hidden syncs in the hot loop: {total}\n  stage 0:\n    hidden sync at a.py:3\n      .item()\n" in text
    assert "  stage 1:\n" not in text  # the clean stage is not listed


def test_a_build_without_sync_debug_mode_says_nothing_was_checked():
    results = [dataclasses.replace(r, sync_checked=False) for r in two_stages()]
    assert "  hidden syncs in the hot loop: not checked" in format_summary(OPTIONS, results, wall_s=1.0)
