"""Inside a checked region, calls the checks cannot read safely pass to torch unread.

functorch transforms (vmap, grad), a TorchDispatchMode, nested and sparse
tensors: reading such a call (``is_pinned()``, sizes, strides) would change
what torch does or fail where torch does not. torch alone is the oracle:
each call runs plainly first, then inside a checked region; the outcome
(result or exception type and message, and what a dispatch mode saw) must
be the same, and nothing is reported.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from syncless import syncs
from support.call_forms import seed  # noqa: F401 - a fixture


class OpLog(TorchDispatchMode):
    """Records every aten op that reaches the dispatcher."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _run(call):
    """What the call gave: ("value", result) or ("raised", type, message)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's one-time prototype notices (nested tensors)
        try:
            return ("value", call())
        except Exception as err:  # noqa: BLE001 - the outcome under test is whatever torch raises
            return ("raised", type(err), str(err))


def _read(ran):
    """A comparable outcome; reading a CUDA result synchronizes, so it runs outside any region."""
    if ran[0] == "raised":
        return ran
    result = ran[1]
    if isinstance(result, torch.Tensor):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plain = result.to_padded_tensor(0.0) if result.is_nested else result
            plain = plain.to_dense() if plain.layout is not torch.strided else plain
            return ("returned", plain.dtype, tuple(plain.shape), plain.tolist())
    return ("returned", result)


def _nested(gen):
    return torch.nested.nested_tensor([torch.randn(2, 3, generator=gen), torch.randn(4, 3, generator=gen)])


def _logged(call):
    def run():
        log = OpLog()
        with log:
            try:
                call()
            except Exception as err:  # noqa: BLE001 - part of what the mode saw
                return log.ops, type(err), str(err)
        return log.ops

    return run


def _calls(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, generator=gen)
    a, b = _nested(gen), _nested(gen)
    sparse_src = torch.randn(3, 3, generator=gen).to_sparse()
    return {
        "vmap to(cuda, non_blocking)": lambda: torch.vmap(lambda t: t.to("cuda", non_blocking=True))(x),
        "vmap cuda(non_blocking)": lambda: torch.vmap(lambda t: t.cuda(non_blocking=True))(x),
        "vmap copy_(non_blocking)": lambda: torch.vmap(lambda t: torch.zeros(3).copy_(t, non_blocking=True))(x),
        "grad to(cuda, non_blocking)": lambda: torch.func.grad(lambda t: t.to("cuda", non_blocking=True).sum())(x[0]),
        "grad to(float64, non_blocking)": lambda: torch.func.grad(
            lambda t: t.to(torch.float64, non_blocking=True).sum())(x[0]),
        "nested copy_(non_blocking)": lambda: a.copy_(b, non_blocking=True),
        "nested to(cuda, non_blocking)": lambda: a.to("cuda", non_blocking=True),
        "sparse copy_(non_blocking)": lambda: torch.zeros(3, 3).to_sparse().copy_(sparse_src, non_blocking=True),
        "dispatch mode sees to(cuda, non_blocking)": _logged(lambda: x.to("cuda", non_blocking=True)),
        "dispatch mode sees cuda(non_blocking)": _logged(lambda: x.cuda(non_blocking=True)),
        "dispatch mode sees copy_(non_blocking)": _logged(lambda: torch.zeros(4, 3).copy_(x, non_blocking=True)),
    }


LABELS = list(_calls(0))


@pytest.mark.parametrize("label", LABELS)
def test_an_unreadable_call_behaves_as_in_torch_in_a_region(label, seed, fake_mode):
    syncs.disable()
    plain = _read(_run(_calls(seed)[label]))
    assert syncs.enable()
    call = _calls(seed)[label]
    with syncs.checking():
        ran = _run(call)
    assert _read(ran) == plain, f"seed {seed}"
    found = syncs.report()
    if torch.cuda.is_available() and "cuda" in label:
        # With a GPU, a non_blocking copy from pageable memory really blocks the host: that, and only
        # that, may be reported (by CUPTI or torch, which see the copy whatever wraps the tensor).
        assert all(site.first.kind == "blocking copy" for site in found.sites), found.format()
    else:
        assert not found, found.format()
