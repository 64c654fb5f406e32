"""A grid of call forms of every callable ``syncs.enable()`` wraps, and how to compare two runs of one.

torch is the oracle: each form runs on fresh tensors made from one seed, once
with the detector off and once with it on (outside and inside a checked
region), and :func:`outcome` describes what happened (the result's type,
dtype, device, layout, values and aliasing; the inputs' values afterwards;
the exception's type and message; every warning's category and message; what
``__torch_function__`` overrides saw). The two descriptions must be equal.

Used by ``test_syncs_signatures.py`` (CPU) and by
``tests/gpu/syncs/test_syncs_signatures_gpu.py`` (GPU forms added).
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class LoggingTensor(torch.Tensor):
    """A subclass whose ``__torch_function__`` logs what it is called with, then defers to torch."""

    log: list = []

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        # What such an override sees: the function's name, the types, the keyword names, and whether func is
        # torch.Tensor's attribute of that name as it is at call time (tables built then still match).
        name = getattr(func, "__name__", repr(func))
        current = getattr(torch.Tensor, name, None)
        cls.log.append((name, tuple(t.__name__ for t in types_), tuple(sorted(kwargs)), func is current))
        return super().__torch_function__(func, types_, args, kwargs)


class PlainSubclass(torch.Tensor):
    """A subclass with torch's default ``__torch_function__`` (results come back as this type)."""


