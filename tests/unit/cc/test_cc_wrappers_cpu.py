"""The shim's and the emulator's ``copy_``/``cuda`` wrappers on a CPU-only torch: torch's call forms, as given."""

import warnings
from types import SimpleNamespace

import pytest
import torch

import syncless.cc as cc
from syncless._core import patching
from syncless.cc import _emulation, _shim

MODES = ["on", "emulate"]


@pytest.fixture(autouse=True)
def _clean():
    cc.reset_stats()
    yield
    cc.uninstall()


@pytest.fixture
def beneath():
    """A layer beneath the shim and the emulator (where the driver is) that records what reaches it."""
    calls = {"copy_": [], "cuda": []}

    def recorder(name):
        def wrap(next_fn):
            def record(self, *args, **kwargs):
                calls[name].append((args, kwargs))
                if name == "cuda":
                    return self  # a CPU-only torch cannot run .cuda(); what arrived is what is checked
                return next_fn(self, *args, **kwargs)

            return record

        return wrap

    for name in calls:
        patching.add_layer(torch.Tensor, name, "test.beneath", patching.RANK_CC_EMULATION - 1, recorder(name))
    yield calls
    for name in calls:
        patching.remove_layer(torch.Tensor, name, "test.beneath")


def _copy_meaning(args, kwargs):
    """What torch's copy_(other, non_blocking=False) would bind from a call."""
    def bind(other, non_blocking=False):
        return other, non_blocking

    return bind(*args, **kwargs)


def _cuda_meaning(args, kwargs):
    """What torch's cuda(device=None, non_blocking=False, *, memory_format=None) would bind from a call."""
    def bind(device=None, non_blocking=False, *, memory_format=None):
        return device, non_blocking, memory_format

    return bind(*args, **kwargs)


