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
