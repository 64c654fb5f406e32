"""On a real GPU: threads, torch.compile, record mode and ``syncless trace``."""

from __future__ import annotations

import argparse
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from syncless import syncs
from syncless.syncs import SyncViolation, _trace

HERE = Path(__file__).name


@pytest.mark.gpu
def test_another_thread_that_syncs_is_not_reported(detector, data):
    results = []

    def worker():
        results.append(data.g.sum().item())  # a sync, on a thread with no region
        torch.cuda.synchronize()

    with syncs.checking():
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join(60)
        assert not thread.is_alive()
        assert torch.cuda.get_sync_debug_mode() == 1  # armed for this thread all along
    assert len(results) == 1 and not syncs.report()


@pytest.mark.gpu
def test_an_allow_region_on_one_thread_does_not_disarm_another(detector, data):
    allowing, finish = threading.Event(), threading.Event()
    seen = []

    def worker():
        with syncs.checking(), syncs.allowed():
            allowing.set()
            finish.wait(60)
            seen.append(data.g.sum().item())  # allowed here

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert allowing.wait(60)
        with pytest.raises(SyncViolation) as caught:
            with syncs.checking():
                line = sys._getframe().f_lineno + 1
                data.g.sum().item()
        assert f"{HERE}:{line}" in str(caught.value)
    finally:
        finish.set()
        thread.join(60)
    assert len(seen) == 1
    assert torch.cuda.get_sync_debug_mode() == 0


@pytest.mark.gpu
def test_compiled_fullgraph_function_with_non_blocking_to_runs_checked(detector, data):
    syncs.set_mode("record")  # collect rather than raise, so a failure shows every site

    @torch.compile(fullgraph=True)
    def upload_and_reduce(host):
        on_gpu = host.to(data.dev, non_blocking=True)
        return (on_gpu * 2 + 1).sum(dim=0)

    host = torch.randn(64, 32).pin_memory()
    with syncs.checking():
        out = upload_and_reduce(host)  # compiles here, inside the region
        again = upload_and_reduce(host)  # and runs compiled
        done = torch.cuda.Event()
        done.record()
    assert not syncs.report(), syncs.report().format()
    done.synchronize()
    expected = (host * 2 + 1).sum(dim=0)
    torch.testing.assert_close(out.cpu(), expected)
    torch.testing.assert_close(again.cpu(), expected)


@pytest.mark.gpu
def test_record_mode_reports_each_site_once_with_its_count(detector, data):
    syncs.set_mode("record")
    with syncs.checking():
        for _ in range(3):
            item_line = sys._getframe().f_lineno + 1
            data.g.sum().item()
        for _ in range(2):
            copy_line = sys._getframe().f_lineno + 1
            data.pageable.to(data.dev, non_blocking=True)
        wait_line = sys._getframe().f_lineno + 1
        torch.cuda.synchronize()
    found = syncs.report()
    counts = {(Path(s.first.filename).name, s.first.lineno): s.count for s in found.sites}
    assert counts == {(HERE, item_line): 3, (HERE, copy_line): 2, (HERE, wait_line): 1}, found.format()
    text = found.format()
    assert text.count("--- ") == 3 and "pageable" in text


@pytest.mark.gpu
def test_trace_prints_the_sync_sites_of_a_function(tmp_path, capsys, cuda_device):
    script = tmp_path / "decode.py"
    script.write_text(textwrap.dedent("""
        import torch

        def step(x, host):
            y = x * 2
            total = y.sum().item()
            return y + host.to(x.device, non_blocking=True), total

        def main():
            x = torch.randn(256, device="cuda")
            host = torch.randn(256)
            print("setup", x.sum().item())
            for _ in range(4):
                x, _ = step(x, host)

        main()
    """))
    parser = argparse.ArgumentParser()
    _trace.add_arguments(parser)
    mode_before, to_before = syncs.mode(), torch.Tensor.to
    status = _trace.run(parser.parse_args(["--fn", "__main__:step", str(script)]))
    out = capsys.readouterr().out
    assert status == 0, out
    rows = {line.split()[1]: line.split()[0] for line in out.splitlines() if "decode.py:" in line and ("explicit" in line or "implicit" in line)}
    assert rows == {f"{script}:6": "4", f"{script}:7": "4"}, out
    assert "decode.py:12" not in out  # main() is not checked
    assert syncs.mode() == mode_before and torch.Tensor.to is to_before and not syncs.is_enabled()
