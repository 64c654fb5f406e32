"""Probe: the Python frames at a sync inside a compiled graph (default mode and reduce-overhead), and what
syncless's report makes of them. Run: PYTHONPATH=src python3 tests/gpu/syncs/probe_compiled_item_stack.py"""

import sys
import warnings

import torch

from syncless.syncs import _report

torch._dynamo.config.capture_scalar_outputs = True


def scale(x):
    return x * x.sum().item()


for mode in ("default", "reduce-overhead"):
    torch._dynamo.reset()
    compiled = torch.compile(scale, fullgraph=True, dynamic=False, mode=mode)
    x = torch.randn(16, device="cuda")
    for _ in range(3):
        compiled(x)
    seen = []

    def show(message, category, filename, lineno, file=None, line=None):
        frame = sys._getframe(1)
        stack = []
        walk = frame
        while walk is not None:
            stack.append(f"{walk.f_code.co_filename.split('site-packages/')[-1]}:{walk.f_lineno} {walk.f_code.co_name}")
            walk = walk.f_back
        user, compile_time = _report._user_frame(frame)
        seen.append((str(message)[:60], stack, user and f"{user.f_code.co_filename}:{user.f_lineno}", compile_time,
                     _report.is_under_compile(frame)))

    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        compiled(x)
    torch.cuda.set_sync_debug_mode(0)
    print(f"== mode {mode}: {len(seen)} sync warning(s)")
    for message, stack, user, compile_time, under in seen:
        print(f"  {message!r}: user frame {user}, compile_time={compile_time}, is_under_compile={under}")
        for row in stack[:24]:
            print("     ", row)
