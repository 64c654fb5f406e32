"""Probe: does the first offloaded D2H copy in a process block the host? Times each step of the test's sequence."""
import time, sys
import torch
import syncless.cc as cc

def cycles_per_ms():
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000); s.record(); torch.cuda._sleep(20_000_000); e.record(); e.synchronize()
    return int(20_000_000 / s.elapsed_time(e))

def once(tag, cpm, into):
    t = [time.perf_counter()]
    dev = torch.device("cuda", 0)
    d2h = cc.new_d2h_stream(dev); t.append(time.perf_counter())
    host = torch.randn(1 << 16); src = host.to(dev); t.append(time.perf_counter())
    torch.cuda._sleep(cpm * 300); doubled = src * 2
    done = torch.cuda.Event(); done.record(); t.append(time.perf_counter())
    d2h.wait_stream(torch.cuda.current_stream()); t.append(time.perf_counter())
    with torch.cuda.stream(d2h):
        if into is None:
            out = doubled.to("cpu", non_blocking=True)
        else:
            out = into; out.copy_(doubled, non_blocking=True)
    t.append(time.perf_counter())
    running = not done.query(); t.append(time.perf_counter())
    torch.cuda.synchronize(); ok = torch.equal(out, host * 2)
    steps = ["new_d2h_stream", "h2d", "sleep+record", "wait_stream", "copy call", "query"]
    print(tag, "running" if running else "PRODUCER DONE", "ok" if ok else "BAD",
          " ".join(f"{n}={1e3*(b-a):.2f}ms" for n, a, b in zip(steps, t, t[1:])), cc.stats(), flush=True)

cc.install("emulate")
cpm = cycles_per_ms()
for i in range(3):
    once(f"into#{i}", cpm, torch.full((1 << 16,), float("nan")).pin_memory())
    once(f"to#{i}", cpm, None)
cc.uninstall()
