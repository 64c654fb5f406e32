"""Routing decisions as a pure function."""

import pytest

from syncless.cc import _routing as r

MAX = 1000


def facts(src="cpu", dst="cuda", **kw):
    kw.setdefault("non_blocking", True)
    return r.CopyFacts(src_type=src, dst_type=dst, **kw)


@pytest.mark.parametrize(
    ("f", "expected"),
    [
        (facts(nbytes=10), (r.STAGE_FRESH, "")),
        (facts(nbytes=10, into_existing=True), (r.STAGE_INTO, "")),
        (facts(nbytes=10, into_existing=True, registered_target=True), (r.IN_PLACE, "")),
        (facts(nbytes=10, into_existing=True, registered_target=True, dtype_changes=True), (r.STAGE_INTO, "")),
        (facts(nbytes=10, dtype_changes=True), (r.STAGE_FRESH, "")),
        (facts(non_blocking=False), (r.ORIGINAL, "blocking")),
        (facts(src="cpu", dst="cpu"), (r.ORIGINAL, "no_cuda")),
        (facts(src="cuda", dst="cuda"), (r.ORIGINAL, "device_to_device")),
        (facts(src="meta", dst="cuda"), (r.ORIGINAL, "other_device")),
        (facts(src="cuda", dst="meta", on_d2h_stream=True), (r.ORIGINAL, "other_device")),  # not a host copy
        (facts(compiling=True), (r.ORIGINAL, "compiling")),
        (facts(compiling=True, non_blocking=False), (r.ORIGINAL, "compiling")),
        (facts(capturing=True), (r.ORIGINAL, "capturing")),
        (facts(src="cuda", dst="cpu", capturing=True, on_d2h_stream=True), (r.ORIGINAL, "capturing")),
        (facts(strided=False), (r.ORIGINAL, "layout")),
        (facts(src="cuda", dst="cpu"), (r.ORIGINAL, "ordinary_stream")),
        (facts(src="cuda", dst="cpu", on_d2h_stream=True), (r.OFFLOAD, "")),
        (facts(src="cuda", dst="cpu", on_d2h_stream=True, autograd=True), (r.ORIGINAL, "autograd")),
        (facts(src="cuda", dst="cpu", on_d2h_stream=True, nbytes=MAX), (r.OFFLOAD, "")),
        # The snapshot an offload makes on the GPU is bounded like a staged H2D.
        (facts(src="cuda", dst="cpu", on_d2h_stream=True, nbytes=MAX + 1), (r.ORIGINAL, "too_large")),
        (facts(src="cuda", dst="cpu", on_d2h_stream=True, inference_target=True), (r.ORIGINAL, "inference_target")),
        (facts(src="cuda", dst="cpu", on_d2h_stream=True, complex_to_real=True), (r.ORIGINAL, "complex_to_real")),
    ],
)
def test_route(f, expected):
    assert r.route_copy(f, MAX) == expected


def test_size_bound_is_inclusive():
    assert r.route_copy(facts(nbytes=MAX), MAX) == (r.STAGE_FRESH, "")
    assert r.route_copy(facts(nbytes=MAX + 1), MAX) == (r.ORIGINAL, "too_large")
    assert r.route_copy(facts(nbytes=MAX + 1, into_existing=True), MAX) == (r.ORIGINAL, "too_large")


def test_registered_target_ignores_size_bound():
    big = facts(nbytes=MAX * 50, into_existing=True, registered_target=True)
    assert r.route_copy(big, MAX) == (r.IN_PLACE, "")


def test_every_reason_is_a_known_stats_reason():
    from syncless.cc._stats import LEFT_ALONE_REASONS

    seen = set()
    for f in [facts(non_blocking=False), facts(src="cpu", dst="cpu"), facts(src="cuda"), facts(src="meta"),
              facts(compiling=True), facts(capturing=True), facts(strided=False), facts(nbytes=MAX + 1),
              facts(src="cuda", dst="cpu"), facts(src="cuda", dst="cpu", on_d2h_stream=True, autograd=True),
              facts(src="cuda", dst="cpu", on_d2h_stream=True, inference_target=True),
              facts(src="cuda", dst="cpu", on_d2h_stream=True, complex_to_real=True)]:
        route, reason = r.route_copy(f, MAX)
        assert route == r.ORIGINAL
        seen.add(reason)
    assert seen <= set(LEFT_ALONE_REASONS)
    assert len(seen) == 12


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("cpu", "cuda", True, False, False), True),
        (("cuda", "cpu", True, False, False), True),
        (("cuda", "cpu", False, False, False), False),
        (("cuda", "cuda", True, False, False), False),
        (("cpu", "cpu", True, False, False), False),
        (("cpu", "cuda", True, True, False), False),
        (("cpu", "cuda", True, False, True), False),
    ],
)
def test_needs_emulated_wait(args, expected):
    assert r.needs_emulated_wait(*args) is expected



def test_d2h_into_pageable_memory_stays_torchs_copy():
    """torch's non_blocking D2H into pageable memory is synchronous; offloading it would let the host read early."""
    from syncless.cc import _routing as r

    on_d2h = r.CopyFacts(src_type="cuda", dst_type="cpu", non_blocking=True, into_existing=True, on_d2h_stream=True)
    assert r.route_copy(on_d2h, 1 << 20) == (r.OFFLOAD, "")
    pageable = r.CopyFacts(src_type="cuda", dst_type="cpu", non_blocking=True, into_existing=True, on_d2h_stream=True,
                           pageable_target=True)
    assert r.route_copy(pageable, 1 << 20) == (r.ORIGINAL, "pageable_target")


def test_d2h_into_a_non_contiguous_host_tensor_stays_torchs_copy():
    """torch writes a non-contiguous host target on the host before it returns; offloaded, it would come later."""
    from syncless.cc import _routing as r

    strided = r.CopyFacts(src_type="cuda", dst_type="cpu", non_blocking=True, into_existing=True, on_d2h_stream=True,
                          noncontiguous_target=True)
    assert r.route_copy(strided, 1 << 20) == (r.ORIGINAL, "noncontiguous_target")
