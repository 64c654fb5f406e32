"""torch.compile sees torch's own methods whether the detector is on, off, or was on at the first compile.

torch is the oracle: each program is compiled with ``fullgraph=True`` and
counted with ``torch._dynamo.explain`` under plain torch first, in the same
test, then with the detector enabled (outside and inside a checked region)
and after it is disabled. Results, graph counts and graph breaks must match.
"""

from __future__ import annotations

import functools

import pytest
import torch

from syncless import syncs
from syncless.syncs import _debugmode, _state

dynamo = pytest.importorskip("torch._dynamo")

PROGRAMS = {
    "x.to(float64)": lambda x: x.to(torch.float64) + 1,
    "Tensor.to(x, float64)": lambda x: torch.Tensor.to(x, torch.float64) + 1,
    "Tensor.to(x, dtype=, copy=True)": lambda x: torch.Tensor.to(x, dtype=torch.float64, copy=True) * 2,
    "partial(Tensor.to, dtype=float64)": lambda x: functools.partial(torch.Tensor.to, dtype=torch.float64)(x) + 1,
    "Tensor.copy_(dst, x)": lambda x: torch.Tensor.copy_(torch.empty_like(x), x * 3) + 1,
    "Tensor.copy_(dst, other=, non_blocking=True)":
        lambda x: torch.Tensor.copy_(torch.empty_like(x), other=x - 1, non_blocking=True) + 1,
}


def _compiled(program, x):
    """(result, graphs, graph breaks) of ``program`` compiled with fullgraph=True (a graph break raises)."""
    dynamo.reset()
    result = torch.compile(program, fullgraph=True, backend="eager")(x.clone())
    explained = dynamo.explain(program)(x.clone())
    return result, explained.graph_count, explained.graph_break_count


def _same(plain, got, label):
    assert got[1:] == plain[1:], f"{label}: graphs/breaks {got[1:]} with syncless, {plain[1:]} in torch alone"
    assert got[0].dtype == plain[0].dtype and torch.equal(got[0], plain[0]), label


@pytest.mark.parametrize("label", list(PROGRAMS))
def test_bound_and_unbound_forms_compile_in_one_graph_as_in_torch(label, restored_globals):
    program = PROGRAMS[label]
    x = torch.randn(3, 4)
    plain = _compiled(program, x)
    with _debugmode.fake():
        syncs.set_mode("record")
        assert syncs.enable()
        _same(plain, _compiled(program, x), f"{label}, enabled")
        with syncs.checking():
            _same(plain, _compiled(program, x), f"{label}, in a checked region")
        syncs.disable()
    _same(plain, _compiled(program, x), f"{label}, after disable")
    dynamo.reset()


def test_a_first_compile_while_enabled_leaves_nothing_behind_after_disable(restored_globals):
    # dynamo's tables of tensor methods are built on first use from the attributes as they are then: built
    # while our entries stand in for Tensor.to/copy_, they would lack torch's methods for good.
    program = PROGRAMS["Tensor.to(x, float64)"]
    x = torch.randn(5)
    plain = _compiled(program, x)
    with _debugmode.fake():
        syncs.set_mode("record")
        assert syncs.enable()
        dynamo.trace_rules.clear_lru_cache()  # as if this were the process's first compile
        _compiled(PROGRAMS["x.to(float64)"], x)  # builds them now
        syncs.disable()
    _same(plain, _compiled(program, x), "after disable")
    dynamo.reset()


def test_a_checked_function_compiles_in_one_graph(restored_globals):
    def step(x):
        return x.to(torch.float64) * 2

    x = torch.randn(4)
    plain = _compiled(step, x)
    with _debugmode.fake():
        syncs.set_mode("record")
        checked_step = syncs.checked(step)
        assert syncs.enable()
        _same(plain, _compiled(checked_step, x), "checked, enabled")
        assert syncs.checked(lambda: _state.checked_depth.get())() == 1  # run eagerly it is still a region
        syncs.disable()
    dynamo.reset()


def test_a_checking_block_inside_a_compiled_function_compiles_in_one_graph(restored_globals):
    def step(x):
        with syncs.checking():
            return x.to(torch.float64) * 2

    x = torch.randn(4)
    with _debugmode.fake():
        syncs.set_mode("record")
        plain = _compiled(step, x)  # before enable(): checking() does nothing
        assert syncs.enable()
        _same(plain, _compiled(step, x), "checking() block, enabled")
        syncs.disable()
    dynamo.reset()
