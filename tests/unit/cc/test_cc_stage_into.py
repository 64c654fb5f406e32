"""When a staged ``copy_`` reads its host source: at the call, as torch's temporary does, or in stream order.

``stage_into`` is driven here with CPU tensors and a stand-in for the staging
transfer (``land``), which records what it was handed; the GPU fuzzer checks
the same rule against torch itself (seed 20267787 found the transposed case).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from syncless._core.layouts import same_dense_layout  # noqa: E402
from syncless.cc import _staging  # noqa: E402


@pytest.mark.parametrize(
    ("shape_a", "strides_a", "shape_b", "strides_b", "same"),
    [
        ((4, 8), (8, 1), (4, 8), (8, 1), True),  # both contiguous
        ((8, 4), (1, 8), (8, 4), (1, 8), True),  # both transposed: one dense block
        ((8, 4), (1, 8), (8, 4), (4, 1), False),  # transposed into contiguous
        ((4, 3), (8, 1), (4, 3), (8, 1), False),  # same strides, not dense (column slices)
        ((1, 8), (99, 1), (1, 8), (8, 1), True),  # a size-1 dim's stride does not matter
        ((4, 8), (8, 1), (8, 4), (4, 1), False),  # other shape
        ((4, 8), (0, 1), (4, 8), (0, 1), False),  # broadcast (overlapping)
    ],
)
def test_same_dense_layout(shape_a, strides_a, shape_b, strides_b, same):
    assert same_dense_layout(shape_a, strides_a, shape_b, strides_b) is same


@pytest.fixture
def landed(monkeypatch):
    """Replace the staging transfer by a clone; return the list of host tensors it was handed."""
    handed = []

    def fake_land(src, index, next_fn=None, **kwargs):
        handed.append(src)
        return src.clone()

    monkeypatch.setattr(_staging, "land", fake_land)
    return handed


def _shares_memory(a, b) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


CASES = {
    # name: (make dst, make src from a base host tensor, torch reads the source at the call)
    "contiguous": (lambda: torch.empty(6, 5), lambda h: h, False),
    "both transposed": (lambda: torch.empty(5, 6).t(), lambda h: h.t().contiguous().t(), False),
    "transposed into contiguous": (lambda: torch.empty(6, 5), lambda h: h.t().contiguous().t(), True),
    "column slice": (lambda: torch.empty(6, 3), lambda h: h[:, 1:4], True),
    "broadcast row": (lambda: torch.empty(6, 5), lambda h: h[:1], True),
    "cast, contiguous": (lambda: torch.empty(6, 5, dtype=torch.float64), lambda h: h, False),
    "cast, both transposed": (lambda: torch.empty(5, 6, dtype=torch.float64).t(),
                              lambda h: h.t().contiguous().t(), True),
    # torch's iterator drops a leading dim of size 1: one dense block (the review found the rule missed it)
    "both transposed, extra leading dim": (lambda: torch.empty(5, 6).t().unsqueeze(0),
                                           lambda h: h.t().contiguous().t(), False),
    "broadcast, extra leading dim": (lambda: torch.empty(4, 6, 5), lambda h: h, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_stage_into_reads_the_source_when_torch_would(landed, name):
    make_dst, make_src, reads_now = CASES[name]
    base = torch.randn(6, 5)
    src = make_src(base)
    dst = make_dst()
    expected = make_dst().copy_(src)
    assert _staging._torch_reads_source_now(dst, src) is reads_now

    def next_copy(d, s, non_blocking=False):
        return d.copy_(s)

    result = _staging.stage_into(dst, src, next_copy)
    assert result is dst
    assert torch.equal(dst, expected)
    (handed,) = landed
    # At the call: a snapshot of its own, already holding the values; in stream order: the source's own memory.
    # Either way only the source's own elements are staged (a broadcast happens in the D2D on the GPU).
    assert _shares_memory(handed, src) is not reads_now
    assert handed.is_contiguous() and handed.numel() == src.numel()


def test_stage_into_leaves_a_bad_shape_to_torch(landed):
    def next_copy(d, s, non_blocking=False):
        return d.copy_(s)

    with pytest.raises(RuntimeError) as ours:
        _staging.stage_into(torch.empty(4, 5), torch.randn(3, 5), next_copy)
    with pytest.raises(RuntimeError) as torchs:
        torch.empty(4, 5).copy_(torch.randn(3, 5))
    assert str(ours.value) == str(torchs.value)
    assert not landed


def test_stage_into_leaves_an_expanded_target_to_torch(landed):
    """torch refuses to write an expanded tensor before it reads anything; the shim stages nothing for it."""
    def next_copy(d, s, non_blocking=False):
        return d.copy_(s)

    with pytest.raises(RuntimeError) as ours:
        _staging.stage_into(torch.empty(1, 5).expand(4, 5), torch.randn(4, 5), next_copy)
    with pytest.raises(RuntimeError) as torchs:
        torch.empty(1, 5).expand(4, 5).copy_(torch.randn(4, 5))
    assert str(ours.value) == str(torchs.value)
    assert not landed


FRESH_CASES = {
    # name: (make src from a base host tensor, dtype, memory_format, torch reads the source at the call)
    "contiguous, cast": (lambda h: h, torch.float64, None, False),
    "transposed, cast": (lambda h: h.t(), torch.float64, None, True),  # the review's case: torch's temporary
    "transposed, to contiguous": (lambda h: h.t(), None, torch.contiguous_format, True),
    "channels_last, kept": (lambda h: h.reshape(1, 5, 3, 2).contiguous(memory_format=torch.channels_last), None,
                            torch.channels_last, False),  # one dense block, as it lies
    "channels_last, cast": (lambda h: h.reshape(1, 5, 3, 2).contiguous(memory_format=torch.channels_last),
                            torch.float16, torch.channels_last, True),
    "contiguous to channels_last": (lambda h: h.reshape(1, 5, 3, 2), None, torch.channels_last, False),
    "column slice, cast": (lambda h: h[:, 1:4], torch.float64, None, True),
}


@pytest.mark.parametrize("name", list(FRESH_CASES))
def test_a_fresh_converted_h2d_reads_the_source_when_torch_would(landed, name):
    """``src.to("cuda", dtype, memory_format=..., non_blocking=True)``: the result's layout and when src is read."""
    make_src, dtype, memory_format, reads_now = FRESH_CASES[name]
    base = torch.randn(6, 5)
    src = make_src(base)
    kwargs = {} if memory_format is None else {"memory_format": memory_format}
    # torch's own result of a copy to another device: its layout as _to_copy makes it (the meta device follows
    # the same rules; a same-device .to may return the source itself), its values.
    layout = src.to("meta", dtype or src.dtype, **kwargs)
    result = _staging.land_converted(src, 0, dtype, memory_format)
    assert len(landed) == 1
    assert _shares_memory(landed[0], src) is not reads_now
    assert result.dtype == layout.dtype and result.stride() == layout.stride()
    assert torch.equal(result, src.to(layout.dtype))
