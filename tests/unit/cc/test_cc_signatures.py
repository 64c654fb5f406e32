"""cc's wrappers keep torch's calling conventions: torch alone is the oracle for every call form.

Each form of the syncs signature grid (``tests/unit/syncs/signature_grid.py``)
runs on fresh random tensors (one seed, printed on failure) under plain
torch, then with ``cc.install("on")``, with ``cc.install("emulate")``, and
with the hidden-sync detector enabled as well, installed before and after
cc (record mode, inside a checked region). Results, aliasing, the inputs
afterwards, exceptions (type and message), warnings and what
``__torch_function__`` overrides see must all be the same.

The conftest pretends a GPU, so ``install()`` patches on this CPU build and
the wrappers run on CPU tensors; the CUDA forms must raise torch's own "not
compiled with CUDA" error.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import syncless.cc as cc
from syncless import syncs
from syncless._core import patching
from syncless.syncs import _debugmode
from torch.overrides import TorchFunctionMode
from support.call_forms import cc_configurations, cc_installed, cc_patched_attributes
from support.call_forms import seed  # noqa: F401 - a fixture
from unit.syncs.signature_grid import Form, LoggingTensor, cpu_forms, difference, make_env, outcome, plain_outcome


class LoggingMode(TorchFunctionMode):
    """A ``__torch_function__`` mode that logs what it sees (into the grid's log), then runs the call."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        LoggingTensor.log.append(("mode", name, tuple(sorted(kwargs)), func is getattr(torch.Tensor, name, None)))
        return func(*args, **kwargs)


def _under_mode(call):
    def run(env):
        with LoggingMode():
            return call(env)

    return run



def _cc_forms() -> list[Form]:
    """Forms of what cc wraps beyond the syncs grid: the event and stream methods, and ``torch.Event``."""
    ev, st = torch.cuda.Event, torch.cuda.Stream
    forms = [
        Form("torch.cuda.Event() (CPU build: refused)", lambda e: ev()),
        Form("torch.cuda.Event.record() refused", lambda e: ev.record()),
        Form("torch.cuda.Event.record(None, None, None) refused", lambda e: ev.record(None, None, None)),
        Form("torch.cuda.Event.record(stream=None) refused", lambda e: ev.record(stream=None)),
        Form("torch.cuda.Event.wait() refused", lambda e: ev.wait()),
        Form("torch.cuda.Event.wait(1, stream=2) refused", lambda e: ev.wait(1, stream=2)),
        Form("torch.cuda.Event.query() refused", lambda e: ev.query()),
        Form("torch.cuda.Event.query(None, 1) refused", lambda e: ev.query(None, 1)),
        Form("torch.cuda.Event.synchronize(x, timeout=1) refused", lambda e: ev.synchronize(e.x, timeout=1)),
        Form("torch.cuda.Stream() (CPU build: refused)", lambda e: st().device),  # a new stream's address differs
        Form("torch.cuda.Stream.query() refused", lambda e: st.query()),
        Form("torch.cuda.Stream.query(self=None) refused", lambda e: st.query(self=None)),
        Form("torch.cuda.Stream.synchronize(1, 2) refused", lambda e: st.synchronize(1, 2)),
        Form("torch.cuda.CUDAGraph.capture_begin(None) refused", lambda e: torch.cuda.CUDAGraph.capture_begin(None)),
        Form("torch.cuda.CUDAGraph.capture_end(None) refused", lambda e: torch.cuda.CUDAGraph.capture_end(None)),
        Form("torch.Event('cpu')", lambda e: torch.Event("cpu")),
        Form("torch.Event(device='cpu', enable_timing=True)", lambda e: torch.Event(device="cpu", enable_timing=True)),
        Form("torch.Event(foo=1) refused", lambda e: torch.Event(foo=1)),
        Form("torch.Event('cpu').query()", lambda e: torch.Event("cpu").query()),
        Form("torch.Event('cpu').synchronize()", lambda e: torch.Event("cpu").synchronize()),
        Form("torch.Event('cpu').wait()", lambda e: torch.Event("cpu").wait()),
        Form("torch.Event('cpu').record() refused (backend)", lambda e: torch.Event("cpu").record()),
        Form("torch.Event('cpu').record(stream=None) refused (backend)",
             lambda e: torch.Event("cpu").record(stream=None)),
        Form("torch.Event('cpu').record(1, 2) refused", lambda e: torch.Event("cpu").record(1, 2)),
        Form("torch.Event('cpu').wait(foo=1) refused", lambda e: torch.Event("cpu").wait(foo=1)),
        Form("torch.Event('cpu').query(1) refused", lambda e: torch.Event("cpu").query(1)),
        Form("torch.Event('cpu').synchronize(1) refused", lambda e: torch.Event("cpu").synchronize(1)),
        Form("torch.Event.record() refused", lambda e: torch.Event.record()),
        Form("torch.Event.query(None) refused", lambda e: torch.Event.query(None)),
        Form("torch.Event.synchronize(x) refused", lambda e: torch.Event.synchronize(e.x)),
        Form("type(torch.Event('cpu')) names", lambda e: (type(torch.Event("cpu")).__name__,
                                                         type(torch.Event("cpu")).__qualname__,
                                                         type(torch.Event("cpu")).__module__)),
        Form("torch.Event.record names", lambda e: (torch.Event.record.__name__, torch.Event.query.__doc__)),
    ]
    forms += [  # host-blocking reads cc fronts (they wait for a D2H stream's offloaded copies)
        Form("x.cpu()", lambda e: e.x.cpu()),
        Form("x.cpu(memory_format=torch.contiguous_format)", lambda e: e.x.cpu(memory_format=torch.contiguous_format)),
        Form("x.cpu(1) refused", lambda e: e.x.cpu(1)),
        Form("torch.Tensor.cpu(x)", lambda e: torch.Tensor.cpu(e.x)),
        Form("torch.Tensor.cpu() refused", lambda e: torch.Tensor.cpu()),
        Form("x[0].item()", lambda e: e.x.reshape(-1)[0].item()),
        Form("x.item() refused (many elements)", lambda e: e.x.item()),
        Form("x.item(1) refused", lambda e: e.x.item(1)),
        Form("torch.Tensor.item(1) refused", lambda e: torch.Tensor.item(1)),
        Form("x.tolist()", lambda e: e.x.tolist()),
        Form("x.tolist(foo=1) refused", lambda e: e.x.tolist(foo=1)),
        Form("sub.tolist() (a subclass)", lambda e: e.sub.tolist()),
        Form("sub.cpu() (a subclass)", lambda e: e.sub.cpu()),
    ]
    forms += [  # copies that bypass Tensor.to/cuda/copy_, which cc fronts to order them after offloaded copies
        Form("dst.__setitem__(slice(0, 2), y[:2])", lambda e: (e.dst.__setitem__(slice(0, 2), e.y[:2]), e.dst)[1]),
        Form("dst[1] = 2.5 (__setitem__ syntax)", lambda e: (e.dst.__setitem__(1, 2.5), e.dst)[1]),
        Form("dst.__setitem__(0, yc[0]) (warns: complex to real)",
             lambda e: (e.dst.__setitem__(0, e.yc[0]), e.dst)[1]),
        Form("sub_dst.__setitem__(0, y[0]) (a subclass)", lambda e: (e.sub_dst.__setitem__(0, e.y[0]), e.sub_dst)[1]),
        Form("dst.__setitem__(0, 'a') refused", lambda e: e.dst.__setitem__(0, "a")),
        Form("dst.__setitem__(0) refused", lambda e: e.dst.__setitem__(0)),
        Form("x.new_tensor([1, 2])", lambda e: e.x.new_tensor([1, 2])),
        Form("x.new_tensor(y) (warns: copy construct)", lambda e: e.x.new_tensor(e.y)),
        Form("x.new_tensor(y, dtype=float16, device='cpu')",
             lambda e: e.x.new_tensor(e.y, dtype=torch.float16, device="cpu")),
        Form("x.new_tensor() refused", lambda e: e.x.new_tensor()),
        Form("torch.as_tensor([1.5, 2])", lambda e: torch.as_tensor([1.5, 2])),
        Form("torch.as_tensor(x, dtype=float16, device='cpu')",
             lambda e: torch.as_tensor(e.x, dtype=torch.float16, device="cpu")),
        Form("torch.as_tensor(sub) (a subclass)", lambda e: torch.as_tensor(e.sub)),
        Form("torch.as_tensor(x, device='cuda') (CPU build: refused)", lambda e: torch.as_tensor(e.x, device="cuda")),
        Form("torch.as_tensor() refused", lambda e: torch.as_tensor()),
        Form("torch.asarray([1.5, 2])", lambda e: torch.asarray([1.5, 2])),
        Form("torch.asarray(x, dtype=float16, device='cpu', copy=True)",
             lambda e: torch.asarray(e.x, dtype=torch.float16, device="cpu", copy=True)),
        Form("torch.asarray(sub) (a subclass)", lambda e: torch.asarray(e.sub)),
        Form("torch.asarray(x, device='cuda') (CPU build: refused)", lambda e: torch.asarray(e.x, device="cuda")),
        Form("torch.asarray() refused", lambda e: torch.asarray()),
        Form("UntypedStorage.copy_(dst storage, y storage)",
             lambda e: (torch.UntypedStorage.copy_(e.dst.untyped_storage(), e.y.untyped_storage()), e.dst)[1]),
        Form("dst.untyped_storage().copy_(y.untyped_storage(), non_blocking=True) (UntypedStorage.copy_()",
             lambda e: (e.dst.untyped_storage().copy_(e.y.untyped_storage(), non_blocking=True), e.dst)[1]),
        Form("UntypedStorage.copy_(dst storage, row storage) refused (sizes)",
             lambda e: e.dst.untyped_storage().copy_(e.row.untyped_storage())),
    ]
    mode_forms = [
        Form("x.cpu()", lambda e: e.x.cpu()),
        Form("x[0].item()", lambda e: e.x.reshape(-1)[0].item()),
        Form("x.tolist()", lambda e: e.x.tolist()),
        Form("x.to(float16)", lambda e: e.x.to(torch.float16)),
        Form("x.to('cpu', non_blocking=True)", lambda e: e.x.to("cpu", non_blocking=True)),
        Form("x.to('cuda', non_blocking=True)", lambda e: e.x.to("cuda", non_blocking=True)),
        Form("x.cuda(non_blocking=True)", lambda e: e.x.cuda(non_blocking=True)),
        Form("dst.copy_(y, True)", lambda e: e.dst.copy_(e.y, True)),
        Form("dst.copy_(other=sub, non_blocking=True)", lambda e: e.dst.copy_(other=e.sub, non_blocking=True)),
        Form("dst.copy_(y, non_blocking=1) refused", lambda e: e.dst.copy_(e.y, non_blocking=1)),
    ]
    forms += [Form(f"under a mode: {f.label}", _under_mode(f.call)) for f in mode_forms]
    return forms


FORMS = cpu_forms() + _cc_forms()


@pytest.fixture
def clean_torch():
    """torch warns every time; afterwards every attribute is torch's own again and nothing is installed."""
    originals = [(owner, name, getattr(owner, name)) for owner, name in cc_patched_attributes()]
    before = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    mode_before = syncs.mode()
    yield
    torch.set_warn_always(before)
    cc.uninstall()
    syncs.disable()
    syncs.reset()
    syncs.set_mode(mode_before)
    for owner, name, original in originals:
        assert getattr(owner, name) is original, f"{owner}.{name} was not restored"


@contextlib.contextmanager
def _syncs():
    with _debugmode.fake():
        syncs.set_mode("record")
        syncs.reset()
        assert syncs.enable()
        try:
            yield
        finally:
            syncs.disable()


CONFIGURATIONS = cc_configurations(_syncs)


@pytest.mark.parametrize("form", FORMS, ids=[f.label for f in FORMS])
def test_call_form_behaves_as_in_torch(form: Form, seed: int, clean_torch):
    plain = plain_outcome(form, seed)
    problems = []
    for label, configuration in CONFIGURATIONS.items():
        with configuration():
            region = syncs.checking if "syncs" in label else contextlib.nullcontext
            problem = difference(form, plain, outcome(form, make_env(seed), region=region))
        if problem:
            problems.append(f"[{label}] {problem}")
    assert not problems, f"seed {seed}\n" + "\n".join(problems)


def test_the_grid_covers_every_callable_cc_wraps(clean_torch):
    with cc_installed("emulate"):
        wrapped = [(chain.owner, chain.name) for chain in patching._chains.values()
                   if set(chain.layers) & {"cc.shim", "cc.emulation"}]
    assert set(wrapped) == set(cc_patched_attributes())
    labels = " ".join(f.label for f in FORMS)
    for owner, name in wrapped:
        written = f".{name}(" if owner is torch.Tensor else f"{owner.__name__.rsplit('.', 1)[-1]}.{name}("
        assert written in labels, f"no call form of {owner.__name__}.{name} in the signature grid"


@pytest.mark.parametrize("mode", ["on", "emulate"])
def test_a_call_an_override_takes_is_routed_once_inside_it(mode, clean_torch):
    # Transparency must not cost the routing: the override's call back into torch is read and routed, once.
    env = make_env(1)
    calls = [
        lambda: env.sub_dst.copy_(env.y, True),
        lambda: env.dst.copy_(env.sub, non_blocking=True),
        lambda: env.sub.to("cpu", non_blocking=True),
        lambda: env.plain_sub.to("cpu", non_blocking=True),
        _under_mode(lambda e: e.dst.copy_(e.y, True)),
    ]
    with cc_installed(mode):
        cc.reset_stats()
        for number, call in enumerate(calls, 1):
            call() if number < len(calls) else call(env)
            assert cc.stats().left_alone == {"no_cuda": number}, f"call {number}"
