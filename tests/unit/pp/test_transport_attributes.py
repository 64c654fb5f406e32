"""Every attribute the docs promise exists on every transport class, with a defined value (CPU only).

The names come from the docs themselves (``transport.NAME`` in ``docs/pp*.md`` and
``docs/failure-model.md``) and from the ``Attributes:`` sections of the transport classes, so a newly
documented attribute is checked without editing this test. The copy-engine transport is the real
class assembled over a simulated GPU (``test_auto_transport_cpu.Link``); the torch.distributed one
is what ``make_transport`` gives on two CPU ranks over gloo (the fallback an engine meets on a CPU
or without NVLink).
"""

from __future__ import annotations

import importlib.util
import inspect
import pathlib
import random
import re

import pytest

from support.ranks import run_ranks
from syncless.pp import _copy_engine, _torch_dist
from syncless.pp._base import Transport

_HERE = pathlib.Path(__file__)
_spec = importlib.util.spec_from_file_location("pp_cases", _HERE.with_name("pp_cases.py"))
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)
_spec = importlib.util.spec_from_file_location("auto_transport_cpu", _HERE.with_name("test_auto_transport_cpu.py"))
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)

pytestmark = pytest.mark.timeout(120)
DOCS = _HERE.parents[3] / "docs"


def _docstring_attributes(cls) -> set[str]:
    text = cls.__doc__ or ""
    if "Attributes:" not in text:
        return set()
    section = text.split("Attributes:", 1)[1]
    names: set[str] = set()
    for line in section.splitlines()[1:]:
        if line.strip() and not line.startswith(" " * 8):
            break  # the section ended
        match = re.match(r"^ {8}([a-z_]+(?:, [a-z_]+)*):", line)
        if match:
            names.update(match.group(1).split(", "))
    return names


def documented_names() -> list[str]:
    names = set()
    for page in ("pp.md", "pp-auto.md", "failure-model.md"):
        names.update(re.findall(r"\btransport\.([a-z_]+)", (DOCS / page).read_text()))
    for cls in (Transport, _copy_engine.CopyEngineTransport, _torch_dist.TorchDistTransport):
        names.update(_docstring_attributes(cls))
    return sorted(names)


def test_the_documented_names_are_found():
    names = documented_names()
    assert {"depth", "auto_slots", "batched_copies", "backend", "fallback_reason", "error"} <= set(names), names


def test_the_copy_engine_transport_defines_every_documented_attribute():
    # Its set-up needs a GPU, so this reads the class: a class attribute or property, or one that
    # __init__ assigns to self.
    cls = _copy_engine.CopyEngineTransport
    assigned = set(re.findall(r"self\.([a-z_]+)(?:: [^=]+)? = ", inspect.getsource(cls.__init__)))
    missing = [name for name in documented_names() if not hasattr(cls, name) and name not in assigned]
    assert missing == []


@pytest.mark.parametrize("depth", [0, 2, "auto"])
def test_the_copy_engine_transport_reports_them_over_a_simulated_gpu(depth):
    link = sim.Link(sim.SimGPU(random.Random(0)), depth=depth)
    try:
        for transport in (link.sender, link.receiver):
            assert transport.depth == depth and transport.direct_steps_sent == 0
            assert transport.error is None and transport.backend == "copy_engine"
    finally:
        link.close()


def test_the_torch_distributed_transport_has_every_documented_attribute():
    names = documented_names()
    depths = [0, 2, "auto"]
    results = run_ranks(cases.attributes, 2, args=(depths, names), timeout_s=60)
    for per_depth in results:
        for depth, values in zip(depths, per_depth):
            assert values["class"] == "TorchDistTransport"
            assert sorted(set(values) - {"class"}) == names
            assert values["backend"] == "torch_distributed" and values["depth"] == depth
            assert values["auto_slots"] == 0 and values["batched_copies"] is False
            assert values["direct_steps_sent"] == 0 and values["direct_unavailable_reason"] is None
            assert values["error"] is None and values["leaked_nbytes"] == 0
