"""Patch layers (shared by the detector and cc).

They compose in either order and restore the originals by identity; one
layer per key, and nothing stale after a layer leaves.
"""

import types

import pytest
import torch

from syncless._core import patching


class Target:
    def greet(self, name):
        return f"hello {name}"


def tagging(tag):
    def wrap(next_fn):
        def wrapper(*args, **kwargs):
            return f"{tag}({next_fn(*args, **kwargs)})"

        return wrapper

    return wrap


@pytest.mark.parametrize("order", [("low", "high"), ("high", "low")])
@pytest.mark.parametrize("first_out", ["low", "high"])
def test_layers_compose_by_rank_in_any_order_and_unwind(order, first_out):
    original = Target.__dict__["greet"]
    ranks = {"low": 1, "high": 2}
    for key in order:
        patching.add_layer(Target, "greet", key, ranks[key], tagging(key))
    assert Target().greet("x") == "high(low(hello x))"
    assert patching.original(Target, "greet") is original
    patching.remove_layer(Target, "greet", first_out)
    remaining = "high" if first_out == "low" else "low"
    assert Target().greet("x") == f"{remaining}(hello x)"
    patching.remove_layer(Target, "greet", remaining)
    assert Target.__dict__["greet"] is original
    assert not patching.is_layered(Target, "greet")


def test_adding_a_layer_twice_is_idempotent():
    patching.add_layer(Target, "greet", "once", 1, tagging("once"))
    patching.add_layer(Target, "greet", "once", 1, tagging("once"))
    try:
        assert Target().greet("y") == "once(hello y)"
    finally:
        patching.remove_layer(Target, "greet", "once")
    patching.remove_layer(Target, "greet", "once")  # removing again is harmless


def test_beneath_returns_the_lower_layer():
    patching.add_layer(Target, "greet", "a", 1, tagging("a"))
    patching.add_layer(Target, "greet", "b", 2, tagging("b"))
    try:
        assert patching.beneath(Target, "greet", "b")(Target(), "z") == "a(hello z)"
        assert patching.beneath(Target, "greet", "a") is patching.original(Target, "greet")
        assert patching.beneath(Target, "greet", "a")(Target(), "z") == "hello z"
    finally:
        patching.remove_layer(Target, "greet", "a")
        patching.remove_layer(Target, "greet", "b")


def test_inherited_torch_method_is_restored_by_identity():
    before = torch.Tensor.copy_
    own_before = "copy_" in torch.Tensor.__dict__
    patching.add_layer(torch.Tensor, "copy_", "test", 1, lambda next_fn: lambda self, *a, **k: next_fn(self, *a, **k))
    try:
        assert torch.Tensor.copy_ is not before
        dst = torch.empty(3)
        src = torch.randn(3)
        dst.copy_(src)
        assert torch.equal(dst, src)
    finally:
        patching.remove_layer(torch.Tensor, "copy_", "test")
    assert torch.Tensor.copy_ is before
    assert ("copy_" in torch.Tensor.__dict__) == own_before


def test_module_function_is_restored_by_identity():
    module = types.ModuleType("fake")
    module.sync = lambda: "synced"
    original = module.sync
    patching.add_layer(module, "sync", "k", 1, tagging("k"))
    assert module.sync() == "k(synced)"
    patching.remove_layer(module, "sync", "k")
    assert module.sync is original


# -- one layer per key, nothing stale ------------------------------------------------


def _make_target():
    """A fresh class per test, so layers left by a failing test do not leak into the next."""

    class Target:
        def greet(self, name):
            return f"hello {name}"

    return Target


@pytest.fixture
def target():
    """A fresh class whose layers (keys a, b, c, k) are removed after the test."""
    cls = _make_target()
    yield cls
    for key in ("a", "b", "c", "k"):
        patching.remove_layer(cls, "greet", key)


