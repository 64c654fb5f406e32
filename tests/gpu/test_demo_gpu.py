"""The demo on one GPU: emulated CC, no hidden sync in the loop, and a planted one caught with its file:line."""

import pytest

from syncless import cli

pytestmark = pytest.mark.timeout(240)


def _rows(out):
    """The summary's run table: label -> the cells after it."""
    return {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.startswith(("  syncless ", "  torch.distributed ")) and " / " not in line}


@pytest.mark.gpu
def test_demo_one_gpu_with_emulated_cc_has_no_hidden_sync(capsys):
    assert cli.main(["demo", "--stages", "1", "--model", "small", "--steps", "32", "--cc", "emulate",
                     "--timeout-s", "180"]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "stage 0: cuda:0" in out
    rows = _rows(out)
    assert list(rows) == ["syncless"]  # one stage: nothing to compare
    assert rows["syncless"][-1] == "none"
    assert "confidential computing: emulate" in out


@pytest.mark.gpu
def test_a_planted_item_is_caught_at_its_line(capsys):
    # Two stages share the one GPU: the copy-engine run happens, and NCCL's run is left out with the reason
    # (NCCL refuses two ranks on one GPU; seen on an H200 as "Duplicate GPU detected").
    assert cli.main(["demo", "--stages", "2", "--model", "small", "--steps", "16", "--plant-sync",
                     "--timeout-s", "180"]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "no torch.distributed run: its NCCL backend refuses two ranks on one GPU" in out
    assert list(_rows(out)) == ["syncless"]
    caught = [line for line in out.splitlines() if "--plant-sync: the planted .item() was caught at " in line]
    assert caught, out
    assert "demo/_stage.py:" in caught[0]  # the planted line, not a launcher or torch frame
    # Once per micro-batch and measured step: 16 steps x 2 micro-batches.
    assert "(32 times in the run)" in caught[0]
