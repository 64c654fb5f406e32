"""The demo on one GPU with emulated CC: no hidden sync in the loop."""

import pytest

from syncless import cli

pytestmark = pytest.mark.timeout(180)


@pytest.mark.gpu
def test_demo_one_gpu_with_emulated_cc_has_no_hidden_sync(capsys):
    assert cli.main(["demo", "--stages", "1", "--steps", "32", "--cc", "emulate", "--timeout-s", "120"]) == 0
    out = capsys.readouterr().out
    assert "stage 0: cuda:0" in out and "transport: none (one stage)" in out
    assert "hidden syncs in the hot loop: none (checked in record mode)" in out
    assert "confidential computing: emulate" in out