def test_adding_a_key_again_keeps_the_first_layer(target):
    patching.add_layer(target, "greet", "k", 1, tagging("first"))
    patching.add_layer(target, "greet", "k", 5, tagging("second"))
    assert target().greet("x") == "first(hello x)"


def test_a_layer_added_after_all_left_wraps_the_attribute_as_it_is_then(target):
    patching.add_layer(target, "greet", "a", 1, tagging("a"))
    patching.remove_layer(target, "greet", "a")

    def replaced(self, name):  # someone else patches the attribute once syncless is gone
        return f"hi {name}"

    target.greet = replaced
    patching.add_layer(target, "greet", "b", 1, tagging("b"))
    assert target().greet("x") == "b(hi x)"
    assert patching.original(target, "greet") is replaced
    patching.remove_layer(target, "greet", "b")
    assert target.__dict__["greet"] is replaced


def test_is_layered_names_the_key(target):
    patching.add_layer(target, "greet", "a", 1, tagging("a"))
    assert patching.is_layered(target, "greet", "a")
    assert patching.is_layered(target, "greet")
    assert not patching.is_layered(target, "greet", "b")


def test_beneath_a_key_that_is_not_layered_is_the_original(target):
    original = target.__dict__["greet"]
    patching.add_layer(target, "greet", "a", 1, tagging("a"))
    patching.add_layer(target, "greet", "b", 2, tagging("b"))
    patching.add_layer(target, "greet", "c", 3, tagging("c"))
    assert patching.beneath(target, "greet", "k") is original
    patching.remove_layer(target, "greet", "b")
    patching.remove_layer(target, "greet", "a")
    # Nothing remembered from b's time: what b wrapped (a over the base) is gone.
    assert patching.beneath(target, "greet", "b") is original
    assert patching.beneath(target, "greet", "c") is original
    assert target().greet("z") == "c(hello z)"


# -- another library patches the same attribute after syncless -------------------------


class ForeignPatch:
    """What another library does: save the attribute, put its own function over it, later put the saved one back."""

    def __init__(self, owner, name, tag="f"):
        self.owner, self.name = owner, name
        self.saved = owner.__dict__.get(name, _ABSENT) if isinstance(owner, type) else getattr(owner, name)
        below = getattr(owner, name)

        def patched(*args, **kwargs):
            return f"{tag}({below(*args, **kwargs)})"

        self.patched = patched
        setattr(owner, name, patched)

    def undo(self):
        if self.saved is _ABSENT:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.saved)


_ABSENT = object()


def test_a_later_foreign_patch_keeps_working_and_survives_our_removal(target):
    original = target.__dict__["greet"]
    patching.add_layer(target, "greet", "a", 1, tagging("a"))
    foreign = ForeignPatch(target, "greet")
    assert target().greet("x") == "f(a(hello x))"
    patching.remove_layer(target, "greet", "a")
    assert target.__dict__["greet"] is foreign.patched  # not deleted, not overwritten
    assert target().greet("x") == "f(hello x)"  # our layer is out of its way
    foreign.undo()  # it puts back what it saw: our entry, now a pass-through
    assert target().greet("x") == "hello x"
    patching.add_layer(target, "greet", "b", 1, tagging("b"))
    assert patching.original(target, "greet") is original  # a new chain starts from the real base
    assert target().greet("x") == "b(hello x)"
    patching.remove_layer(target, "greet", "b")
    assert target.__dict__["greet"] is original


@pytest.mark.parametrize("order", [("a", "b", "c"), ("c", "a", "b"), ("b", "c", "a")])
def test_layers_change_beneath_a_foreign_patch(target, order):
    patching.add_layer(target, "greet", "a", 1, tagging("a"))
    foreign = ForeignPatch(target, "greet")
    patching.add_layer(target, "greet", "c", 3, tagging("c"))
    patching.add_layer(target, "greet", "b", 2, tagging("b"))
    assert target().greet("x") == "f(c(b(a(hello x))))"
    left = ["a", "b", "c"]
    for key in order:
        patching.remove_layer(target, "greet", key)
        left.remove(key)
        inner = "hello x"
        for tag in left:
            inner = f"{tag}({inner})"
        assert target().greet("x") == f"f({inner})"
        assert target.__dict__["greet"] is foreign.patched


