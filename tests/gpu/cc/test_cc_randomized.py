"""Bit-exact delivery under CC emulation: >= 10,000 randomized copies over every path."""

from __future__ import annotations

import random

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

DTYPES = ["float32", "float16", "bfloat16", "int32", "int64"]


def _bits(t):
    import torch

    t = t.contiguous()
    return t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def test_randomized_copies_are_bit_exact(emulated_cc, cycles_per_ms):
    import torch

    cc = emulated_cc
    rng = random.Random(20261130)
    torch.manual_seed(20261130)
    dev = torch.device("cuda", 0)
    current = torch.cuda.current_stream(dev)
    ref_stream = torch.cuda.Stream(dev)
    d2h = cc.new_d2h_stream(dev)
    mismatches = torch.zeros((), dtype=torch.int64, device=dev)
    short_sleep = max(cycles_per_ms // 20, 1000)  # ~50 us of queued work in front of a copy

    def dt(name):
        return getattr(torch, name)

    def host(shape, dtype, pinned=True):
        if dtype.is_floating_point:
            t = torch.randn(shape, dtype=torch.float32).to(dtype)
        else:
            t = torch.randint(-(2**30), 2**30, shape, dtype=dtype)
        return t.pin_memory() if pinned else t

    def upload_ref(h):
        # Reference path: a plain blocking copy on a side stream (the shim leaves blocking copies alone).
        with torch.cuda.stream(ref_stream):
            ref = h.to(dev)
        current.wait_stream(ref_stream)
        ref.record_stream(current)
        return ref

    def check(result, ref):
        nonlocal mismatches
        if result.dtype != ref.dtype or result.shape != ref.shape or result.device != dev:
            raise AssertionError(f"metadata differs: {result.dtype}/{tuple(result.shape)}/{result.device} "
                                 f"vs {ref.dtype}/{tuple(ref.shape)}/{dev}")
        mismatches += (_bits(result) != _bits(ref)).sum()

    # Registered in-place targets: a round-robin pool; before rewriting one we make sure its readers are done.
    pool = [torch.zeros(256, dtype=torch.float32, device=dev) for _ in range(4)]
    for buf in pool:
        cc.register_inplace_h2d_target(buf)
    pool_free = [None] * len(pool)
    targets = {
        "flat": torch.randn(512, device=dev),
        "grid": torch.randn(32, 48, device=dev),
        "half": torch.randn(300, device=dev).half(),
    }
    target_refs = {k: v.clone() for k, v in targets.items()}
    d2h_results = []  # (cpu tensor, expected gpu tensor)
    kinds = ["to", "to_kw", "cuda", "to_cast", "into", "into_view", "into_cast", "in_place",
             "d2h_to", "d2h_copy", "d2h_ordinary"]
    counts = dict.fromkeys(kinds, 0)
    n_ops = 10_000
    for step in range(n_ops):
        kind = kinds[step % len(kinds)] if step < len(kinds) else rng.choice(kinds)
        counts[kind] += 1
        dtype = dt(rng.choice(DTYPES))
        n = rng.randint(1, 2048)
        if kind in ("to", "to_kw", "cuda", "to_cast"):
            h = host((n,), dtype, pinned=rng.random() < 0.8)
            ref = upload_ref(h)
            if kind == "to":
                out = h.to(dev, non_blocking=True)
            elif kind == "to_kw":
                out = h.to(device="cuda", non_blocking=True)
            elif kind == "cuda":
                out = h.cuda(non_blocking=True)
            else:
                other = dt(rng.choice([d for d in DTYPES if d != str(dtype).split(".")[1]]))
                out = h.to(dev, dtype=other, non_blocking=True)
                ref = ref.to(other)
            check(out, ref)
        elif kind in ("into", "into_view", "into_cast"):
            name = "half" if kind == "into_cast" else rng.choice(["flat", "grid"])
            target, tref = targets[name], target_refs[name]
            if kind == "into_view" and name == "grid":
                c0 = rng.randint(0, 10)
                view, rview = target[:, c0::3], tref[:, c0::3]
            elif kind == "into_view":
                a = rng.randint(0, 400)
                view = target[a:a + rng.randint(1, 100)]
                rview = tref[a:a + view.shape[0]]
            else:
                view, rview = target, tref
            src_dtype = torch.float32 if kind != "into_cast" else rng.choice([torch.float32, torch.float64])
            h = host(tuple(view.shape), src_dtype)
            # A kernel still reads the target when the copy is issued: it must see the old contents.
            torch.cuda._sleep(short_sleep)
            snapshot = target.clone()
            old = tref.clone()
            view.copy_(h, non_blocking=True)
            check(snapshot, old)
            rview.copy_(upload_ref(h))
            check(target, tref)
        elif kind == "in_place":
            slot = step % len(pool)
            if pool_free[slot] is not None:
                pool_free[slot].synchronize()  # the caller's promise: no reader in flight
            buf = pool[slot]
            h = host((256,), torch.float32)
            if rng.random() < 0.5:
                buf.copy_(h, non_blocking=True)
                check(buf, upload_ref(h))
            else:
                k = rng.randint(1, 255)
                buf[:k].copy_(h[:k], non_blocking=True)
                check(buf[:k], upload_ref(h[:k]))
            done = torch.cuda.Event()
            done.record()
            pool_free[slot] = done
        else:
            # D2H: the source is produced behind queued work, then dropped by the caller at once.
            torch.cuda._sleep(short_sleep)
            src = (upload_ref(host((n,), torch.float32)) * 3).to(dtype)
            expected = src.clone()
            if kind == "d2h_ordinary":
                out = src.to("cpu", non_blocking=True)
            else:
                d2h.wait_stream(current)
                with torch.cuda.stream(d2h):
                    if kind == "d2h_to":
                        out = src.to("cpu", non_blocking=True)
                    else:
                        out = torch.full((n,), 7, dtype=dtype).pin_memory() if rng.random() < 0.7 else torch.full(
                            (n,), 7, dtype=dtype)
                        out.copy_(src, non_blocking=True)
            del src
            d2h_results.append((out, expected))
    torch.cuda.synchronize()
    bad_d2h = [i for i, (out, expected) in enumerate(d2h_results) if not torch.equal(_bits(out), _bits(expected.cpu()))]
    assert int(mismatches.item()) == 0
    assert bad_d2h == []
    stats = cc.stats()
    assert sum(counts.values()) >= 10_000
    assert min(counts.values()) > 100, counts
    # Every route ran often: staged, in place, inlined (small uploads) and offloaded (a small readback from an idle
    # D2H stream is torch's own copy, counted in left_alone["idle_stream"]).
    assert stats.staged > 3000 and stats.in_place > 500 and stats.inlined > 500 and stats.offloaded > 500, stats
    assert stats.left_alone.get("ordinary_stream", 0) >= counts["d2h_ordinary"]
    assert stats.emulated_waits > 0