@pytest.fixture
def no_routing(monkeypatch):
    """Fail the test if the shim routes a call (it must not for a blocking one)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a blocking call went through the shim's routing")

    monkeypatch.setattr(_shim, "_decide", refuse)
    # is_compiling() may be asked (issue 33 item 1: before the pending count, which dynamo would guard on).


@pytest.mark.parametrize("mode", MODES)
def test_blocking_copy_forms_go_straight_beneath(mode, beneath, no_routing):
    cc.install(mode)
    src = torch.randn(32)
    forms = [
        lambda dst: dst.copy_(src),
        lambda dst: dst.copy_(src, False),
        lambda dst: dst.copy_(src, non_blocking=False),
        lambda dst: dst.copy_(other=src),
        lambda dst: dst.copy_(other=src, non_blocking=False),
    ]
    for form in forms:
        dst = torch.full((32,), float("nan"))
        assert form(dst) is dst
        assert torch.equal(dst, src)
    assert len(beneath["copy_"]) == len(forms)
    for args, kwargs in beneath["copy_"]:
        other, non_blocking = _copy_meaning(args, kwargs)
        assert other is src and non_blocking is False
    assert cc.stats().total_left_alone == 0


@pytest.mark.parametrize("mode", MODES)
def test_blocking_cuda_forms_go_straight_beneath(mode, beneath, no_routing):
    cc.install(mode)
    t = torch.randn(8)
    t.cuda()
    t.cuda(1)
    t.cuda(1, False)
    t.cuda(device=1, non_blocking=False, memory_format=torch.channels_last)
    meanings = [_cuda_meaning(args, kwargs) for args, kwargs in beneath["cuda"]]
    assert meanings == [(None, False, None), (1, False, None), (1, False, None),
                        (1, False, torch.channels_last)]


@pytest.mark.parametrize("mode", MODES)
def test_non_blocking_copy_forms_on_cpu_are_left_alone_and_copy(mode, beneath):
    cc.install(mode)
    src = torch.randn(16)
    forms = [
        lambda dst: dst.copy_(src, True),
        lambda dst: dst.copy_(src, non_blocking=True),
        lambda dst: dst.copy_(other=src, non_blocking=True),
    ]
    for form in forms:
        dst = torch.full((16,), float("nan"))
        assert form(dst) is dst
        assert torch.equal(dst, src)
    for args, kwargs in beneath["copy_"]:
        assert _copy_meaning(args, kwargs) == (src, True)
    assert cc.stats().left_alone == {"no_cuda": len(forms)}


@pytest.mark.parametrize("mode", MODES)
def test_deprecated_async_reaches_torch_as_given(mode, beneath):
    cc.install(mode)
    src = torch.randn(16)
    dst = torch.full((16,), float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "This overload of copy_ is deprecated"
        assert dst.copy_(src, **{"async": False}) is dst
        src.cuda(**{"async": False})
    assert torch.equal(dst, src)
    (copy_args, copy_kwargs), = beneath["copy_"]
    (cuda_args, cuda_kwargs), = beneath["cuda"]
    # non_blocking, left out by the caller, stays out: torch refuses it next to async.
    assert copy_args == (src,) and copy_kwargs == {"async": False}
    assert cuda_args == () and cuda_kwargs == {"async": False}


@pytest.mark.parametrize("mode", MODES)
def test_deprecated_async_after_a_positional_device_reaches_torch_as_given(mode, beneath, monkeypatch):
    waits = []
    # The emulator then blocks on the GPU's stream; the recorder beneath hands back the CPU tensor instead.
    monkeypatch.setattr(_emulation, "_emulate_wait", waits.append)
    cc.install(mode)
    t = torch.randn(8)
    assert t.cuda(0, **{"async": True}) is t
    (args, kwargs), = beneath["cuda"]
    # Nothing added: torch refuses non_blocking= next to async=, even non_blocking=False.
    assert args == (0,) and kwargs == {"async": True}
    assert len(waits) == (1 if mode == "emulate" else 0)  # async=True is a non-blocking call


BAD_COPY_CALLS = [
    ((torch.ones(4),), {"foo": 1}),
    ((), {"src": torch.ones(4)}),
    ((), {}),
    ((), {"non_blocking": True}),
    ((torch.ones(4), True, 1), {}),
    ((torch.ones(4), False), {"async": True}),
    ((torch.ones(4), 1), {}),  # torch takes only a bool for non_blocking
]
BAD_CUDA_CALLS = [
    ((), {"foo": 1}),
    ((0, False, torch.contiguous_format), {}),
    ((0, True, torch.contiguous_format), {}),
    ((), {"non_blocking": True, "async": True}),
    ((0, 1), {}),
    ((), {"non_blocking": 1}),
]


def _error_of(fn, *args, **kwargs):
    with pytest.raises(Exception) as info:  # noqa: PT011 - the type is what is compared
        fn(*args, **kwargs)
    return type(info.value), str(info.value)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("name", "args", "kwargs"), [("copy_", *c) for c in BAD_COPY_CALLS]
                         + [("cuda", *c) for c in BAD_CUDA_CALLS])
def test_bad_calls_get_torchs_own_error(mode, name, args, kwargs):
    dst = torch.zeros(4)
    expected = _error_of(getattr(torch.Tensor, name), dst, *args, **kwargs)
    cc.install(mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert _error_of(getattr(torch.Tensor, name), dst, *args, **kwargs) == expected
    assert expected[0] is TypeError


def test_wrappers_restore_on_uninstall():
    before = {name: torch.Tensor.__dict__.get(name) for name in ("copy_", "cuda")}
    cc.install("emulate")
    assert all(torch.Tensor.__dict__.get(name) is not fn for name, fn in before.items())
    cc.uninstall()
    assert all(torch.Tensor.__dict__.get(name) is fn for name, fn in before.items())


@pytest.mark.parametrize(("source", "dtype", "offloaded"), [
    ("channels_last", torch.float32, False),  # torch fills the non-contiguous pinned result on the host
    ("channels_last", None, True),            # same dtype and strides: one block, in stream order
    ("contiguous", torch.float32, True),      # a contiguous result: converted on the GPU, then one block
    ("transposed", torch.float32, False),
])
def test_a_to_whose_result_torch_fills_on_the_host_is_left_to_torch(monkeypatch, source, dtype, offloaded):
    """Issue 27 item 2: ``x.to("cpu", dtype, non_blocking=True)`` of a channels_last bf16 source. torch copies
    through a pageable contiguous temporary and fills the pinned result before returning; the shim offloaded it,
    so a read right after the call saw what the worker had not yet written."""
    from syncless.cc import _d2h, _routing

    cc.install("on")
    offloads = []
    monkeypatch.setattr(_shim, "_decide", lambda *a, **k: (_routing.OFFLOAD, "", object()))  # "on a D2H stream"
    monkeypatch.setattr(_d2h, "offload", lambda record, dst, src, verb, into_existing: offloads.append(dst) or 1)
    real_empty_strided = torch.empty_strided
    monkeypatch.setattr(torch, "empty_strided",
                        lambda *a, pin_memory=False, **k: real_empty_strided(*a, **k))  # no pinned memory here
    base = torch.randn(2, 3, 4, 5).to(torch.bfloat16)
    x = {"channels_last": base.contiguous(memory_format=torch.channels_last), "contiguous": base,
         "transposed": base[0, 0].t()}[source]
    kwargs = {} if dtype is None else {"dtype": dtype}
    result = x.to("cpu", non_blocking=True, **kwargs)
    assert bool(offloads) is offloaded
    if not offloaded:
        assert torch.equal(result, x.to(dtype or x.dtype)) and result.stride() == x.to("meta", **kwargs).stride()
        assert cc.stats().left_alone.get("noncontiguous_target") == 1


def test_a_quantized_tensors_d2h_is_left_to_torch(monkeypatch):
    """Issue 27 item 6: a quantized CUDA tensor's ``.to("cpu", non_blocking=True)`` on a D2H stream was offloaded,
    and the pinned ``empty_strided`` of a quantized dtype fails. It is torch's own copy now (reason ``layout``)."""
    from syncless.cc import _routing, _streams

    monkeypatch.setattr(_streams, "any_current_capture", lambda index: False)
    monkeypatch.setattr(_shim, "_d2h_record", lambda src: object())  # "issued on a D2H stream"
    q = torch.quantize_per_tensor(torch.randn(8), 0.1, 0, torch.qint8)
    route, reason, _ = _shim._decide(q, "cpu", 0, into_existing=False, registered=False, dtype_changes=False,
                                     autograd=False, src_type="cuda")
    assert (route, reason) == (_routing.ORIGINAL, "layout")
    plain = torch.randn(8)
    assert _shim._decide(plain, "cpu", 0, into_existing=False, registered=False, dtype_changes=False,
                         autograd=False, src_type="cuda")[0] == _routing.OFFLOAD


