"""Weak-reference bookkeeping of registered targets."""

import gc

import pytest

from syncless.cc._registry import WeakKeyedRegistry


class Obj:
    pass


def test_register_lookup_and_lapse():
    reg = WeakKeyedRegistry()
    a = Obj()
    assert reg.register(("cuda", 0, 100), a) is True
    assert reg.register(("cuda", 0, 100), a) is False  # idempotent
    assert reg.lookup(("cuda", 0, 100)) is a
    assert reg.lookup(("cuda", 0, 101)) is None
    assert len(reg) == 1
    del a
    gc.collect()
    assert reg.lookup(("cuda", 0, 100)) is None
    assert len(reg) == 0


def test_new_object_at_same_key_survives_old_death():
    reg = WeakKeyedRegistry()
    old = Obj()
    reg.register(7, old)
    new = Obj()
    assert reg.register(7, new) is True  # replaced (same address reused by a new tensor)
    del old
    gc.collect()
    assert reg.lookup(7) is new


def test_object_dead_before_reregistration_does_not_match_new_one():
    reg = WeakKeyedRegistry()
    old = Obj()
    reg.register(7, old)
    del old
    gc.collect()
    newcomer = Obj()  # may even reuse old's id(); it was never registered
    assert reg.lookup(7) is None
    assert reg.register(7, newcomer) is True
    assert reg.lookup(7) is newcomer


def test_lapse_during_a_locked_section_does_not_deadlock():
    import threading

    reg = WeakKeyedRegistry()
    doomed = Obj()
    doomed.cycle = doomed  # freed only by the collector
    reg.register(1, doomed)
    del doomed
    finished = threading.Event()

    def register_with_collection_inside():
        keep = Obj()
        with reg._lock:  # a collection here runs the lapse on this very thread
            gc.collect()
            reg.register(2, keep)
        finished.set()

    worker = threading.Thread(target=register_with_collection_inside, daemon=True)
    worker.start()
    assert finished.wait(10), "the lapse callback deadlocked on the registry's lock"
    assert reg.lookup(1) is None


def test_unregister_and_clear():
    reg = WeakKeyedRegistry()
    a, b = Obj(), Obj()
    reg.register(1, a)
    reg.register(2, b)
    assert reg.unregister(1) is True
    assert reg.unregister(1) is False
    reg.clear()
    assert len(reg) == 0


def test_unweakrefable_object_is_type_error():
    with pytest.raises(TypeError):
        WeakKeyedRegistry().register(1, 5)
