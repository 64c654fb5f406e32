"""Scratch probe 3 (not committed): push+pull split bandwidth; depth-2 vs depth-0 hop op chains."""
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

N = 256 << 20
a = torch.randint(0, 255, (N,), dtype=torch.uint8, device="cuda:0")
b = torch.zeros(N, dtype=torch.uint8, device="cuda:1")
b.copy_(a); a.copy_(b)  # both directions of peer access
torch.cuda.synchronize(0); torch.cuda.synchronize(1)
A, B = a.data_ptr(), b.data_ptr()
s0 = torch.cuda.Stream(device=0)
s1 = torch.cuda.Stream(device=1)
def cp(s, dst, src, n):
    ck(d.cuMemcpyAsync(dst, src, n, s))

def host_timed(label, enqueue, reps=20):
    for _ in range(3):
        enqueue()
    torch.cuda.synchronize(0); torch.cuda.synchronize(1)
    best = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            enqueue()
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        best.append((time.perf_counter() - t) / reps)
    el = min(best)
    print(f"{label:50s} {N / el / 1e9:7.1f} GB/s ({el * 1e6:.0f} us per 256 MiB)", flush=True)

host_timed("push only (GPU0 CE writes)", lambda: cp(s0.cuda_stream, B, A, N))
host_timed("pull only (GPU1 CE reads)", lambda: cp(s1.cuda_stream, B, A, N))
for frac in (0.5, 0.4, 0.3):
    k = int(N * frac) // 4096 * 4096
    host_timed(f"push {1 - frac:.0%} + pull {frac:.0%} concurrently",
               lambda k=k: (cp(s0.cuda_stream, B + k, A + k, N - k), cp(s1.cuda_stream, B, A, k)))

# op chains on GPU0
torch.cuda.set_device(0)
a2 = torch.empty(N, dtype=torch.uint8, device="cuda:0")
A2 = a2.data_ptr()
FL = torch.zeros(8, dtype=torch.int64, device="cuda:0").data_ptr()
FP = torch.zeros(8, dtype=torch.int64, device="cuda:1").data_ptr()
attr = d.CUmemcpyAttributes()
attr.srcAccessOrder = d.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
attr.flags = d.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
P = d.CUdeviceptr
def batch(s, dsts, srcs, sizes):
    ck(d.cuMemcpyBatchAsync([P(x) for x in dsts], [P(x) for x in srcs], sizes, len(sizes), [attr], [0], 1, s))
def wait(s): ck(d.cuStreamWaitValue64(s, FL, 0, 0))
def write(s): ck(d.cuStreamWriteValue64(s, FP, 1, 0))

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
    print(f"{label:60s} {sorted(res)[1]:7.2f} us", flush=True)

for total in (64 << 10, 8 << 20):
    h = total // 2
    k = f"{total >> 10} KiB"
    peer = lambda s: batch(s, [B, B + h + 4096], [A, A + h + 4096], [h, h])
    local = lambda s: (cp(s, A2, A, h), cp(s, A2 + h + 4096, A + h + 4096, h))
    gpu_timed(f"{k} depth-0 hop: write wait | wait batch write", lambda s: (write(s), wait(s), wait(s), peer(s), write(s)))
    gpu_timed(f"{k} depth-2 hop: wait 2xlocal write | wait batch write",
              lambda s: (wait(s), local(s), write(s), wait(s), peer(s), write(s)))
    gpu_timed(f"{k} depth-2 hop, local batched", lambda s: (wait(s), batch(s, [A2, A2 + h + 4096], [A, A + h + 4096], [h, h]),
                                                            write(s), wait(s), peer(s), write(s)))
    gpu_timed(f"{k} 2xlocal only", local)
    gpu_timed(f"{k} 2xlocal + write", lambda s: (local(s), write(s)))
    gpu_timed(f"{k} peer batch only", peer)
    gpu_timed(f"{k} 2xlocal then peer batch", lambda s: (local(s), peer(s)))
