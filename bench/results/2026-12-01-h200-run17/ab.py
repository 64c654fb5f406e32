"""A/B: one process, per-sample interleaving of plain and the shim under emulated CC, queued and idle."""
import statistics, sys, time, torch
import syncless.cc as cc
from syncless.bench._cc import _cycles_per_ms
dev = torch.device("cuda", 0); torch.cuda.set_device(dev)
cc.uninstall(); cyc = _cycles_per_ms(torch)
host = torch.randn(1 << 18).pin_memory()
rows = {(s, q): [] for s in ("plain", "emulate", "on") for q in (True, False)}
def enter(s):
    cc.uninstall()
    if s != "plain": cc.install(s)
for s in ("plain", "emulate", "on"):
    enter(s); host.to(dev, non_blocking=True); torch.cuda.synchronize()
for i in range(30):
    for (s, q) in rows:
        enter(s)
        torch.cuda.synchronize(dev)
        if q: torch.cuda._sleep(int(cyc * 20))
        t0 = time.perf_counter(); out = host.to(dev, non_blocking=True); dt = (time.perf_counter() - t0) * 1e6
        torch.cuda.synchronize(dev); del out
        rows[(s, q)].append(dt)
cc.uninstall()
med = {k: statistics.median(v) for k, v in rows.items()}
print(sys.argv[1], " ".join(f"{s}/{'q' if q else 'i'}={med[(s, q)]:.1f}" for (s, q) in rows),
      f"ratio_q={med[('emulate', True)] / med[('plain', True)]:.2f} ratio_i={med[('emulate', False)] / med[('plain', False)]:.2f}")
