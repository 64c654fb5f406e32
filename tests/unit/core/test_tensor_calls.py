"""Parsing of ``Tensor.to`` calls shared by syncs and cc."""

import pytest
import torch

from syncless._core.tensor_calls import maybe_non_blocking_to, parse_to


@pytest.mark.parametrize(
    ("args", "kwargs", "maybe"),
    [
        (("cuda",), {}, False),
        (("cuda",), {"non_blocking": True}, True),
        (("cuda",), {"non_blocking": False}, False),
        (("cuda", None, True), {}, True),
        (("float16", True), {}, True),
        (("cuda", None, False), {}, False),
        ((), {"device": "cuda"}, False),
    ],
)
def test_maybe_non_blocking_to(args, kwargs, maybe):
    assert maybe_non_blocking_to(args, kwargs) is maybe


def test_parse_to_reads_calls_like_torch_and_ignores_copy():
    assert parse_to(("cpu",), {"non_blocking": True}) == (torch.device("cpu"), None, True, None)
    assert parse_to(("cpu",), {"non_blocking": True, "copy": True}) == (torch.device("cpu"), None, True, None)
    assert parse_to((torch.float16,), {}) == (None, torch.float16, False, None)
    with pytest.raises(TypeError):
        parse_to(("cpu",), {"nonsense": 1})


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("cpu", torch.float16, True, True), (torch.device("cpu"), torch.float16, True, None)),
        (("cpu", None, False, True), (torch.device("cpu"), None, False, None)),
        ((torch.float16, True, True), (None, torch.float16, True, None)),
        (("cpu", torch.float16, True), (torch.device("cpu"), torch.float16, True, None)),  # no copy here
    ],
)
def test_parse_to_leaves_out_a_positional_copy(args, expected):
    # torch accepts copy in its position (to(device, dtype, non_blocking, copy), to(dtype, non_blocking, copy),
    # to(other, non_blocking, copy)); its parser refuses it. cc's emulation parses after the call succeeded.
    assert parse_to(args, {}) == expected
    x = torch.randn(2)
    assert x.to(*args).dtype == (expected[1] or x.dtype)  # torch itself takes the form


def test_parse_to_reads_the_other_tensor_form_with_positional_copy():
    other = torch.randn(2, dtype=torch.float64)
    assert parse_to((other, True, True), {}) == (torch.device("cpu"), torch.float64, True, None)


def test_cc_emulation_takes_a_positional_copy_like_torch(monkeypatch):
    # The emulator parses a .to() call after torch ran it; a positional copy used to make it raise there.
    import syncless.cc as cc

    monkeypatch.setattr(cc, "_cuda_available", lambda: True)  # install() patches nothing without CUDA

    x = torch.randn(3)
    expected = x.to("cpu", None, True, True)
    assert cc.install("emulate")
    try:
        got = x.to("cpu", None, True, True)
    finally:
        cc.uninstall()
    assert got is not x and torch.equal(got, expected)


class _Traced(torch.Tensor):
    """A tensor subclass with a ``__torch_function__`` override of its own."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class _TensorLike:
    """An object with ``__torch_function__`` that is not a tensor: torch's parser takes it in a tensor's place."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return "override-result"


def test_has_override_answers_like_torchs_own_check_for_tensor_methods():
    """The tensor-by-tensor check (a hot path) agrees with torch's whole-call check wherever a tensor leads."""
    from torch.overrides import TorchFunctionMode

    from syncless._core.tensor_calls import has_override

    plain, sub = torch.zeros(2), torch.zeros(2).as_subclass(_Traced)
    calls = [
        ((plain, "cpu"), {"non_blocking": True}, False),
        ((plain, plain), {}, False),
        ((plain,), {"other": plain, "non_blocking": True}, False),
        ((sub, "cpu"), {}, True),
        ((plain, sub), {}, True),
        ((plain,), {"other": sub}, True),
        ((plain, torch.float16, True), {}, False),
        ((plain, torch.device("cpu"), torch.float16), {"memory_format": torch.channels_last}, False),
        ((plain, _TensorLike()), {"non_blocking": True}, True),  # found in review: a tensor-only check missed it
        ((plain,), {"other": _TensorLike(), "non_blocking": True}, True),
        ((plain, [1, 2]), {}, False),
    ]
    for args, kwargs, expected in calls:
        whole = torch._C._has_torch_function(args) or torch._C._has_torch_function(tuple(kwargs.values()))
        assert has_override(args, kwargs) is expected == whole, (args, kwargs)
    with TorchFunctionMode():
        assert has_override((plain, "cpu"), {})
    # Inside an override's own call back into torch (subclass overrides off) and with every override off:
    # the same answers as torch's check, modes included.
    for switched_off in (torch._C.DisableTorchFunctionSubclass, torch._C.DisableTorchFunction):
        for mode_on in (False, True):
            with switched_off():
                mode = TorchFunctionMode() if mode_on else None
                if mode is not None:
                    mode.__enter__()
                try:
                    for args, kwargs, _ in calls:
                        whole = torch._C._has_torch_function(args) or torch._C._has_torch_function(
                            tuple(kwargs.values()))
                        assert has_override(args, kwargs) == whole, (switched_off, mode_on, args, kwargs)
                finally:
                    if mode is not None:
                        mode.__exit__(None, None, None)
    # A non-tensor first argument: torch's own check of the whole call.
    assert has_override((_TensorLike(), plain), {})
    assert not has_override((1, plain), {})
    # torch hands such a call to the tensor-like's override, as it does without syncless.
    assert plain.to(_TensorLike(), non_blocking=True) == "override-result"
