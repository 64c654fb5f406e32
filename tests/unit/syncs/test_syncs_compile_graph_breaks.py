"""Regions and allows written inside compiled code hold for the eager code at its graph breaks.

Without ``fullgraph=True``, dynamo runs the code at a graph break as plain
Python in the middle of the compiled call, and that code may sync. Every
form is run on the eager, aot_eager and inductor backends (the fake debug
mode stands in for torch's), with a sync made at a graph break
(``sync_at_break``, which dynamo never traces), and compared with the same
form run eagerly. With ``fullgraph=True`` every form must still compile in
one graph, and ``enable()``/``disable()`` must not recompile (dynamo's own
counters).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from syncless import syncs
from syncless._core.errors import SyncViolation
from syncless.syncs import _debugmode

from .conftest import torch_sync_warning

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402

BACKENDS = ("eager", "aot_eager", "inductor")
CALLS = 3


@dynamo.disable
def sync_at_break():
    """A sync in the eager code that runs at a graph break (dynamo does not trace a disabled function)."""
    torch_sync_warning()


def _checked_body(x):
    y = torch.sin(x) * 2
    sync_at_break()
    return y + 1


def _checking_inside(x):
    y = torch.sin(x) * 2
    with syncs.checking():
        y = y - 1
        sync_at_break()
        y = y * 3
    sync_at_break()  # after the block: not checked
    return y + 1


def _allowed_inside(x):
    y = torch.sin(x) * 2
    with syncs.allowed():
        sync_at_break()  # intended: allowed
    return y + 1


def _calls_a_checked_function(checked_fn):
    def step(x):
        return checked_fn(torch.cos(x)) - 1

    return step


@pytest.fixture
def fresh_dynamo():
    dynamo.reset()
    counters.clear()
    yield
    dynamo.reset()


@pytest.fixture
def recording(restored_globals, fresh_dynamo):
    with _debugmode.fake():
        syncs.set_mode("record")
        syncs.reset()
        assert syncs.enable()
        yield
        syncs.disable()


def _run(step, inputs):
    return [step(x) for x in inputs]


def _expect_same(step, form, inputs):
    """Run ``step`` on ``inputs`` and compare with ``form`` run eagerly first (whose syncs are then forgotten)."""
    want = [form(x) for x in inputs]
    syncs.reset()
    got = _run(step, inputs)
    for index, (a, b) in enumerate(zip(want, got)):
        # Inductor fuses and reorders float ops, so its results may differ in the last bits (near zero,
        # beyond allclose's atol of 1e-8): compare with torch's float32 tolerances instead.
        torch.testing.assert_close(b, a, msg=lambda m: f"call {index}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_over_checked_checks_a_sync_at_a_graph_break(backend, recording):
    step = torch.compile(syncs.checked(_checked_body), backend=backend)
    inputs = [torch.randn(8) for _ in range(CALLS)]
    _expect_same(step, _checked_body, inputs)
    assert syncs.report().total == CALLS, syncs.report().format()


@pytest.mark.parametrize("backend", BACKENDS)
def test_checking_inside_a_compiled_function_checks_a_sync_at_a_graph_break(backend, recording):
    step = torch.compile(_checking_inside, backend=backend)
    inputs = [torch.randn(8) for _ in range(CALLS)]
    _expect_same(step, _checking_inside, inputs)
    sites = syncs.report().sites
    assert syncs.report().total == CALLS and len(sites) == 1, syncs.report().format()
    assert sites[0].first.filename == __file__


@pytest.mark.parametrize("backend", BACKENDS)
def test_allowed_inside_a_compiled_function_covers_a_sync_at_a_graph_break(backend, restored_globals, fresh_dynamo):
    step = torch.compile(_allowed_inside, backend=backend)
    inputs = [torch.randn(8) for _ in range(CALLS)]
    with _debugmode.fake():
        syncs.set_mode("error")
        assert syncs.enable()
        with syncs.checking(), warnings.catch_warnings():
            _expect_same(step, _allowed_inside, inputs)  # error mode: raises if the intended sync is not allowed
            with pytest.raises(SyncViolation):
                sync_at_break()  # the control: outside the allow region it raises
        syncs.disable()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checked_function_called_from_compiled_code_checks_a_sync_at_its_graph_break(backend, recording):
    step = torch.compile(_calls_a_checked_function(syncs.checked(_checked_body)), backend=backend)
    inputs = [torch.randn(8) for _ in range(CALLS)]
    _expect_same(step, _calls_a_checked_function(_checked_body), inputs)
    assert syncs.report().total == CALLS, syncs.report().format()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_region_around_the_compiled_call_checks_its_graph_breaks(backend, recording):
    step = torch.compile(_checked_body, backend=backend)
    inputs = [torch.randn(8) for _ in range(CALLS)]
    with syncs.checking():
        _expect_same(step, _checked_body, inputs)
    assert syncs.report().total == CALLS, syncs.report().format()


def _fullgraph_forms():
    def checking_block(x):
        with syncs.checking():
            x = torch.sin(x) * 2
        return x + 1

    def allowed_block(x):
        with syncs.allowed(), syncs.allowed(first_only=True):
            x = torch.sin(x) * 2
        return x + 1

    def calls_checked(x):
        return checked_inner(x) + 1

    def inner(x):
        return torch.sin(x) * 2

    checked_inner = syncs.checked(inner)
    return {"checked": (syncs.checked(inner), inner), "checking": (checking_block, checking_block),
            "allowed": (allowed_block, allowed_block), "calls a checked function": (calls_checked, lambda x: inner(x) + 1)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph-breaks-allowed"])
@pytest.mark.parametrize("form", ["checked", "checking", "allowed", "calls a checked function"])
def test_every_form_compiles_and_the_gate_never_recompiles(form, fullgraph, backend, restored_globals, fresh_dynamo):
    with _debugmode.fake():
        syncs.set_mode("record")
        compiled, oracle = _fullgraph_forms()[form]
        step = torch.compile(compiled, backend=backend, fullgraph=fullgraph)
        inputs = [torch.randn(8) for _ in range(5)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the one-time note that a checked call in a fullgraph graph is no region
            got = [step(inputs[0])]  # warm-up, before enable()
            compiled_frames = dict(counters["frames"])
            syncs.enable()
            got.append(step(inputs[1]))
            with syncs.checking():
                got.append(step(inputs[2]))
            syncs.disable()
            got.append(step(inputs[3]))
            syncs.enable()
            got.append(step(inputs[4]))
            syncs.disable()
    assert dict(counters["frames"]) == compiled_frames, f"recompiled after the gate flipped: {dict(counters['frames'])}"
    assert not counters["graph_break"], dict(counters["graph_break"])
    for x, have in zip(inputs, got):
        torch.testing.assert_close(have, oracle(x))


def test_a_checked_function_inlined_into_a_fullgraph_graph_warns_once(restored_globals, fresh_dynamo):
    def inner(x):
        return x * 2

    syncs.set_mode("record")  # before decorating: with the mode off, checked returns the function itself
    checked_inner = syncs.checked(inner)

    def step(x):
        return checked_inner(x) + 1

    with _debugmode.fake():
        with pytest.warns(UserWarning, match="inner is @syncs.checked but is compiled into a torch.compile"):
            torch.compile(step, fullgraph=True, backend="eager")(torch.randn(3))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            dynamo.reset()
            torch.compile(step, fullgraph=True, backend="eager")(torch.randn(3))  # once per function
