"""Patch layers compose in either order and restore the originals by identity."""

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