def test_a_plain_d2h_is_noted_while_another_thread_captures(monkeypatch):
    """Review: while any thread captured a graph, another thread's real non_blocking D2H into ``h`` went unnoted,
    so a staged H2D of ``h`` after the capture was not ordered after it. Only this thread's capture makes the copy
    a graph node."""
    from syncless.cc import _host_writes, _streams

    noted = []
    monkeypatch.setattr(_host_writes, "note_plain_d2h", lambda dst, stream: noted.append(dst))
    monkeypatch.setattr(_streams, "current_stream", lambda index: "S")
    monkeypatch.setattr(_streams, "CAPTURES", [1])  # a graph is capturing, on some other thread
    monkeypatch.setattr(_streams, "is_current_stream_capturing", lambda index: False)
    src = SimpleNamespace(device=SimpleNamespace(index=0))
    h = torch.empty(4)
    _shim._note_plain_d2h(h, src)
    assert noted == [h]
    monkeypatch.setattr(_streams, "is_current_stream_capturing", lambda index: True)  # this thread's own capture
    _shim._note_plain_d2h(torch.empty(4), src)
    assert noted == [h]


def test_compiled_code_compiles_once_while_the_pending_count_changes(monkeypatch):
    """Issue 33 item 1: the bypass and syncing wrappers read the pending count before ``is_compiling()``; dynamo
    guarded on it and recompiled the frame at every change, up to its limit, then ran it eagerly. Asked first, the
    count is never read while tracing: one compile for any count."""
    from torch._dynamo.testing import CompileCounter

    from syncless.cc import _d2h

    cc.install("on")
    try:
        counter = CompileCounter()

        def step(x, y):
            a = torch.as_tensor(x)              # the bypass layer (settles D2H streams while a copy is pending)
            torch.Tensor.copy_(y, x)            # unbound copy_
            y[0] = x[1]                         # __setitem__
            return a + y.cpu() + x.to("cpu")   # a syncing read, a blocking .to

        torch._dynamo.reset()
        compiled = torch.compile(step, backend=counter, fullgraph=True)
        x, y = torch.randn(4), torch.zeros(4)
        for pending in (0, 1, 2, 5, 0, 3):
            monkeypatch.setattr(_d2h, "_PENDING", [pending])
            expected = step(x.clone(), y.clone()) if pending == 0 else None
            got = compiled(x, y)
            if expected is not None:
                assert torch.equal(got, expected)
        assert counter.frame_count == 1, f"compiled {counter.frame_count} times"
    finally:
        cc.uninstall()
        torch._dynamo.reset()
