"""Scratch probe (not committed): per-op cost of peer copies, single vs two vs batched."""
import sys, time
import torch
from cuda.bindings import driver as d

def ck(r):
    if isinstance(r, tuple):
        if r[0] != d.CUresult.CUDA_SUCCESS:
            raise RuntimeError(str(r))
        return r[1] if len(r) == 2 else r[1:]
    if r != d.CUresult.CUDA_SUCCESS:
        raise RuntimeError(str(r))

torch.cuda.init()
a = torch.empty(64 << 20, dtype=torch.uint8, device="cuda:0")
b = torch.empty(64 << 20, dtype=torch.uint8, device="cuda:1")
torch.cuda.set_device(0)
b.copy_(a[:16].repeat(b.numel() // 16))  # touches peer access
torch.cuda.synchronize(0); torch.cuda.synchronize(1)
ctx1 = ck(d.cuDevicePrimaryCtxRetain(1))
try:
    ck(d.cuCtxEnablePeerAccess(ctx1, 0))
except Exception as e:
    print("enable peer:", e)
flag_local = torch.zeros(64, dtype=torch.int64, device="cuda:0")
flag_peer = torch.zeros(64, dtype=torch.int64, device="cuda:1")

attr = d.CUmemcpyAttributes()
attr.srcAccessOrder = d.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
attr_o = d.CUmemcpyAttributes()
attr_o.srcAccessOrder = d.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
attr_o.flags = d.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE

def batch(stream, dsts, srcs, sizes, at=attr):
    r = d.cuMemcpyBatchAsync(dsts, srcs, sizes, len(sizes), [at], [0], 1, stream)
    ck(r)

def cp(stream, dst, src, n):
    ck(d.cuMemcpyAsync(dst, src, n, stream))

A, B = a.data_ptr(), b.data_ptr()
FL, FP = flag_local.data_ptr(), flag_peer.data_ptr()

def variants(total):
    h = total // 2
    return {
        "one copy": lambda s: cp(s, B, A, total),
        "two copies": lambda s: (cp(s, B, A, h), cp(s, B + h + 4096, A + h + 4096, h)),
        "batch of two": lambda s: batch(s, [B, B + h + 4096], [A, A + h + 4096], [h, h]),
        "batch of two, overlap flag": lambda s: batch(s, [B, B + h + 4096], [A, A + h + 4096], [h, h], attr_o),
        "two copies + wait + write": lambda s: (ck(d.cuStreamWaitValue64(s, FL, 0, 0)), cp(s, B, A, h),
                                                cp(s, B + h + 4096, A + h + 4096, h),
                                                ck(d.cuStreamWriteValue64(s, FP, 1, 0))),
        "batch + wait + write": lambda s: (ck(d.cuStreamWaitValue64(s, FL, 0, 0)),
                                           batch(s, [B, B + h + 4096], [A, A + h + 4096], [h, h]),
                                           ck(d.cuStreamWriteValue64(s, FP, 1, 0))),
    }

def timeit(fn, stream_torch, n=100):
    with torch.cuda.stream(stream_torch):
        s = torch.cuda.current_stream().cuda_stream
        for _ in range(5):
            fn(s)
        torch.cuda._sleep(20_000_000)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t = time.perf_counter()
        for _ in range(n):
            fn(s)
        host = (time.perf_counter() - t) / n * 1e6
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) * 1000 / n, host

created = torch.cuda.Stream(device=0)
for total in (64 << 10, 1 << 20, 8 << 20):
    for name, fn in variants(total).items():
        for sname, st in (("created", created), ("legacy", torch.cuda.default_stream(0))):
            if "batch" in name and sname == "legacy":
                continue
            try:
                med = sorted(timeit(fn, st) for _ in range(3))[1]
                print(f"{total>>10:6d} KiB  {name:30s} {sname:8s} GPU {med[0]:7.2f} us/iter  host {med[1]:6.1f} us", flush=True)
            except Exception as e:
                print(f"{total>>10:6d} KiB  {name:30s} {sname:8s} FAILED {e}", flush=True)
# bandwidth: 64 MiB single vs batch of 4
tot = 64 << 20
q = tot // 4
for name, fn in {"64MiB one copy": lambda s: cp(s, B, A, tot),
                 "64MiB batch of 4": lambda s: batch(s, [B + i * q for i in range(4)], [A + i * q for i in range(4)], [q] * 4)}.items():
    gpu, _ = timeit(fn, created, 20)
    print(f"{name}: {tot / gpu / 1e3:.1f} GB/s", flush=True)
