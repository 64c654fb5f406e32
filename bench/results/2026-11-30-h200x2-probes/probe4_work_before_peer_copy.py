"""Scratch probe 4 (not committed): does a local copy before a peer copy cost extra on another stream too?"""
import torch
from cuda.bindings import driver as d

def ck(r):
    if isinstance(r, tuple):
        if r[0] != d.CUresult.CUDA_SUCCESS:
            raise RuntimeError(str(r))
        return r[1] if len(r) == 2 else r[1:]
    if r != d.CUresult.CUDA_SUCCESS:
        raise RuntimeError(str(r))

N = 64 << 20
a = torch.randint(0, 255, (N,), dtype=torch.uint8, device="cuda:0")
b = torch.zeros(N, dtype=torch.uint8, device="cuda:1")
b.copy_(a); a.copy_(b)
torch.cuda.synchronize(0); torch.cuda.synchronize(1)
torch.cuda.set_device(0)
a2 = torch.empty(N, dtype=torch.uint8, device="cuda:0")
A, A2, B = a.data_ptr(), a2.data_ptr(), b.data_ptr()
attr = d.CUmemcpyAttributes()
attr.srcAccessOrder = d.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
attr.flags = d.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
P = d.CUdeviceptr
def batch(s, dsts, srcs, sizes):
    ck(d.cuMemcpyBatchAsync([P(x) for x in dsts], [P(x) for x in srcs], sizes, len(sizes), [attr], [0], 1, s))
def cp(s, dst, src, n): ck(d.cuMemcpyAsync(dst, src, n, s))
s0 = torch.cuda.Stream(device=0)
side = torch.cuda.Stream(device=0)
S = side.cuda_stream
ev = [ck(d.cuEventCreate(int(d.CUevent_flags.CU_EVENT_DISABLE_TIMING))) for _ in range(2)]
x = torch.randn(4096, 4096, device="cuda:0")

def gpu_timed(label, fn, n=100):
    res = []
    with torch.cuda.stream(s0):
        s = s0.cuda_stream
        for _ in range(5):
            fn(s)
        for _ in range(3):
            torch.cuda._sleep(20_000_000)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(n):
                fn(s)
            e1.record()
            e1.synchronize()
            res.append(e0.elapsed_time(e1) * 1000 / n)
    print(f"{label:64s} {sorted(res)[1]:7.2f} us", flush=True)

for total in (64 << 10, 8 << 20):
    h = total // 2
    k = f"{total >> 10} KiB"
    peer = lambda s: batch(s, [B, B + h + 4096], [A, A + h + 4096], [h, h])
    local = lambda s: (cp(s, A2, A, h), cp(s, A2 + h + 4096, A + h + 4096, h))
    src1, dst1 = a[:h], a2[:h]
    src2, dst2 = a[h + 4096:2 * h + 4096], a2[h + 4096:2 * h + 4096]
    gpu_timed(f"{k} peer only", peer)
    gpu_timed(f"{k} 2xlocal then peer, same stream", lambda s: (local(s), peer(s)))
    def other(s):
        ck(d.cuEventRecord(ev[0], s)); ck(d.cuStreamWaitEvent(S, ev[0], 0))
        local(S)
        ck(d.cuEventRecord(ev[1], S)); ck(d.cuStreamWaitEvent(s, ev[1], 0))
        peer(s)
    gpu_timed(f"{k} 2xlocal on side stream, event, peer", other)
    def other_noloc(s):
        ck(d.cuEventRecord(ev[0], s)); ck(d.cuStreamWaitEvent(S, ev[0], 0))
        ck(d.cuEventRecord(ev[1], S)); ck(d.cuStreamWaitEvent(s, ev[1], 0))
        peer(s)
    gpu_timed(f"{k} side-stream round trip (no copy), peer", other_noloc)
    gpu_timed(f"{k} 2x torch add-0 kernel (SM copy) then peer", lambda s: (torch.bitwise_or(src1, 0, out=dst1), torch.bitwise_or(src2, 0, out=dst2), peer(s)))
    gpu_timed(f"{k} 2x torch add-0 kernel alone", lambda s: (torch.bitwise_or(src1, 0, out=dst1), torch.bitwise_or(src2, 0, out=dst2)))
    gpu_timed(f"{k} small kernel then peer", lambda s: (x[:1].add_(1), peer(s)))
    gpu_timed(f"{k} small kernel alone", lambda s: x[:1].add_(1))
    gpu_timed(f"{k} local batch then peer", lambda s: (batch(s, [A2, A2 + h + 4096], [A, A + h + 4096], [h, h]), peer(s)))
    gpu_timed(f"{k} peer then 2xlocal", lambda s: (peer(s), local(s)))
