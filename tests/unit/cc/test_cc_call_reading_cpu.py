"""The readers the cc (and syncs) wrappers route by understand exactly the calls torch accepts.

torch is the oracle: a form is read (not None) exactly when torch's parser
accepts it, and what is read is what torch did with it. Any other form is
passed on untouched, so torch raises its own error.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from syncless._core.tensor_calls import read_copy, read_cuda
from syncless.cc import _sync_patches
from syncless.cc._worker import OrderedWorker

ASYNC = "async"


def _copy_forms(src):
    return [
        ((src,), {}), ((src, True), {}), ((src, False), {}), ((), {"other": src}),
        ((), {"other": src, "non_blocking": True}), ((src,), {"non_blocking": True}),
        ((src,), {ASYNC: True}), ((), {"other": src, ASYNC: False}),
        ((), {}), ((), {"non_blocking": True}), ((src, True, True), {}), ((src, 1), {}),
        ((src,), {"non_blocking": 1}), ((src,), {"other": src}), ((src, True), {"non_blocking": True}),
        ((src, True), {ASYNC: True}), ((src,), {"non_blocking": True, ASYNC: True}), ((), {"src": src}),
        ((src,), {"foo": 1}), ((3.0,), {}),
    ]


def _torch_accepts(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation of async=
        try:
            fn(*args, **kwargs)
        except TypeError:
            return False
        except (RuntimeError, AssertionError):  # parsed, then refused for the device (a CPU-only torch)
            return True
    return True


@pytest.mark.parametrize("deprecated_async", [False, True])
def test_read_copy_reads_exactly_what_torch_accepts(deprecated_async):
    src = torch.randn(4)
    for args, kwargs in _copy_forms(src):
        dst = torch.full((4,), float("nan"))
        accepted = _torch_accepts(dst.copy_, *args, **kwargs)
        read = read_copy(args, kwargs, deprecated_async=deprecated_async)
        if ASYNC in kwargs and not deprecated_async:
            assert read is None, (args, kwargs)
            continue
        assert (read is not None) == accepted, (args, kwargs, read, accepted)
        if read is not None:
            other, non_blocking = read
            given = args[1] if len(args) == 2 else kwargs.get("non_blocking", kwargs.get(ASYNC, False))
            assert other is (args[0] if args else kwargs["other"]) and non_blocking is given
            if isinstance(other, torch.Tensor):
                assert torch.equal(dst, other)


def _cuda_forms():
    return [
        ((), {}), ((0,), {}), (("cuda:0",), {}), ((None, True), {}), ((), {"non_blocking": True}),
        ((), {"device": 0, "non_blocking": True, "memory_format": torch.contiguous_format}),
        ((), {ASYNC: True}), ((0,), {ASYNC: True}), ((0, True), {ASYNC: True}),
        ((), {"non_blocking": True, ASYNC: True}), ((0, True, 1), {}), ((0,), {"device": 0}),
        ((), {"non_blocking": "x"}), ((0, 1), {}), ((), {"foo": 1}), ((0, True, torch.contiguous_format), {}),
    ]


@pytest.mark.parametrize("deprecated_async", [False, True])
def test_read_cuda_reads_exactly_what_torch_accepts(deprecated_async):
    # A CPU-only torch refuses every .cuda() call, but only a call its parser cannot read with a TypeError.
    x = torch.randn(4)
    for args, kwargs in _cuda_forms():
        accepted = _torch_accepts(x.cuda, *args, **kwargs)
        read = read_cuda(args, kwargs, deprecated_async=deprecated_async)
        if ASYNC in kwargs and not deprecated_async:
            assert read is None, (args, kwargs)
            continue
        assert (read is not None) == accepted, (args, kwargs, read, accepted)


class _FakeRecord:
    last_job = 5
    worker = OrderedWorker("test-reading")


def test_event_record_stamps_only_forms_torch_reads(monkeypatch):
    from syncless.cc import _d2h

    d2h = object()
    monkeypatch.setattr(_d2h, "_PENDING", [1])  # a copy is pending: every event recorded now covers it
    monkeypatch.setattr(_d2h, "_COVER", [((_FakeRecord.worker, 5),)])
    passed_on = []
    record = _sync_patches._wrap_event_record(lambda *args, **kwargs: passed_on.append((args, kwargs)))

    def an_event():
        # A CPU build's event class can be made bare; a CUDA build's C base refuses object.__new__.
        return torch.cuda.Event() if torch.version.cuda is not None else object.__new__(torch.cuda.Event)

    understood = [((d2h,), {}), ((), {"stream": d2h})]
    refused = [((d2h, None), {}), ((), {"stream": d2h, "extra": 1}), ((d2h,), {"stream": d2h})]
    for args, kwargs in understood + refused:
        event = an_event()
        record(event, *args, **kwargs)
        assert passed_on[-1] == ((event, *args), kwargs)  # untouched
        expected = ((_FakeRecord.worker, 5),) if (args, kwargs) in understood else None
        assert getattr(event, _sync_patches._MARK, None) == expected


def test_fake_and_functional_tensors_are_never_routed():
    """torch.compile runs the call on fake tensors outside dynamo's trace flag; routing them touched data pointers
    (on an H200: "Cannot access data pointer of Tensor (e.g. FakeTensor...)" from a compiled x.to('cuda', ...))."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from syncless.cc._layers import call_for_routing

    plain = torch.randn(4)
    assert call_for_routing((plain, "cuda"), {"non_blocking": True}) is not None
    with FakeTensorMode():
        fake = torch.empty(4)
    assert call_for_routing((fake, "cuda"), {"non_blocking": True}) is None
    assert call_for_routing((plain, fake), {"non_blocking": True}) is None  # copy_ from a fake source
    assert call_for_routing((plain,), {"other": fake}) is None
