"""On a real GPU: every call form of what cc wraps behaves as in torch alone, with the shim rerouting copies.

The forms of the syncs GPU grid (``tests/gpu/syncs/test_syncs_signatures_gpu.py``: the CPU grid on CUDA
tensors, pinned and pageable host copies, the waits), plus the event and stream methods cc wraps and
``torch.Event``, run under plain torch, then with ``cc.install("on")``, ``cc.install("emulate")`` and
with the hidden-sync detector enabled as well (record mode, inside a checked region; installed before and
after cc). Staged H2D copies and the emulator's waits really run here; results, exceptions (type and
message), warnings and what ``__torch_function__`` overrides see must be the same.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import syncless.cc as cc
from gpu.syncs.test_syncs_signatures_gpu import _gpu_forms, _settled, gpu_env
from syncless import syncs
from support.call_forms import cc_configurations, cc_patched_attributes
from support.call_forms import seed  # noqa: F401 - a fixture
from unit.syncs.signature_grid import Form, cpu_forms, difference, outcome


def _cc_gpu_forms() -> list[Form]:
    ev, st = torch.cuda.Event, torch.cuda.Stream
    missing = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda:64"
    return [
        Form("event.record()", lambda e: e.event.record()),
        Form("event.record(stream)", lambda e: e.event.record(e.stream)),
        Form("event.record(stream=stream)", lambda e: e.event.record(stream=e.stream)),
        Form("event.record(stream, 1) refused", lambda e: e.event.record(e.stream, 1)),
        Form("event.record(s=stream) refused", lambda e: e.event.record(s=e.stream)),
        Form("event.wait(stream)", lambda e: e.event.wait(e.stream)),
        Form("event.wait(stream=stream)", lambda e: e.event.wait(stream=e.stream)),
        Form("event.wait(stream, stream) refused", lambda e: e.event.wait(e.stream, e.stream)),
        Form("event.query()", lambda e: e.event.query()),
        Form("event.query(1) refused", lambda e: e.event.query(1)),
        Form("torch.cuda.Event.query(event)", lambda e: ev.query(e.event)),
        Form("stream.query()", lambda e: e.stream.query()),
        Form("stream.query(stream) refused", lambda e: e.stream.query(e.stream)),
        Form("torch.cuda.Stream.query(stream)", lambda e: st.query(e.stream)),
        Form("stream.wait_event(event)", lambda e: e.stream.wait_event(e.event)),
        Form("stream.wait_stream(current)", lambda e: e.stream.wait_stream(torch.cuda.current_stream())),
        Form("stream.record_event() query", lambda e: e.stream.record_event().query()),
        Form("torch.cuda.synchronize(device=0)", lambda e: torch.cuda.synchronize(device=0)),
        Form("torch.Event('cuda') record/query/synchronize",
             lambda e: (lambda t: (t.record(), t.synchronize(), t.query()))(torch.Event("cuda"))),
        Form("torch.Event('cuda').record(stream=stream) then wait",
             lambda e: (lambda t: (t.record(stream=e.stream), t.wait(torch.cuda.current_stream()), t.query()))(
                 torch.Event("cuda"))),
        Form("torch.Event('cuda').record(1, 2) refused", lambda e: torch.Event("cuda").record(1, 2)),
        Form("torch.Event('cuda').synchronize(1) refused", lambda e: torch.Event("cuda").synchronize(1)),
        Form(f"p.to('{missing}', non_blocking=True) refused (no such GPU)",
             lambda e: e.p.to(missing, non_blocking=True)),
        Form("p.cuda(64, True) refused (no such GPU)", lambda e: e.p.cuda(64, True)),
        Form("p.cuda('cpu', True) refused", lambda e: e.p.cuda("cpu", True)),
        Form("p.cuda(0, True, 1) refused", lambda e: e.p.cuda(0, True, 1)),
        Form("gd.copy_(p, non_blocking=1) refused", lambda e: e.gd.copy_(e.p, non_blocking=1)),
        Form("gd.copy_(p, async=True) deprecated", lambda e: e.gd.copy_(e.p, **{"async": True})),
        Form("p.cuda(async=True) deprecated", lambda e: e.p.cuda(**{"async": True})),
        Form("sub.cuda(non_blocking=True) (CUDA sub)", lambda e: e.sub.cuda(non_blocking=True)),
        Form("gd.copy_(p.as_subclass(LoggingTensor), True)",
             lambda e: e.gd.copy_(e.p.as_subclass(type(e.sub)), True)),
        Form("p.as_subclass(LoggingTensor).to('cuda', non_blocking=True)",
             lambda e: e.p.as_subclass(type(e.sub)).to("cuda", non_blocking=True)),
    ]


FORMS = cpu_forms() + _gpu_forms() + _cc_gpu_forms()


@contextlib.contextmanager
def _syncs():
    syncs.set_mode("record")
    assert syncs.enable(), "the detector must be active on a GPU machine"
    try:
        yield
    finally:
        syncs.disable()


CONFIGURATIONS = cc_configurations(
    _syncs, ["cc on", "cc emulate", "syncs, then cc emulate", "cc on, then syncs"])


@pytest.fixture
def plain_torch(cuda_device):
    """torch alone first; everything cc and syncs patched is torch's own again afterwards."""
    originals = [(owner, name, getattr(owner, name)) for owner, name in cc_patched_attributes()]
    cc.uninstall()
    syncs.disable()
    mode_before, warn_always_before = syncs.mode(), torch.is_warn_always_enabled()
    torch.set_warn_always(True)  # torch warns once per process for some forms: every time here
    try:
        yield
    finally:
        cc.uninstall()
        syncs.disable()
        syncs.reset()
        syncs.set_mode(mode_before)
        torch.set_warn_always(warn_always_before)
    for owner, name, original in originals:
        assert getattr(owner, name) is original, f"{owner}.{name} was not restored"


@pytest.mark.gpu
def test_every_call_form_behaves_as_in_torch_with_cc_on_the_gpu(seed, plain_torch):
    problems = []
    plain = {form.label: outcome(form, gpu_env(seed), _settled) for form in FORMS}
    for label, configuration in CONFIGURATIONS.items():
        region = syncs.checking if "syncs" in label else contextlib.nullcontext
        with configuration():
            cc.reset_stats()
            for form in FORMS:
                problem = difference(form, plain[form.label], outcome(form, gpu_env(seed), _settled, region=region))
                if problem:
                    problems.append(f"[{label}] {problem}")
            stats = cc.stats()
        print(f"{label}: {len(FORMS)} forms, staged {stats.staged}, emulated waits {stats.emulated_waits}")
        if not stats.staged:
            problems.append(f"[{label}] no copy was staged, so the rerouted path was not compared")
    print(f"{len(FORMS)} call forms x {len(CONFIGURATIONS)} configurations, {len(problems)} differences")
    assert not problems, f"seed {seed}\n" + "\n".join(problems)
