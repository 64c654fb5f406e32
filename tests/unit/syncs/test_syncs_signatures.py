"""The wrappers keep torch's calling conventions: torch alone is the oracle for every call form.

Each form of :mod:`signature_grid` runs on fresh random tensors (one seed,
printed on failure) with the detector off, then enabled outside a checked
region, inside one (record mode), and inside one in error mode. Results,
aliasing, the inputs afterwards, exceptions (type and message), warnings
and what ``__torch_function__`` overrides see must all be the same, except
that error mode may raise SyncViolation for a call it recorded as a
violation. A call torch refuses for its arguments is never reported.

On this CPU build torch's debug-mode switch is faked; the CUDA forms raise
torch's own "not compiled with CUDA" error, before or after the check ran.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from syncless import syncs
from syncless._core import patching
from syncless.syncs import SyncViolation, _copies, _debugmode
from support.call_forms import seed  # noqa: F401 - a fixture

from .conftest import patched_attributes
from .signature_grid import Form, cpu_forms, difference, make_env, outcome, plain_outcome

FORMS = cpu_forms()


@pytest.fixture
def warn_always():
    """torch warns only once per process for some forms (deprecated overloads, complex casts): every time here."""
    before = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    yield
    torch.set_warn_always(before)


def _enabled(mode: str) -> None:
    syncs.set_mode(mode)
    assert syncs.enable()


@pytest.mark.parametrize("form", FORMS, ids=[f.label for f in FORMS])
def test_call_form_behaves_as_in_torch(form: Form, seed: int, restored_globals, warn_always):
    plain = plain_outcome(form, seed)
    with _debugmode.fake():
        _enabled("record")
        problems = [difference(form, plain, outcome(form, make_env(seed)))]
        syncs.reset()
        checked = outcome(form, make_env(seed), region=syncs.checking)
        problems.append(difference(form, plain, checked))
        reported = syncs.report().total
        if plain["result"][0] == "raised" and plain["result"][1] is TypeError:
            assert reported == 0, f"{form.label}: torch refuses this call, yet it was reported"
        syncs.disable()
        _enabled("error")
        in_error_mode = outcome(form, make_env(seed), region=syncs.checking)
        if reported:
            assert in_error_mode["result"][1] is SyncViolation, f"{form.label}: recorded, but not raised in error mode"
        else:
            problems.append(difference(form, plain, in_error_mode))
        syncs.disable()
    problems = [p for p in problems if p]
    assert not problems, f"seed {seed}\n" + "\n".join(problems)


def test_the_grid_covers_every_wrapped_callable(fake_mode):
    # Every attribute enable() layered (found in the patch registry, not in a list kept here) has call forms.
    wrapped = [(chain.owner, chain.name) for chain in patching._chains.values() if _copies.LAYER_KEY in chain.layers]
    assert set(patched_attributes()) <= set(wrapped)
    labels = " ".join(f.label for f in FORMS)
    for owner, name in wrapped:
        written = f".{name}(" if owner is torch.Tensor else f"{owner.__name__.rsplit('.', 1)[-1]}.{name}("
        assert written in labels, f"no call form of {owner.__name__}.{name} in the signature grid"


def test_the_wrapped_callables_look_like_torchs(restored_globals):
    before = {(owner, name): getattr(owner, name) for owner, name in patched_attributes()}
    with _debugmode.fake():
        _enabled("record")
        for (owner, name), original in before.items():
            wrapped = getattr(owner, name)
            assert wrapped is not original
            for attribute in ("__name__", "__qualname__", "__doc__"):
                assert getattr(wrapped, attribute, None) == getattr(original, attribute, None), (name, attribute)
            assert inspect.unwrap(wrapped) is original
            try:
                expected: object = inspect.signature(original)
            except ValueError as err:  # a C method without a text signature
                expected = ("ValueError", str(err))
            try:
                got: object = inspect.signature(wrapped)
            except ValueError as err:
                got = ("ValueError", str(err))
            assert got == expected, name


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_fullgraph_functions_behave_as_in_torch(backend, seed, restored_globals, warn_always):
    def program(x, y, dst):
        half = x.to(torch.float16)
        moved = y.to("cpu", non_blocking=True)
        same = x.to(x)
        dst.copy_(other=moved * 2, non_blocking=True)
        return half.float() + same, dst.to(dtype=torch.float64, copy=True)

    def run_compiled(env):
        torch._dynamo.reset()
        compiled = torch.compile(program, backend=backend, fullgraph=True)  # a graph break fails here
        first = compiled(env.x, env.y, env.dst)
        again = compiled(env.x, env.y, env.dst)
        return [t.clone() for t in (*first, *again, env.dst)]

    plain = run_compiled(make_env(seed))
    with _debugmode.fake():
        _enabled("record")
        env = make_env(seed)
        with syncs.checking():
            checked = run_compiled(env)
        syncs.disable()
    torch._dynamo.reset()
    assert len(plain) == len(checked)
    for a, b in zip(plain, checked):
        assert a.dtype == b.dtype and torch.equal(a, b), f"seed {seed}"
    assert not syncs.report()


def test_the_old_copy_keyword_bug_is_in_the_grid():
    # The regression of issue 14: copy_(other=...) raised TypeError once the detector was enabled.
    assert any("copy_(other=" in f.label for f in FORMS)