def test_a_foreign_patch_undone_while_we_are_installed_lets_us_restore_by_identity(target):
    original = target.__dict__["greet"]
    patching.add_layer(target, "greet", "a", 1, tagging("a"))
    foreign = ForeignPatch(target, "greet")
    foreign.undo()
    assert target().greet("x") == "a(hello x)"
    patching.remove_layer(target, "greet", "a")
    assert target.__dict__["greet"] is original


def test_a_foreign_patch_before_us_is_our_base(target):
    foreign = ForeignPatch(target, "greet")
    patching.add_layer(target, "greet", "a", 1, tagging("a"))
    assert target().greet("x") == "a(f(hello x))"
    patching.remove_layer(target, "greet", "a")
    assert target.__dict__["greet"] is foreign.patched


def test_a_foreign_patch_of_an_inherited_torch_method_survives_and_is_undone_cleanly():
    own_before = "copy_" in torch.Tensor.__dict__
    before = torch.Tensor.copy_
    patching.add_layer(torch.Tensor, "copy_", "test", 1, lambda next_fn: lambda *a, **k: next_fn(*a, **k))
    seen = []
    below = torch.Tensor.copy_

    def foreign_copy(*args, **kwargs):
        seen.append(1)
        return below(*args, **kwargs)

    torch.Tensor.copy_ = foreign_copy
    try:
        patching.remove_layer(torch.Tensor, "copy_", "test")
        assert torch.Tensor.copy_ is foreign_copy
        dst, src = torch.full((3,), float("nan")), torch.randn(3)
        dst.copy_(other=src)
        assert torch.equal(dst, src) and seen == [1]
    finally:
        torch.Tensor.copy_ = below  # the foreign library undoes its patch: our pass-through is back
        patching.add_layer(torch.Tensor, "copy_", "test", 1, lambda next_fn: next_fn)
        patching.remove_layer(torch.Tensor, "copy_", "test")
    assert torch.Tensor.copy_ is before
    assert ("copy_" in torch.Tensor.__dict__) == own_before


def test_a_class_attribute_is_replaced_directly_and_a_foreign_patch_over_it_is_kept():
    module = types.ModuleType("fake")

    class Event:
        pass

    module.Event = Event

    def subclassing(base):
        return type("Event", (base,), {})

    patching.add_layer(module, "Event", "k", 1, subclassing)
    assert issubclass(module.Event, Event) and module.Event is not Event  # still a class, not a function
    foreign = type("ForeignEvent", (module.Event,), {})
    module.Event = foreign
    patching.remove_layer(module, "Event", "k")
    assert module.Event is foreign


def test_the_entry_looks_like_the_base(target):
    original = target.__dict__["greet"]
    patching.add_layer(target, "greet", "a", 1, tagging("a"))
    entry = target.__dict__["greet"]
    assert entry.__name__ == "greet" and entry.__qualname__ == original.__qualname__
    assert entry.__wrapped__ is original


# -- torch's tables keyed by its own methods -----------------------------------------


def _pass_through(next_fn):
    return lambda *args, **kwargs: next_fn(*args, **kwargs)


def _listed(table, fn):
    return any(item is fn for item in table)


def test_a_lazy_parameter_lets_the_entry_through_while_it_fronts_an_allowed_method():
    # torch hands __torch_function__ the attribute as it is at call time (our entry); a lazy module's
    # parameter lets through only the methods in _allowed_methods, listed by identity.
    allowed = torch.nn.parameter.UninitializedTensorMixin._allowed_methods
    before = list(allowed)
    base = torch.Tensor.to
    patching.add_layer(torch.Tensor, "to", "test", 1, _pass_through)
    try:
        entry = torch.Tensor.to
        assert _listed(allowed, entry) and _listed(allowed, base)
        assert torch.nn.LazyLinear(3).to(torch.float64).weight.dtype == torch.float64
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):  # torch's own error
            torch.nn.UninitializedParameter().copy_(torch.randn(1))
    finally:
        patching.remove_layer(torch.Tensor, "to", "test")
    assert torch.Tensor.to is base
    assert allowed == before and not _listed(allowed, entry)


