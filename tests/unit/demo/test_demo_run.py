"""The demo end to end on the CPU: two gloo processes, both runs, a summary that tells the truth."""

from syncless import cli


def test_demo_runs_two_cpu_stages_twice_and_summarizes(capsys):
    assert cli.main(["demo", "--cpu", "--steps", "6", "--batch", "2", "--timeout-s", "120", "--plant-sync"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "2 stage(s) on the CPU" in out
    assert "stage 0: cpu, layers 0-1" in out and "stage 1: cpu, layers 2-3" in out
    lines = out.splitlines()
    rows = [line.split() for line in lines if line.startswith(("  syncless ", "  torch.distributed ")) and " / " not in line]
    assert [row[:3] for row in rows] == [["syncless", "torch_distributed", "24"],
                                         ["torch.distributed", "torch_distributed", "24"]]  # 6 x 2 x 2 tokens each
    assert "syncless / torch.distributed:" in out
    assert "fell back: copy-engine set-up failed" in out  # no copy engines without CUDA, and the reason is given
    assert "hidden syncs: not checked (" in out
    assert "--plant-sync: the planted .item() ran, but nothing could check it here" in out
    assert "confidential computing: off" in out
    assert "(the same in both runs)" in out
    # The fallback and "nothing to check" are said once, in the summary, not once per process and transport.
    assert "using torch.distributed instead of copy engines" not in captured.err
    assert "nothing to check" not in captured.err


def test_demo_with_more_than_two_stages_runs_both_runs(capsys):
    # All ranks must create groups in the same order; with a middle stage a wrong order hangs.
    assert cli.main(["demo", "--cpu", "--stages", "3", "--steps", "2", "--batch", "1", "--timeout-s", "100"]) == 0
    out = capsys.readouterr().out
    assert "stage 2: cpu, layers 3-3" in out
    assert "syncless / torch.distributed:" in out
