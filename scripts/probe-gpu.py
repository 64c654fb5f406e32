"""Probe facts about the GPU machine that syncless relies on (run there, prints a report)."""

import json
import sys
import warnings

import torch

print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
from cuda.bindings import driver  # noqa: E402

import cuda.bindings  # noqa: E402

print("cuda.bindings", getattr(cuda.bindings, "__version__", "?"))
print("has set_sync_debug_mode:", hasattr(torch._C, "_cuda_set_sync_debug_mode"))

dev = torch.device("cuda", 0)
x = torch.randn(64, device=dev)
mask = x > 0
pinned = torch.randn(64).pin_memory()
pageable = torch.randn(64)
ops = {
    "item": lambda: x[0].item(),
    "tolist": lambda: x.tolist(),
    "bool": lambda: bool(x[0] > 0),
    "nonzero": lambda: x.nonzero(),
    "mask_index": lambda: x[mask],
    "masked_select": lambda: torch.masked_select(x, mask),
    "unique": lambda: torch.unique(x),
    "repeat_interleave": lambda: torch.repeat_interleave(torch.ones(4, dtype=torch.long, device=dev)),
    "cuda_synchronize": lambda: torch.cuda.synchronize(),
    "event_synchronize": lambda: torch.cuda.Event().synchronize(),
    "stream_synchronize": lambda: torch.cuda.current_stream().synchronize(),
    "cpu": lambda: x.cpu(),
    "to_cpu_nb": lambda: x.to("cpu", non_blocking=True),
    "numpy": lambda: x.cpu().numpy(),
    "copy_to_pageable_nb": lambda: pageable.copy_(x, non_blocking=True),
    "copy_to_pinned_nb": lambda: pinned.copy_(x, non_blocking=True),
    "h2d_pageable_nb": lambda: pageable.to(dev, non_blocking=True),
    "h2d_pinned_nb": lambda: pinned.to(dev, non_blocking=True),
    "h2d_blocking": lambda: pageable.to(dev),
    "any": lambda: x.any().item(),
    "max_item": lambda: int(x.argmax()),
    "float": lambda: float(x.sum()),
    "multinomial": lambda: torch.multinomial(x.abs() + 0.1, 2),
    "topk": lambda: torch.topk(x, 3),
    "sort": lambda: torch.sort(x),
    "clamp_tensor_max": lambda: x.clamp(max=0.5),
    "where_3": lambda: torch.where(mask, x, 0.0),
    "index_put_bool": lambda: x.clone().__setitem__(mask, 0.0),
    "equal": lambda: torch.equal(x, x),
    "allclose": lambda: torch.allclose(x, x),
    "stream_query": lambda: torch.cuda.current_stream().query(),
    "event_query": lambda: torch.cuda.Event().query(),
    "bincount": lambda: torch.bincount(torch.arange(4, device=dev)),
    "histc": lambda: torch.histc(x),
    "cumsum": lambda: torch.cumsum(x, 0),
    "cat": lambda: torch.cat([x, x]),
    "index_select": lambda: x.index_select(0, torch.arange(3, device=dev)),
    "nonzero_static": lambda: torch.nonzero_static(x, size=4) if hasattr(torch, "nonzero_static") else None,
}
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("warn")
results = {}
for name, op in ops.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            op()
            err = None
        except Exception as e:  # a probe: record any failure
            err = repr(e)
    texts = [str(w.message).splitlines()[0][:100] for w in caught]
    results[name] = {"warned": bool(texts), "texts": texts[:2], "error": err}
torch.cuda.set_sync_debug_mode(0)
for k, v in results.items():
    print(f"{k:22s} warned={v['warned']!s:5s} {v['texts'][:1]} {v['error'] or ''}")

# stream mem ops and IPC signatures
for name in ["cuStreamWaitValue64", "cuStreamWriteValue64", "cuIpcGetMemHandle", "cuIpcOpenMemHandle", "cuMemcpyAsync", "cuDeviceGetName", "cuDeviceGetPCIBusId"]:
    doc = (getattr(driver, name).__doc__ or "").strip().splitlines()
    print(name, doc[:1])
print(driver.cuInit(0))
print("name", driver.cuDeviceGetName(256, driver.cuDeviceGet(0)[1]))
print("bus", driver.cuDeviceGetPCIBusId(64, driver.cuDeviceGet(0)[1]))
# torch stream handle type
print("stream handle", type(torch.cuda.current_stream().cuda_stream), torch.cuda.current_stream().cuda_stream)
# nvml cc
import pynvml  # noqa: E402
pynvml.nvmlInit()
try:
    st = pynvml.nvmlSystemGetConfComputeState()
    print("cc state", st.environment, st.ccFeature, st.devToolsMode)
except Exception as e:  # probe
    print("cc state error", repr(e))
try:
    s = pynvml.nvmlSystemGetConfComputeSettings()
    print("cc settings", {k: getattr(s, k) for k in dir(s) if not k.startswith("_")})
except Exception as e:  # probe
    print("cc settings error", repr(e))
n = pynvml.nvmlDeviceGetCount()
for i in range(n):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    print("nvml", i, pynvml.nvmlDeviceGetPciInfo(h).busId)
    for j in range(n):
        if i != j:
            hj = pynvml.nvmlDeviceGetHandleByIndex(j)
            print("  p2p nvlink", i, j, pynvml.nvmlDeviceGetP2PStatus(h, hj, pynvml.NVML_P2P_CAPS_INDEX_NVLINK))
    try:
        print("  link0 remote type", pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(h, 0))
    except Exception as e:  # probe
        print("  remote type err", repr(e))