def make_env(seed: int, device: str = "cpu") -> types.SimpleNamespace:
    """Fresh random tensors from ``seed``; outputs are poisoned (NaN) first."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype).to(device)

    env = types.SimpleNamespace(device=device)
    env.x = rand(3, 4)
    env.y = rand(3, 4)
    env.yh = rand(3, 4, dtype=torch.float16)
    env.yc = rand(3, 4, dtype=torch.complex64)
    env.row = rand(1, 4)
    env.bad = rand(4, 3)
    env.img = rand(2, 3, 4, 5)
    env.dst = torch.full((3, 4), float("nan"), device=device)
    env.dst_t = torch.full((4, 3), float("nan"), device=device).t()
    env.leaf = rand(3, 4).requires_grad_()
    env.sub = rand(3, 4).as_subclass(LoggingTensor)
    env.sub_dst = torch.full((3, 4), float("nan"), device=device).as_subclass(LoggingTensor)
    env.plain_sub = rand(3, 4).as_subclass(PlainSubclass)
    LoggingTensor.log = []
    return env


def _tensor_names(env: types.SimpleNamespace) -> list[str]:
    return [name for name, value in vars(env).items() if isinstance(value, torch.Tensor)]


@dataclass(frozen=True)
class Form:
    """One way of calling a wrapped callable: ``call(env)`` makes the call and returns its result."""

    label: str
    call: Callable[[types.SimpleNamespace], Any]


def _forms_to() -> list[Form]:
    f16, f32, f64 = torch.float16, torch.float32, torch.float64
    return [
        Form("x.to(float16)", lambda e: e.x.to(f16)),
        Form("x.to(float32) returns self", lambda e: e.x.to(f32)),
        Form("x.to(float32, copy=True)", lambda e: e.x.to(f32, copy=True)),
        Form("x.to(dtype=float16)", lambda e: e.x.to(dtype=f16)),
        Form("x.to('cpu')", lambda e: e.x.to("cpu")),
        Form("x.to(torch.device('cpu'))", lambda e: e.x.to(torch.device("cpu"))),
        Form("x.to('cpu', float16)", lambda e: e.x.to("cpu", f16)),
        Form("x.to('cpu', float16, True)", lambda e: e.x.to("cpu", f16, True)),
        Form("x.to('cpu', float16, False, True)", lambda e: e.x.to("cpu", f16, False, True)),
        Form("x.to('cpu', None, True, True)", lambda e: e.x.to("cpu", None, True, True)),
        Form("x.to(float16, True, True)", lambda e: e.x.to(f16, True, True)),
        Form("x.to(float16, non_blocking=True)", lambda e: e.x.to(f16, non_blocking=True)),
        Form("x.to(yh)", lambda e: e.x.to(e.yh)),
        Form("x.to(yh, True)", lambda e: e.x.to(e.yh, True)),
        Form("x.to(yh, True, True)", lambda e: e.x.to(e.yh, True, True)),
        Form("x.to(yh, non_blocking=True, copy=True)", lambda e: e.x.to(e.yh, non_blocking=True, copy=True)),
        Form("x.to(y) same dtype returns self", lambda e: e.x.to(e.y)),
        Form("x.to(all keywords)", lambda e: e.x.to(device="cpu", dtype=f64, non_blocking=True, copy=True,
                                                    memory_format=torch.preserve_format)),
        Form("img.to(memory_format=channels_last)", lambda e: e.img.to(memory_format=torch.channels_last)),
        Form("img.to('cpu', non_blocking=True, memory_format=channels_last)",
             lambda e: e.img.to("cpu", non_blocking=True, memory_format=torch.channels_last)),
        Form("x.to(memory_format=channels_last) refused (rank)", lambda e: e.x.to(memory_format=torch.channels_last)),
        Form("x.to()", lambda e: e.x.to()),
        Form("x.to(None)", lambda e: e.x.to(None)),
        Form("x.to(non_blocking=True)", lambda e: e.x.to(non_blocking=True)),
        Form("x.to('meta', non_blocking=True)", lambda e: e.x.to("meta", non_blocking=True)),
        Form("x.to('cuda')", lambda e: e.x.to("cuda")),
        Form("x.to('cuda', non_blocking=True)", lambda e: e.x.to("cuda", non_blocking=True)),
        Form("x.to('cuda:0', float16, True)", lambda e: e.x.to("cuda:0", f16, True)),
        Form("x.to(0, non_blocking=True)", lambda e: e.x.to(0, non_blocking=True)),
        Form("x.to(other=yh) refused", lambda e: e.x.to(other=e.yh)),
        Form("x.to('bogus', non_blocking=True) refused", lambda e: e.x.to("bogus", non_blocking=True)),
        Form("x.to(float16, non_blocking='yes') refused", lambda e: e.x.to(f16, non_blocking="yes")),
        Form("x.to('cuda', non_blocking=1) refused", lambda e: e.x.to("cuda", non_blocking=1)),
        Form("x.to(float16, async=True) refused", lambda e: e.x.to(f16, **{"async": True})),
        Form("x.to(5 positional) refused", lambda e: e.x.to("cpu", f16, True, True, None)),
        Form("x.to('cuda', True, True) refused", lambda e: e.x.to("cuda", True, True)),
        Form("x.to(float16, dtype=float32) refused", lambda e: e.x.to(f16, dtype=f32)),
        Form("Tensor.to(x, 'cpu', float64)", lambda e: torch.Tensor.to(e.x, "cpu", f64)),
        Form("Tensor.to() refused", lambda e: torch.Tensor.to()),
        Form("Tensor.to(5, 'cpu') refused", lambda e: torch.Tensor.to(5, "cpu")),
        Form("Tensor.to(self=x) refused", lambda e: torch.Tensor.to(self=e.x)),
        Form("leaf.to(float64) keeps autograd", lambda e: e.leaf.to(f64)),
        Form("sub.to(float16)", lambda e: e.sub.to(f16)),
        Form("sub.to('cuda', non_blocking=True)", lambda e: e.sub.to("cuda", non_blocking=True)),
        Form("sub.to(device='cpu', non_blocking=True, copy=True)",
             lambda e: e.sub.to(device="cpu", non_blocking=True, copy=True)),
        Form("plain_sub.to(float64)", lambda e: e.plain_sub.to(f64)),
        Form("x.to(sub)", lambda e: e.x.to(e.sub)),
        # A lazy module's parameters let through only the methods torch lists (by identity) in
        # UninitializedTensorMixin._allowed_methods; func is the attribute as it is at call time.
        Form("LazyLinear(3).to(float64)", lambda e: str(torch.nn.LazyLinear(3).to(f64).weight.dtype)),
        Form("UninitializedParameter().to(float64)",
             lambda e: str(torch.nn.UninitializedParameter().to(f64).dtype)),
        Form("Tensor.to(UninitializedParameter(), 'cpu', non_blocking=True)",
             lambda e: type(torch.Tensor.to(torch.nn.UninitializedParameter(), "cpu", non_blocking=True)).__name__),
    ]


def _forms_cuda() -> list[Form]:
    return [
        Form("x.cuda()", lambda e: e.x.cuda()),
        Form("x.cuda(0)", lambda e: e.x.cuda(0)),
        Form("x.cuda('cuda:0')", lambda e: e.x.cuda("cuda:0")),
        Form("x.cuda(torch.device('cuda', 0), True)", lambda e: e.x.cuda(torch.device("cuda", 0), True)),
        Form("x.cuda(None, True)", lambda e: e.x.cuda(None, True)),
        Form("x.cuda(non_blocking=True)", lambda e: e.x.cuda(non_blocking=True)),
        Form("x.cuda(device=0, non_blocking=True, memory_format=contiguous)",
             lambda e: e.x.cuda(device=0, non_blocking=True, memory_format=torch.contiguous_format)),
        Form("img.cuda(non_blocking=True, memory_format=channels_last)",
             lambda e: e.img.cuda(non_blocking=True, memory_format=torch.channels_last)),
        Form("x.cuda(async=True)", lambda e: e.x.cuda(**{"async": True})),
        Form("x.cuda('cpu', True) refused", lambda e: e.x.cuda("cpu", True)),
        Form("x.cuda(0, True, 1) refused", lambda e: e.x.cuda(0, True, 1)),
        Form("x.cuda(0, device=0) refused", lambda e: e.x.cuda(0, device=0)),
        Form("x.cuda(non_blocking='x') refused", lambda e: e.x.cuda(non_blocking="x")),
        Form("x.cuda(foo=1) refused", lambda e: e.x.cuda(foo=1)),
        Form("x.cuda(memory_format=channels_last, non_blocking=True) refused (rank)",
             lambda e: e.x.cuda(memory_format=torch.channels_last, non_blocking=True)),
        Form("Tensor.cuda() refused", lambda e: torch.Tensor.cuda()),
        Form("Tensor.cuda(x, None, True)", lambda e: torch.Tensor.cuda(e.x, None, True)),
        Form("sub.cuda(non_blocking=True)", lambda e: e.sub.cuda(non_blocking=True)),
        Form("UninitializedParameter().cuda(non_blocking=True)",
             lambda e: str(torch.nn.UninitializedParameter().cuda(non_blocking=True).device)),
        Form("LazyLinear(3).cuda()", lambda e: str(torch.nn.LazyLinear(3).cuda().weight.device)),
    ]


def _forms_copy() -> list[Form]:
    return [
        Form("dst.copy_(y)", lambda e: e.dst.copy_(e.y)),
        Form("dst.copy_(y, True)", lambda e: e.dst.copy_(e.y, True)),
        Form("dst.copy_(y, False)", lambda e: e.dst.copy_(e.y, False)),
        Form("dst.copy_(other=y)", lambda e: e.dst.copy_(other=e.y)),
        Form("dst.copy_(other=y, non_blocking=True)", lambda e: e.dst.copy_(other=e.y, non_blocking=True)),
        Form("dst.copy_(y, non_blocking=True)", lambda e: e.dst.copy_(e.y, non_blocking=True)),
        Form("dst.copy_(non_blocking=True, other=y)", lambda e: e.dst.copy_(non_blocking=True, other=e.y)),
        Form("dst.copy_(y, async=True) deprecated", lambda e: e.dst.copy_(e.y, **{"async": True})),
        Form("dst.copy_(yh) converts", lambda e: e.dst.copy_(e.yh, non_blocking=True)),
        Form("dst.copy_(yc) warns", lambda e: e.dst.copy_(e.yc)),
        Form("dst.copy_(row) broadcasts", lambda e: e.dst.copy_(e.row, True)),
        Form("dst_t.copy_(y) strided target", lambda e: e.dst_t.copy_(e.y, non_blocking=True)),
        Form("dst.copy_(3.0) scalar", lambda e: e.dst.copy_(3.0)),
        Form("Tensor.copy_(dst, y, True)", lambda e: torch.Tensor.copy_(e.dst, e.y, True)),
        Form("dst.copy_(bad, True) refused (shape)", lambda e: e.dst.copy_(e.bad, True)),
        Form("leaf.copy_(y) refused (leaf)", lambda e: e.leaf.copy_(e.y, non_blocking=True)),
        Form("dst.copy_(src=y) refused", lambda e: e.dst.copy_(src=e.y)),
        Form("dst.copy_() refused", lambda e: e.dst.copy_()),
        Form("dst.copy_(y, True, True) refused", lambda e: e.dst.copy_(e.y, True, True)),
        Form("dst.copy_(y, non_blocking=1) refused", lambda e: e.dst.copy_(e.y, non_blocking=1)),
        Form("dst.copy_(y, other=y) refused", lambda e: e.dst.copy_(e.y, other=e.y)),
        Form("dst.copy_(y, True, non_blocking=True) refused", lambda e: e.dst.copy_(e.y, True, non_blocking=True)),
        Form("Tensor.copy_() refused", lambda e: torch.Tensor.copy_()),
        Form("Tensor.copy_(1, y) refused", lambda e: torch.Tensor.copy_(1, e.y)),
        Form("sub_dst.copy_(y, True)", lambda e: e.sub_dst.copy_(e.y, True)),
        Form("dst.copy_(sub, non_blocking=True)", lambda e: e.dst.copy_(e.sub, non_blocking=True)),
        Form("dst.copy_(plain_sub)", lambda e: e.dst.copy_(e.plain_sub)),
        Form("UninitializedParameter().copy_(y) refused (leaf)",
             lambda e: torch.nn.UninitializedParameter().copy_(e.y, non_blocking=True)),
        Form("UninitializedBuffer().copy_(y)", lambda e: torch.nn.UninitializedBuffer().copy_(e.y)),
    ]


def _forms_waits() -> list[Form]:
    forms = [
        Form("torch.cuda.synchronize()", lambda e: torch.cuda.synchronize()),
        Form("torch.cuda.synchronize(0)", lambda e: torch.cuda.synchronize(0)),
        Form("torch.cuda.synchronize(device=0)", lambda e: torch.cuda.synchronize(device=0)),
        Form("torch.cuda.synchronize('cuda:0')", lambda e: torch.cuda.synchronize("cuda:0")),
        Form("torch.cuda.synchronize(1, 2) refused", lambda e: torch.cuda.synchronize(1, 2)),
        Form("torch.cuda.synchronize(dev=0) refused", lambda e: torch.cuda.synchronize(dev=0)),
        Form("torch.cuda.Stream.synchronize() refused", lambda e: torch.cuda.Stream.synchronize()),
        Form("torch.cuda.Event.synchronize() refused", lambda e: torch.cuda.Event.synchronize()),
        Form("torch.cuda.Event.synchronize(None) refused", lambda e: torch.cuda.Event.synchronize(None)),
    ]
    if hasattr(getattr(torch, "accelerator", None), "synchronize"):
        forms += [
            Form("torch.accelerator.synchronize()", lambda e: torch.accelerator.synchronize()),
            Form("torch.accelerator.synchronize(0)", lambda e: torch.accelerator.synchronize(0)),
            Form("torch.accelerator.synchronize(device=None)", lambda e: torch.accelerator.synchronize(device=None)),
            Form("torch.accelerator.synchronize('cpu') refused", lambda e: torch.accelerator.synchronize("cpu")),
            Form("torch.accelerator.synchronize(x=1) refused", lambda e: torch.accelerator.synchronize(x=1)),
        ]
    return forms


def cpu_forms() -> list[Form]:
    """Every form, each callable's in turn; on a CPU build the CUDA ones raise torch's own error."""
    return _forms_to() + _forms_cuda() + _forms_copy() + _forms_waits()


def _describe_value(value: Any, env: types.SimpleNamespace) -> Any:
    if isinstance(value, torch.Tensor):
        names = _tensor_names(env)
        aliases = tuple(name for name in names if value is getattr(env, name))
        facts: dict[str, Any] = {
            "type": type(value).__name__,
            "dtype": value.dtype,
            "device": value.device,
            "shape": tuple(value.shape),
            "stride": tuple(value.stride()),
            "requires_grad": value.requires_grad,
            "grad_fn": type(value.grad_fn).__name__ if value.grad_fn is not None else None,
            "is": aliases,
        }
        if value.device.type != "meta":
            plain = value.detach().as_subclass(torch.Tensor)
            facts["pinned"] = plain.is_pinned() if plain.device.type == "cpu" else None
            facts["shares_storage_with"] = tuple(
                name for name in names
                if getattr(env, name).device == plain.device
                and getattr(env, name).untyped_storage().data_ptr() == plain.untyped_storage().data_ptr())
            facts["values"] = plain.cpu().contiguous().view(torch.uint8).numpy().tobytes()
        return facts
    if isinstance(value, (tuple, list)):
        return type(value).__name__, tuple(_describe_value(v, env) for v in value)
    return repr(value)


def plain_outcome(form: Form, seed: int, settle: Callable[[], Any] = contextlib.nullcontext) -> dict[str, Any]:
    """torch alone, the oracle: the form's outcome on a fresh env, after one run to warm it up.

    CPython 3.12 specializes ``super().name`` after a function's first run,
    and an unbound call (``torch.cuda.Event.synchronize(None)``) then raises
    ``TypeError`` where the first run raised ``AttributeError``. The runs with
    syncless come later, so torch is compared warm too.
    """
    outcome(form, make_env(seed), settle=settle)
    return outcome(form, make_env(seed), settle=settle)


def outcome(form: Form, env: types.SimpleNamespace, settle: Callable[[], Any] = contextlib.nullcontext,
            region: Callable[[], Any] = contextlib.nullcontext) -> dict[str, Any]:
    """Run ``form`` on ``env`` and describe everything a caller could observe.

    Args:
        settle: a context manager factory the description runs in, after the
            call. On a GPU it waits for the call's work and lets the reads of
            the results through (``syncs.allowed``), so they are neither racy
            nor reported.
        region: a context manager factory the call runs in (``syncs.checking``
            for a checked run). It is entered inside the block that records
            warnings, as pytest's per-test block encloses a user's region, so
            the detector's warnings hook is in front while the call runs.
    """
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            with region():
                returned = form.call(env)
        except Exception as err:  # noqa: BLE001 - the outcome under test is whatever torch raises
            result: Any = ("raised", type(err), str(err))
            torch_function_log = list(LoggingTensor.log)
        else:
            torch_function_log = list(LoggingTensor.log)  # before the description below adds its own calls
            with settle():
                result = ("returned", _describe_value(returned, env))
    with settle():
        inputs_after = {name: _describe_value(getattr(env, name), env)["values"]
                        for name in _tensor_names(env) if getattr(env, name).device.type != "meta"}
    ours = ("called a synchronizing CUDA operation", "hidden GPU sync")
    return {
        "result": result,
        # Warnings torch issues inside a wrapped call are attributed to the wrapper's line, so only their
        # category and text are compared (docs/syncs.md, "Calling conventions"). The detector's own are not torch's.
        "warnings": [(w.category, str(w.message)) for w in seen if not str(w.message).startswith(ours)],
        "inputs_after": inputs_after,
        "torch_function_log": torch_function_log,
    }


def difference(form: Form, expected: dict[str, Any], got: dict[str, Any]) -> str | None:
    """None when equal, else a message naming the form and the first field that differs."""
    for key in expected:
        if expected[key] != got[key]:
            return f"{form.label}: {key} differs\n  torch alone:   {expected[key]!r}\n  with syncless: {got[key]!r}"
    return None
