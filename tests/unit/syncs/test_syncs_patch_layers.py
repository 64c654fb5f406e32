"""Patch layers (shared by the detector and cc): one layer per key, and nothing stale after a layer leaves."""

import pytest

from syncless._core import patching


def _make_target():
    class Target:
        def greet(self, name):
            return f"hello {name}"

    return Target


def tagging(tag):
    def wrap(next_fn):
        def wrapper(*args, **kwargs):
            return f"{tag}({next_fn(*args, **kwargs)})"

        return wrapper

    return wrap


@pytest.fixture
def target():
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
