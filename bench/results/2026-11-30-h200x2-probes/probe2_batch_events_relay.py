"""Scratch probe 2 (not committed): batch copies, event record cost, local unpack options, relay cost."""
import time
import torch
from cuda.bindings import driver as d

def ck(r):
    if isinstance(r, tuple):
        if r[0] != d.CUresult.CUDA_SUCCESS:
            raise RuntimeError(str(r))
        return r[1] if len(r) == 2 else r[1:]
    if r != d.CUresult.CUDA_SUCCESS:
        raise RuntimeError(str(r))

torch.cuda.set_device(0)
a = torch.empty(64 << 20, dtype=torch.uint8, device="cuda:0")
a2 = torch.empty(64 << 20, dtype=torch.uint8, device="cuda:0")
b = torch.empty(64 << 20, dtype=torch.uint8, device="cuda:1")
b.copy_(a[:16].repeat(b.numel() // 16)); torch.cuda.synchronize(0); torch.cuda.synchronize(1)
A, A2, B = a.data_ptr(), a2.data_ptr(), b.data_ptr()
FL = torch.zeros(8, dtype=torch.int64, device="cuda:0").data_ptr()
FP = torch.zeros(8, dtype=torch.int64, device="cuda:1").data_ptr()
attr = d.CUmemcpyAttributes()
attr.srcAccessOrder = d.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
attr_o = d.CUmemcpyAttributes()
attr_o.srcAccessOrder = d.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
attr_o.flags = d.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
P = d.CUdeviceptr
def batch(s, dsts, srcs, sizes, at=attr):
    ck(d.cuMemcpyBatchAsync([P(x) for x in dsts], [P(x) for x in srcs], sizes, len(sizes), [at], [0], 1, s))
def cp(s, dst, src, n):
    ck(d.cuMemcpyAsync(dst, src, n, s))
ev = [ck(d.cuEventCreate(int(d.CUevent_flags.CU_EVENT_DISABLE_TIMING))) for _ in range(4)]
relay = ck(d.cuStreamCreate(int(d.CUstream_flags.CU_STREAM_NON_BLOCKING)))

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
legacy = torch.cuda.default_stream(0)
def show(label, fn, st=created, n=100):
    try:
        res = sorted(timeit(fn, st, n) for _ in range(3))[1]
        print(f"{label:60s} GPU {res[0]:7.2f} us/iter  host {res[1]:6.1f} us", flush=True)
    except Exception as e:
        print(f"{label:60s} FAILED {e}", flush=True)

for total in (64 << 10, 8 << 20):
    h = total // 2
    k = f"{total >> 10} KiB"
    show(f"{k} peer: one copy", lambda s: cp(s, B, A, total))
    show(f"{k} peer: two copies", lambda s: (cp(s, B, A, h), cp(s, B + h + 4096, A + h + 4096, h)))
    show(f"{k} peer: batch of two", lambda s: batch(s, [B, B + h + 4096], [A, A + h + 4096], [h, h]))
    show(f"{k} peer: batch of two, overlap flag", lambda s: batch(s, [B, B + h + 4096], [A, A + h + 4096], [h, h], attr_o))
    show(f"{k} peer: two copies + 3 event records", lambda s: (ck(d.cuEventRecord(ev[0], s)), cp(s, B, A, h),
         cp(s, B + h + 4096, A + h + 4096, h), ck(d.cuEventRecord(ev[1], s)), ck(d.cuEventRecord(ev[2], s))))
    show(f"{k} peer: two copies + wait + write", lambda s: (ck(d.cuStreamWaitValue64(s, FL, 0, 0)), cp(s, B, A, h),
         cp(s, B + h + 4096, A + h + 4096, h), ck(d.cuStreamWriteValue64(s, FP, 1, 0))))
    show(f"{k} peer: batch + wait + write", lambda s: (ck(d.cuStreamWaitValue64(s, FL, 0, 0)),
         batch(s, [B, B + h + 4096], [A, A + h + 4096], [h, h]), ck(d.cuStreamWriteValue64(s, FP, 1, 0))))
    def relayed(s, h=h):
        ck(d.cuEventRecord(ev[0], s)); ck(d.cuStreamWaitEvent(relay, ev[0], 0))
        cp(relay, B, A, h); cp(relay, B + h + 4096, A + h + 4096, h)
        ck(d.cuEventRecord(ev[1], relay)); ck(d.cuStreamWaitEvent(s, ev[1], 0))
    show(f"{k} peer: two copies relayed from legacy", relayed, legacy)
    show(f"{k} peer: two copies on legacy", lambda s: (cp(s, B, A, h), cp(s, B + h + 4096, A + h + 4096, h)), legacy)
    # local unpack options
    show(f"{k} local: two cuMemcpyAsync", lambda s: (cp(s, A2, A, h), cp(s, A2 + h + 4096, A + h + 4096, h)))
    show(f"{k} local: batch of two", lambda s: batch(s, [A2, A2 + h + 4096], [A, A + h + 4096], [h, h]))
    src1, dst1 = a[:h].view(torch.int16), a2[:h].view(torch.int16)
    src2, dst2 = a[h + 4096:2 * h + 4096].view(torch.int16), a2[h + 4096:2 * h + 4096].view(torch.int16)
    show(f"{k} local: two torch copy_", lambda s: (dst1.copy_(src1), dst2.copy_(src2)))
    show(f"{k} local: two bitwise_or kernels", lambda s: (torch.bitwise_or(src1, 0, out=dst1), torch.bitwise_or(src2, 0, out=dst2)))
    show(f"{k} local: two copies on legacy", lambda s: (cp(s, A2, A, h), cp(s, A2 + h + 4096, A + h + 4096, h)), legacy)
tot = 64 << 20
q = tot // 4
for label, fn in (("64MiB one copy", lambda s: cp(s, B, A, tot)),
                  ("64MiB batch of 4", lambda s: batch(s, [B + i * q for i in range(4)], [A + i * q for i in range(4)], [q] * 4)),
                  ("64MiB local one copy", lambda s: cp(s, A2, A, tot)),
                  ("64MiB local torch copy_", lambda s: a2.copy_(a)),
                  ("64MiB local bitwise_or", lambda s: torch.bitwise_or(a, 0, out=a2))):
    gpu, _ = timeit(fn, created, 20)
    print(f"{label}: {tot / gpu / 1e3:.1f} GB/s ({gpu:.1f} us)", flush=True)
