"""The demo end to end on the CPU: two gloo processes, a summary that tells the truth."""

from syncless import cli


def test_demo_runs_two_cpu_stages_and_summarizes(capsys):
    assert cli.main(["demo", "--cpu", "--steps", "6", "--batch", "2", "--timeout-s", "120"]) == 0
    out = capsys.readouterr().out
    assert "2 stage(s) on the CPU" in out
    assert "stage 0: cpu, layers 0-1" in out and "stage 1: cpu, layers 2-3" in out
    assert "transport: torch_distributed" in out  # no copy engines without CUDA, and the reason is given
    assert "(fallback:" in out
    assert "24 tokens" in out  # 6 steps x 2 micro-batches x 2 sequences
    assert "confidential computing: off" in out
    assert "hidden syncs in the hot loop:" in out
