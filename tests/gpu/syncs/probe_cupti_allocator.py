"""Probe (not a test): which allocator paths of torch make host-blocking CUDA calls, seen through CUPTI.

Run on a GPU machine with cupti-python (each scenario in its own process,
so that the caching allocator starts empty):

    PYTHONPATH=src python3 tests/gpu/syncs/probe_cupti_allocator.py

It subscribes to CUPTI itself (not through syncless) with the runtime and
driver calls that free, unmap or synchronize enabled, and prints, per
scenario, every such call with its nesting depth (a driver call made inside
a runtime call is indented) and the host time inside it, while the GPU is
kept busy with ~20 ms of queued work.

Scenarios (the open question of issue 16: a second empty_cache() made no
cudaFree):

1. ``first``: cached free segments, then empty_cache() twice: the first
   frees each whole free segment with cudaFree (does cuMemFree_v2 fire
   inside it?), the second finds nothing to free.
2. ``recached``: after the second, allocate and free again: empty_cache()
   frees the new segment again.
3. ``expandable``: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the
   segment is unmapped (cuMemUnmap/cuMemRelease), after a synchronize.
4. ``record_stream``: a block used on a side stream and recorded there:
   empty_cache() first waits on the block's events (cudaEventSynchronize).
5. ``oom_retry``: a memory fraction so small that an allocation must free
   cached segments first: torch.empty() itself blocks in cudaFree.
6. ``pinned``: torch's pinned host allocator: empty_host_cache (when this
   torch has it) frees with cudaFreeHost.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

WATCH = {
    "cudaFree", "cudaFreeHost", "cudaFreeAsync", "cudaMalloc", "cudaHostAlloc", "cudaDeviceSynchronize",
    "cudaStreamSynchronize", "cudaEventSynchronize", "cuMemFree_v2", "cuMemFreeHost", "cuMemUnmap", "cuMemRelease",
    "cuMemAddressFree", "cuMemCreate", "cuMemMap", "cuMemAlloc_v2", "cuCtxSynchronize", "cuStreamSynchronize",
    "cuEventSynchronize", "cuMemHostAlloc_v2",
}


def _base(name: str) -> str:
    head, sep, tail = name.rpartition("_v")
    return head if sep and tail.isdigit() and len(tail) >= 4 and head.startswith("cuda") else name


def run_scenario(name: str) -> None:
    import torch
    from cupti import cupti

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    calls: list[tuple[str, int, float]] = []
    depth = [0]
    started: list[float] = []

    def callback(userdata, domain, cbid, data):
        if data.callback_site == cupti.ApiCallbackSite.API_ENTER:
            depth[0] += 1
            started.append(time.perf_counter())
        else:
            depth[0] -= 1
            calls.append((data.function_name, depth[0], (time.perf_counter() - started.pop()) * 1e6))

    handle = cupti.subscribe(callback, None)
    for domain, table in ((cupti.CallbackDomain.RUNTIME_API, cupti.runtime_api_trace_cbid),
                          (cupti.CallbackDomain.DRIVER_API, cupti.driver_api_trace_cbid)):
        for cbid_name, cbid in table.__members__.items():
            if _base(cbid_name) in WATCH:
                cupti.enable_callback(1, handle, domain, cbid)

    def step(title, fn):
        torch.cuda.synchronize()
        torch.cuda._sleep(40_000_000)  # ~20 ms queued on the current stream
        calls.clear()
        start = time.perf_counter()
        fn()
        total = (time.perf_counter() - start) * 1e6
        print(f"  {title}: host {total:.0f} us, reserved {torch.cuda.memory_reserved() >> 20} MiB")
        for call, level, us in calls:
            print(f"    {'  ' * level}{call}: {us:.0f} us")
        if not calls:
            print("    (no watched call)")

    print(f"== {name}")
    if name in ("first", "recached", "expandable"):
        blocks = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda") for _ in range(3)]
        del blocks
        step("empty_cache #1 (3 cached 64 MiB blocks)", torch.cuda.empty_cache)
        step("empty_cache #2 (nothing cached)", torch.cuda.empty_cache)
        if name == "recached":
            again = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
            del again
            step("empty_cache #3 (one block cached again)", torch.cuda.empty_cache)
    elif name == "record_stream":
        side = torch.cuda.Stream()
        block = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        with torch.cuda.stream(side):
            torch.cuda._sleep(40_000_000)
            block.add_(1)
        block.record_stream(side)
        del block
        step("empty_cache with a block recorded on a busy side stream", torch.cuda.empty_cache)
    elif name == "oom_retry":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction((256 << 20) / total)
        cached = torch.empty(160 << 20, dtype=torch.uint8, device="cuda")
        del cached  # 160 MiB stays cached
        step("torch.empty(160 MiB, other size class) that needs the cached segment freed",
             lambda: torch.empty((160 << 20) + (2 << 20), dtype=torch.uint8, device="cuda"))
    elif name == "pinned":
        host = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
        del host
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if empty_host is None:
            print("  this torch has no torch._C._host_emptyCache: skipped")
        else:
            step("empty the pinned host cache", empty_host)
    cupti.unsubscribe(handle)


def main() -> int:
    if len(sys.argv) > 1:
        run_scenario(sys.argv[1])
        return 0
    status = 0
    for name in ("first", "recached", "expandable", "record_stream", "oom_retry", "pinned"):
        env = dict(os.environ)
        if name == "expandable":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        done = subprocess.run([sys.executable, __file__, name], env=env, timeout=120, text=True, capture_output=True)
        print(done.stdout, end="")
        if done.returncode:
            print(f"  scenario {name} failed ({done.returncode}):\n{done.stderr[-2000:]}")
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
