"""On a real GPU: every call form of the wrapped callables behaves as in torch alone.

The CPU grid (``tests/unit/syncs/signature_grid.py``) runs on CUDA tensors,
plus forms that cross between pinned/pageable host memory and the GPU, the
waits on real streams and events, and ``torch.compile`` (inductor). Each runs
with the detector off, enabled outside a checked region, inside one (record)
and inside one in error mode, where only a call recorded as a violation may
raise SyncViolation instead. Results are read after the call's work is done
(``torch.cuda.synchronize`` inside ``syncs.allowed()``).
"""

from __future__ import annotations

import types

import pytest
import torch

from syncless import syncs
from syncless.syncs import SyncViolation
from support.call_forms import seed  # noqa: F401 - a fixture
from support.detector import detector_put_back
from unit.syncs.signature_grid import Form, cpu_forms, difference, make_env, outcome


def gpu_env(seed: int) -> types.SimpleNamespace:
    """The CPU grid's tensors on the GPU, host tensors pinned and pageable, a stream and an event."""
    env = make_env(seed, "cuda")
    gen = torch.Generator().manual_seed(seed + 1)
    env.h = torch.randn(3, 4, generator=gen)  # pageable
    env.p = torch.randn(3, 4, generator=gen).pin_memory()
    env.p_t = torch.randn(4, 3, generator=gen).pin_memory().t()  # pinned, dense, not contiguous
    env.p_img = torch.randn(2, 3, 4, 5, generator=gen).pin_memory()
    env.hd = torch.full((3, 4), float("nan"))
    env.pd = torch.full((3, 4), float("nan")).pin_memory()
    env.gd = torch.full((3, 4), float("nan"), device="cuda")
    env.stream = torch.cuda.Stream()
    env.event = torch.cuda.Event()
    env.event.record()
    torch.cuda.synchronize()
    return env


