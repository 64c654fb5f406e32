"""The demo on two GPUs: both runs side by side, copy engines against NCCL, no hidden sync, the pending-receive line."""

import pytest

from syncless import cli

pytestmark = pytest.mark.timeout(300)


def _rows(out):
    """The summary's run table: label -> the cells after it.

    A row reads ``  syncless           copy_engine            3072      1.23      2,500   none``: the
    transport, tokens, seconds, tokens/s, then the hidden syncs found in the hot loop ("none", or
    "N at M site(s)", or "not checked").
    """
    return {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.startswith(("  syncless ", "  torch.distributed ")) and " / " not in line}


def _check_both_runs(out):
    """Copy engines against NCCL, no hidden sync in either run, the same tokens generated and the same last tokens."""
    rows = _rows(out)
    assert set(rows) == {"syncless", "torch.distributed"}, out
    assert rows["syncless"][0] == "copy_engine" and rows["torch.distributed"][0] == "torch_distributed", out
    assert rows["syncless"][-1] == "none" and rows["torch.distributed"][-1] == "none", out
    assert rows["syncless"][1] == rows["torch.distributed"][1], out  # tokens generated
    assert "(the same in both runs)" in out  # and the same tokens: both transports delivered every step intact
    assert "fell back" not in out


@pytest.mark.multi_gpu
def test_demo_two_gpus_runs_copy_engines_against_nccl_with_no_hidden_sync(capsys):
    # The default (GPU-paced) model and batch; fewer steps than the default to keep the suite short.
    assert cli.main(["demo", "--steps", "48", "--timeout-s", "240"]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "stage 0: cuda:0" in out and "stage 1: cuda:1" in out
    _check_both_runs(out)
    assert "syncless / torch.distributed: " in out
    pending = [line for line in out.splitlines() if "full-SM kernel on stage 1 while a" in line]
    assert pending and "NCCL " in pending[0] and "copy_engine " in pending[0], out
    assert "warning" not in pending[0]  # each receive stayed pending and its data arrived intact
    assert "confidential computing: off" in out


@pytest.mark.multi_gpu
def test_demo_two_gpus_with_more_micro_batches_than_the_default_depth(capsys):
    # The token link carries a step's micro-batches into the next step: with 4 of them
    # (more than make_transport's default depth of 2) the loop must still not stall.
    assert cli.main(["demo", "--model", "small", "--steps", "24", "--micro-batches", "4", "--timeout-s", "180"]) == 0
    out = capsys.readouterr().out
    print(out)
    _check_both_runs(out)
