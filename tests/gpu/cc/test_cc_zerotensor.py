"""ZeroTensors (``torch._efficientzerotensor``) through the shim on a GPU, under emulated CC, against plain torch.

A ZeroTensor is a plain, contiguous ``torch.Tensor`` whose data pointer is 0: torch's own copy reads none of it
(``.to()`` gives zeros, ``copy_`` from one zero-fills) and refuses to write it ("ZeroTensors are immutable").
Before the fix the shim's fast lane moved its bytes by pointer: the inline upload read host address 0 (a
segfault), a copy into a CUDA one wrote device address 0 (an illegal access: the context died), and an offloaded
readback's raw device copy failed (``CUDA_ERROR_INVALID_VALUE``). Each case runs in a fresh process, so that a
crash fails its test instead of the whole run; each computes plain torch's answer first (the oracle), then the
shim's, and checks that the CUDA context still works afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

CHILD_TIMEOUT_S = 120

PRELUDE = textwrap.dedent("""
    import torch
    import syncless.cc as cc

    dev = torch.device("cuda", 0)
    torch.cuda.init()


    def zeros_of(nbytes, device="cpu"):
        return torch._efficientzerotensor(max(nbytes // 8, 1), dtype=torch.int64, device=device)


    def sevens(nbytes, device="cpu", pinned=False):
        t = torch.full((max(nbytes // 8, 1),), 7, dtype=torch.int64, device=device)
        return t.pin_memory() if pinned else t


    def same(out, expected):
        assert type(out) is torch.Tensor, type(out)
        assert (out.device, out.dtype, out.shape, out.stride()) == (
            expected.device, expected.dtype, expected.shape, expected.stride()), (out, expected)
        assert out._is_zerotensor() == expected._is_zerotensor(), (out._is_zerotensor(), expected._is_zerotensor())
        if out.device.type == "cpu":
            assert out.is_pinned() == expected.is_pinned(), (out.is_pinned(), expected.is_pinned())
        assert torch.equal(out.cpu(), expected.cpu()), out


    def error_of(fn):
        try:
            fn()
        except RuntimeError as err:
            return str(err)
        raise AssertionError("no RuntimeError")


    def context_works():
        torch.cuda.synchronize()
        x = torch.arange(1 << 10, device=dev, dtype=torch.float32)
        assert (x * 2).sum().item() == float((1 << 10) * ((1 << 10) - 1))
        torch.cuda.synchronize()
""")


def _run(body: str) -> None:
    """Run ``PRELUDE`` + ``body`` in a new interpreter with this one's ``sys.path``; fail unless it printed OK."""
    code = PRELUDE + textwrap.dedent(body) + "\nprint('OK', flush=True)\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                              timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the child ran past {CHILD_TIMEOUT_S} s:\n{(err.stderr or b'')[-4000:]!r}")
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), (
        f"rc {done.returncode} (a negative rc is the signal that killed it)\n"
        f"stdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-4000:]}")


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
@pytest.mark.parametrize("nbytes", [8, 64, 16 << 10, (1 << 20) + 8])
def test_a_host_zerotensor_uploads_as_torchs_zeros(nbytes, busy):
    """``.to("cuda")``, ``d.copy_(z)`` and ``.cuda()``: inlined (<= 4080 bytes), torch's own on an idle stream or
    staged behind a busy one before the fix; now each is torch's own copy, counted in ``left_alone["layout"]``."""
    _run(f"""
        NBYTES, BUSY = {nbytes}, {busy}
        z = zeros_of(NBYTES)
        expected_to = z.to("cuda", non_blocking=True)
        expected_copy = sevens(NBYTES, dev).copy_(z, non_blocking=True)
        expected_cuda = z.cuda(non_blocking=True)
        torch.cuda.synchronize()

        cc.install("emulate")
        cc.reset_stats()
        d = sevens(NBYTES, dev)
        if BUSY:
            torch.cuda._sleep(50_000_000)  # the current stream busy (a large upload would be staged)
        out_to = z.to("cuda", non_blocking=True)
        assert d.copy_(z, non_blocking=True) is d
        out_cuda = z.cuda(non_blocking=True)
        torch.cuda.synchronize()
        same(out_to, expected_to)
        same(d, expected_copy)
        same(out_cuda, expected_cuda)
        stats = cc.stats()
        assert stats.left_alone.get("layout") == 3, stats
        assert stats.inlined == stats.staged == 0, stats
        context_works()
        cc.uninstall()
    """)


@pytest.mark.parametrize("nbytes", [64, 8 << 10, 2 << 20])
def test_a_cuda_zerotensor_reads_back_on_a_d2h_stream_as_torchs_zeros(nbytes):
    """``.to("cpu")`` and ``host.copy_(dz)`` on a D2H stream: read at the call (under 4 KiB) or offloaded before
    the fix (a raw device copy from address 0); now torch's own, and a plain readback on the same stream after them
    still gives its bytes."""
    _run(f"""
        NBYTES = {nbytes}
        dz = zeros_of(NBYTES, dev)
        src = torch.arange(max(NBYTES // 8, 1), dtype=torch.int64, device=dev)
        expected_to = dz.to("cpu", non_blocking=True)
        expected_into = sevens(NBYTES, pinned=True).copy_(dz, non_blocking=True)
        expected_src = src.cpu()
        torch.cuda.synchronize()

        cc.install("emulate")
        cc.reset_stats()
        d2h = cc.new_d2h_stream(dev)
        host = sevens(NBYTES, pinned=True)
        d2h.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(d2h):
            out_to = dz.to("cpu", non_blocking=True)
            assert host.copy_(dz, non_blocking=True) is host
            back = src.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        ready.synchronize()
        same(out_to, expected_to)
        same(host, expected_into)
        assert torch.equal(back, expected_src)
        stats = cc.stats()
        assert stats.left_alone.get("layout") == 2, stats
        cc.close_d2h_stream(d2h)
        context_works()
        cc.uninstall()
    """)


def test_a_copy_into_a_zerotensor_raises_torchs_error_and_the_context_lives():
    """``dz.copy_(ones, non_blocking=True)`` (inline-sized and staged-sized) and ``hz.copy_(d, non_blocking=True)``
    on a D2H stream raise torch's own RuntimeError at the call, a registered target present or not; a ZeroTensor
    is refused as a registered target."""
    _run("""
        ones_h = {n: torch.ones(n // 8, dtype=torch.int64) for n in (64, 8 << 10)}
        ones_d = torch.ones(8, dtype=torch.int64, device=dev)
        dz = {n: zeros_of(n, dev) for n in (64, 8 << 10)}
        hz = zeros_of(64)
        expected_h2d = {n: error_of(lambda: dz[n].copy_(ones_h[n], non_blocking=True)) for n in dz}
        expected_d2h = error_of(lambda: hz.copy_(ones_d, non_blocking=True))
        assert "ZeroTensors are immutable" in expected_h2d[64] and "ZeroTensors are immutable" in expected_d2h
        torch.cuda.synchronize()

        cc.install("emulate")
        d2h = cc.new_d2h_stream(dev)
        for n in dz:
            assert error_of(lambda: dz[n].copy_(ones_h[n], non_blocking=True)) == expected_h2d[n]
            context_works()
        d2h.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(d2h):
            assert error_of(lambda: hz.copy_(ones_d, non_blocking=True)) == expected_d2h
        context_works()
        target = torch.zeros(8, dtype=torch.int64, device=dev)  # kept alive: the registration is weak
        cc.register_inplace_h2d_target(target)
        for n in dz:
            assert error_of(lambda: dz[n].copy_(ones_h[n], non_blocking=True)) == expected_h2d[n]
        try:
            cc.register_inplace_h2d_target(dz[64])
        except ValueError:
            pass
        else:
            raise AssertionError("a ZeroTensor registered as an in-place target")
        context_works()
        cc.close_d2h_stream(d2h)
        cc.uninstall()
    """)