def _gpu_forms() -> list[Form]:
    f16 = torch.float16
    dev = torch.device("cuda", 0)
    return [
        Form("p.to('cuda', non_blocking=True)", lambda e: e.p.to("cuda", non_blocking=True)),
        Form("p.to('cuda:0', float16, True)", lambda e: e.p.to("cuda:0", f16, True)),
        Form("p.to(dev, None, True, True)", lambda e: e.p.to(dev, None, True, True)),
        Form("p.to(x)", lambda e: e.p.to(e.x)),
        Form("p.to(x, True)", lambda e: e.p.to(e.x, True)),
        Form("p.to(yh, non_blocking=True, copy=True)", lambda e: e.p.to(e.yh, non_blocking=True, copy=True)),
        Form("p_t.to('cuda', non_blocking=True) keeps layout", lambda e: e.p_t.to("cuda", non_blocking=True)),
        Form("p_t.to(all keywords, contiguous)", lambda e: e.p_t.to(device=dev, dtype=f16, non_blocking=True, copy=True,
                                                                  memory_format=torch.contiguous_format)),
        Form("p_img.to('cuda', non_blocking=True, memory_format=channels_last)",
             lambda e: e.p_img.to("cuda", non_blocking=True, memory_format=torch.channels_last)),
        Form("h.to('cuda', non_blocking=True) pageable", lambda e: e.h.to("cuda", non_blocking=True)),
        Form("h.to(0, non_blocking=True) pageable", lambda e: e.h.to(0, non_blocking=True)),
        Form("h.to('cuda')", lambda e: e.h.to("cuda")),
        Form("x.to('cpu', non_blocking=True) pinned result", lambda e: e.x.to("cpu", non_blocking=True)),
        Form("x.to('cpu')", lambda e: e.x.to("cpu")),
        Form("x.to(h, True)", lambda e: e.x.to(e.h, True)),
        Form("x.to('cuda', copy=True)", lambda e: e.x.to("cuda", copy=True)),
        Form("x.to('cuda:0') returns self", lambda e: e.x.to("cuda:0")),
        Form("p.cuda()", lambda e: e.p.cuda()),
        Form("p.cuda(0, True)", lambda e: e.p.cuda(0, True)),
        Form("p.cuda(device=dev, non_blocking=True, memory_format=preserve)",
             lambda e: e.p.cuda(device=dev, non_blocking=True, memory_format=torch.preserve_format)),
        Form("p_img.cuda(non_blocking=True, memory_format=channels_last)",
             lambda e: e.p_img.cuda(non_blocking=True, memory_format=torch.channels_last)),
        Form("h.cuda(non_blocking=True) pageable", lambda e: e.h.cuda(non_blocking=True)),
        Form("x.cuda() returns self", lambda e: e.x.cuda()),
        Form("gd.copy_(p, True)", lambda e: e.gd.copy_(e.p, True)),
        Form("gd.copy_(other=p, non_blocking=True)", lambda e: e.gd.copy_(other=e.p, non_blocking=True)),
        Form("gd.copy_(other=h, non_blocking=True) pageable", lambda e: e.gd.copy_(other=e.h, non_blocking=True)),
        Form("gd.copy_(h)", lambda e: e.gd.copy_(e.h)),
        Form("pd.copy_(x, non_blocking=True)", lambda e: e.pd.copy_(e.x, non_blocking=True)),
        Form("hd.copy_(other=x, non_blocking=True) pageable", lambda e: e.hd.copy_(other=e.x, non_blocking=True)),
        Form("hd.copy_(x)", lambda e: e.hd.copy_(e.x)),
        Form("gd.copy_(p_t, non_blocking=True) strided", lambda e: e.gd.copy_(e.p_t.t().t(), non_blocking=True)),
        Form("stream.synchronize()", lambda e: e.stream.synchronize()),
        Form("torch.cuda.Stream.synchronize(stream)", lambda e: torch.cuda.Stream.synchronize(e.stream)),
        Form("current_stream().synchronize()", lambda e: torch.cuda.current_stream().synchronize()),
        Form("event.synchronize()", lambda e: e.event.synchronize()),
        Form("torch.cuda.Event.synchronize(event)", lambda e: torch.cuda.Event.synchronize(e.event)),
        Form("event.synchronize(1) refused", lambda e: e.event.synchronize(1)),
        Form("stream.synchronize(stream) refused", lambda e: e.stream.synchronize(e.stream)),
        Form("torch.cuda.synchronize(dev)", lambda e: torch.cuda.synchronize(dev)),
        Form("sub.to('cpu', non_blocking=True)", lambda e: e.sub.to("cpu", non_blocking=True)),
        Form("p.to(sub, True)", lambda e: e.p.to(e.sub, True)),
        # Calls the checks pass on unread (reading them would change what torch does): functorch transforms,
        # nested and sparse tensors (results made dense here, so that they can be described).
        Form("vmap(p.to('cuda', non_blocking=True))", lambda e: torch.vmap(lambda t: t.to("cuda", non_blocking=True))(e.p)),
        Form("vmap(h.cuda(non_blocking=True)) pageable", lambda e: torch.vmap(lambda t: t.cuda(non_blocking=True))(e.h)),
        Form("nested.copy_(nested, non_blocking=True)", lambda e: _nested(e.y).copy_(_nested(e.x), non_blocking=True)
             .to_padded_tensor(0.0)),
        Form("nested.to('cpu', non_blocking=True)",
             lambda e: _synchronized(_nested(e.x).to("cpu", non_blocking=True)).to_padded_tensor(0.0)),
        Form("sparse pinned.to('cuda', non_blocking=True)",
             lambda e: e.p.to_sparse().pin_memory().to("cuda", non_blocking=True).to_dense()),
        Form("sparse gd.copy_(sparse, non_blocking=True)",
             lambda e: e.x.to_sparse().copy_(e.h.to_sparse(), non_blocking=True).to_dense()),
    ]


def _synchronized(t: torch.Tensor) -> torch.Tensor:
    """``t`` once the device is idle: a ``non_blocking`` D2H result may be read on the host only after that (the
    row read it at once, racing the copy under torch alone, and so differed from run to run)."""
    torch.cuda.synchronize()
    return t


def _nested(t: torch.Tensor) -> torch.Tensor:
    """A nested tensor of two rows of ``t`` and all of it, on ``t``'s device."""
    return torch.nested.nested_tensor([t[:2], t])


