"""The demo on two GPUs: copy engines between them and no hidden sync in the loop."""

import pytest

from syncless import cli

pytestmark = pytest.mark.timeout(240)


@pytest.mark.multi_gpu
def test_demo_two_gpus_uses_copy_engines_and_has_no_hidden_sync(capsys):
    assert cli.main(["demo", "--steps", "48", "--timeout-s", "180"]) == 0
    out = capsys.readouterr().out
    assert "stage 0: cuda:0" in out and "stage 1: cuda:1" in out
    assert "transport: copy_engine\n" in out
    assert "hidden syncs in the hot loop: none (checked in record mode)" in out
    assert "confidential computing: off" in out


@pytest.mark.multi_gpu
def test_demo_two_gpus_with_more_micro_batches_than_the_default_depth(capsys):
    # The token link carries a step's micro-batches into the next step: with 4 of them
    # (more than make_transport's default depth of 2) the loop must still not stall.
    assert cli.main(["demo", "--steps", "24", "--micro-batches", "4", "--timeout-s", "120"]) == 0
    out = capsys.readouterr().out
    assert "transport: copy_engine\n" in out
    assert "hidden syncs in the hot loop: none (checked in record mode)" in out