def test_a_retired_entry_stays_listed_while_a_foreign_patch_can_still_call_it():
    allowed = torch.nn.parameter.UninitializedTensorMixin._allowed_methods
    before = list(allowed)
    base = torch.Tensor.cuda
    patching.add_layer(torch.Tensor, "cuda", "test", 1, _pass_through)
    entry = torch.Tensor.cuda

    def foreign_cuda(*args, **kwargs):
        return entry(*args, **kwargs)

    torch.Tensor.cuda = foreign_cuda
    try:
        patching.remove_layer(torch.Tensor, "cuda", "test")
        assert _listed(allowed, entry) and _listed(allowed, base)  # the foreign patch hands our entry on
    finally:
        torch.Tensor.cuda = entry  # the foreign library undoes its patch
        patching.add_layer(torch.Tensor, "cuda", "test", 1, _pass_through)
        patching.remove_layer(torch.Tensor, "cuda", "test")
        allowed[:] = [item for item in allowed if item is not entry]
    assert torch.Tensor.cuda is base and allowed == before


@pytest.mark.parametrize("built", ["before", "while layered"])
def test_torch_overrides_tables_name_the_entry_as_a_tensor_method_and_forget_it_after(built):
    overrides = torch.overrides
    base = torch.Tensor.copy_
    overrides._get_tensor_methods.cache_clear()
    overrides._get_overridable_functions.cache_clear()
    if built == "before":
        assert overrides.is_tensor_method_or_property(base)
    patching.add_layer(torch.Tensor, "copy_", "test", 1, _pass_through)
    try:
        entry = torch.Tensor.copy_
        assert overrides.is_tensor_method_or_property(entry)
        assert overrides.resolve_name(entry) == "torch.Tensor.copy_"
    finally:
        patching.remove_layer(torch.Tensor, "copy_", "test")
    assert torch.Tensor.copy_ is base
    assert overrides.is_tensor_method_or_property(base)
    assert overrides.resolve_name(base) == "torch.Tensor.copy_"
    assert entry not in overrides._get_tensor_methods()


def test_a_reference_taken_while_layered_runs_no_layer_after_removal(target):
    """An alias, a ``functools.partial`` or a table built while a layer was in place holds the entry; once the
    layer left, the entry passes straight to the base (found in review: it still ran the departed layer)."""
    patching.add_layer(target, "greet", "a", 1, tagging("a"))
    held = target.greet  # the entry, as a module-level alias would hold it
    assert held(target(), "x") == "a(hello x)"
    patching.remove_layer(target, "greet", "a")
    assert held(target(), "x") == "hello x"


def test_torchscript_compiles_a_call_of_a_fronted_torch_function_and_forgets_the_entry_after():
    """Review: with cc's layer on ``torch.as_tensor``, ``torch.jit.script`` of a function calling it raised
    TypeError (TorchScript knows builtins by identity); libraries script such functions at import."""
    import torch

    def scale(x: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(x, dtype=torch.float64) * 2

    patching.add_layer(torch, "as_tensor", "test.script", 10, lambda next_fn: lambda *a, **k: next_fn(*a, **k))
    try:
        entry = torch.as_tensor
        scripted = torch.jit.script(scale)
        assert torch.equal(scripted(torch.ones(3)), torch.full((3,), 2.0, dtype=torch.float64))
    finally:
        patching.remove_layer(torch, "as_tensor", "test.script")
    from torch.jit import _builtins

    assert id(entry) not in _builtins._get_builtin_table()
    assert torch.as_tensor is torch._C._VariableFunctions.as_tensor