FORMS = cpu_forms() + _gpu_forms()


def _settled():
    """Wait for the call's GPU work and let the reads through: neither racy nor reported."""

    class Settled:
        def __enter__(self):
            self._allowed = syncs.allowed()
            self._allowed.__enter__()
            torch.cuda.synchronize()

        def __exit__(self, *exc):
            return self._allowed.__exit__(*exc)

    return Settled()


@pytest.fixture
def plain_then_detector(cuda_device):
    """torch alone first (the detector off), then the caller enables it; everything put back after."""
    originals = {name: getattr(torch.Tensor, name) for name in ("to", "cuda", "copy_")}
    warn_always_before = torch.is_warn_always_enabled()
    with detector_put_back():
        syncs.disable()
        torch.set_warn_always(True)  # torch warns once per process for some forms: every time here
        try:
            yield
        finally:
            torch.set_warn_always(warn_always_before)
    assert {name: getattr(torch.Tensor, name) for name in originals} == originals


def _enable(mode: str) -> None:
    syncs.set_mode(mode)
    assert syncs.enable(), "the detector must be active on a GPU machine"


@pytest.mark.gpu
def test_every_call_form_behaves_as_in_torch_on_the_gpu(seed, plain_then_detector):
    problems, recorded = [], 0
    for form in FORMS:  # torch warm too (signature_grid.plain_outcome: CPython 3.12 specializes super().name)
        outcome(form, gpu_env(seed), _settled)
    plain = {form.label: outcome(form, gpu_env(seed), _settled) for form in FORMS}
    _enable("record")
    for form in FORMS:
        problems.append(difference(form, plain[form.label], outcome(form, gpu_env(seed), _settled)))
    in_region = {}
    for form in FORMS:
        syncs.reset()
        found = outcome(form, gpu_env(seed), _settled, region=syncs.checking)
        in_region[form.label] = (found, syncs.report().total)
        problems.append(difference(form, plain[form.label], in_region[form.label][0]))
        expected = plain[form.label]["result"]
        if expected[0] == "raised" and expected[1] is TypeError and in_region[form.label][1]:
            problems.append(f"{form.label}: torch refuses this call, yet it was reported")
    syncs.disable()
    _enable("error")
    for form in FORMS:
        got = outcome(form, gpu_env(seed), _settled, region=syncs.checking)
        if in_region[form.label][1]:
            recorded += 1
            if got["result"][1] is not SyncViolation:
                problems.append(f"{form.label}: recorded as a violation, but error mode did not raise SyncViolation")
        else:
            problems.append(difference(form, plain[form.label], got))
    problems = [p for p in problems if p]
    print(f"{len(FORMS)} call forms x 4 runs, {recorded} recorded as violations, {len(problems)} differences")
    assert not problems, f"seed {seed}\n" + "\n".join(problems)
    assert recorded >= 8  # the pageable copies, the blocking copies and the waits are caught, not ignored


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_fullgraph_copies_behave_as_in_torch(backend, seed, plain_then_detector):
    def program(g, pinned, dst):
        up = pinned.to(g.device, non_blocking=True)
        dst.copy_(other=up * 2, non_blocking=True)
        return (g + up).to(torch.float16), dst.to(dtype=torch.float64, copy=True)

    def run_compiled(env):
        torch._dynamo.reset()
        compiled = torch.compile(program, backend=backend, fullgraph=True)  # a graph break fails here
        first = compiled(env.x, env.p, env.gd)
        again = compiled(env.x, env.p, env.gd)
        return first, again, env.gd

    plain = run_compiled(gpu_env(seed))
    torch.cuda.synchronize()
    plain = [t.cpu() for t in (*plain[0], *plain[1], plain[2])]
    _enable("record")
    env = gpu_env(seed)
    with syncs.checking():
        checked = run_compiled(env)
        done = torch.cuda.Event()
        done.record()
    done.synchronize()
    checked = [t.cpu() for t in (*checked[0], *checked[1], checked[2])]
    torch._dynamo.reset()
    assert not syncs.report(), syncs.report().format()
    for a, b in zip(plain, checked):
        assert a.dtype == b.dtype and torch.equal(a, b), f"seed {seed}"
