"""Bookkeeping of registered in-place H2D targets: keyed by storage and bytes, weak, lapsing with the tensor."""

import gc
import threading
import weakref

import torch

from syncless.cc import _staging


def test_register_lookup_and_lapse():
    target = torch.randn(64)
    assert _staging._remember_target(target) is True
    assert _staging._remember_target(target) is False  # idempotent
    assert _staging.is_registered_target(target)
    assert _staging.is_registered_target(target[5:17])  # a view shares the storage
    assert not _staging.is_registered_target(torch.randn(64))
    del target
    gc.collect()
    assert not _staging.live_targets()


def test_new_target_at_same_key_survives_old_death():
    old = torch.randn(32)
    _staging._remember_target(old)
    new = old.detach()  # another tensor on the same storage (same key) that does not keep ``old`` alive
    assert _staging._remember_target(new) is True  # replaces the entry
    old_alive = weakref.ref(old)
    del old
    gc.collect()
    assert old_alive() is None
    assert _staging._TARGETS[_staging._storage_key(new)][_staging._span(new)]() is new
    del new
    gc.collect()
    assert not _staging.live_targets()


def test_dead_target_does_not_match_a_tensor_at_its_address():
    doomed = torch.randn(1024)
    key = _staging._storage_key(doomed)
    _staging._remember_target(doomed)
    del doomed
    gc.collect()
    newcomer = torch.randn(1024)  # may reuse the address; it was never registered
    assert not _staging.is_registered_target(newcomer)
    assert not _staging.live_targets() and key  # (a dead reference stays until the next registration, vouching for nothing)
    assert _staging._remember_target(newcomer) is True
    assert _staging.is_registered_target(newcomer)


def test_lapse_during_a_locked_section_does_not_deadlock():
    doomed = torch.randn(16)
    doomed.cycle = doomed  # freed only by the collector
    _staging._remember_target(doomed)
    del doomed
    finished = threading.Event()

    def collect_while_locked():
        with _staging._target_lock:  # a collection here runs the lapse on this very thread
            gc.collect()
        finished.set()

    worker = threading.Thread(target=collect_while_locked, daemon=True)
    worker.start()
    assert finished.wait(10), "the lapse callback deadlocked on the targets' lock"
    assert not _staging.live_targets()


def test_a_target_whose_storage_moved_no_longer_vouches_for_its_old_address():
    """``resize_`` (growing), ``set_`` or ``.data =`` move a live target's storage; whatever later sits at the
    old address was never registered (found in review: it counted as registered, and its upload skipped the
    ordering after the current stream)."""
    from types import SimpleNamespace

    for move in ("resize_", "set_", "data"):
        target = torch.randn(64)
        _staging._remember_target(target)
        old_address = target.untyped_storage().data_ptr()
        # Stands for a new tensor the caching allocator puts at the old address (CPU memory cannot be forced).
        stranger = SimpleNamespace(device=target.device, data_ptr=lambda: old_address, numel=lambda: 64,
                                   shape=(64,), stride=lambda: (1,), element_size=lambda: 4,
                                   untyped_storage=lambda: SimpleNamespace(data_ptr=lambda: old_address))
        if move == "resize_":
            target.resize_(1 << 20)
        elif move == "set_":
            target.set_(torch.randn(64).untyped_storage())
        else:
            target.data = torch.randn(64)
        assert target.untyped_storage().data_ptr() != old_address, move
        assert not _staging.is_registered_target(stranger), move
        assert not _staging.is_registered_target(target), move  # registered for its old storage only
        _staging._TARGETS.clear()


def test_a_target_vouches_for_its_own_bytes_not_for_its_siblings_on_the_storage():
    """Found in review (session 26): registering one row of a pool tensor matched every tensor on its storage, so
    an upload into an unregistered row that a kernel was still reading landed in place, ordered after nothing."""
    pool = torch.zeros(4, 8)
    row0 = pool[0]
    assert _staging._remember_target(row0) is True
    assert _staging.is_registered_target(row0)
    assert _staging.is_registered_target(row0[2:6])  # a view of it
    assert _staging.is_registered_target(pool[0, ::2])  # within its bytes
    assert not _staging.is_registered_target(pool[1])  # a sibling row
    assert not _staging.is_registered_target(pool)  # the whole pool reaches past it
    assert not _staging.is_registered_target(pool[:, 0])  # a column: its first byte is row0's, the rest are not
    assert _staging._remember_target(pool[2]) is True  # a second row of the same storage, registered apart
    kept = pool[2]
    assert _staging._remember_target(kept) is True
    assert _staging.is_registered_target(pool[2, 3:]) and _staging.is_registered_target(row0)
    assert not _staging.is_registered_target(pool[3]) and not _staging.is_registered_target(pool[1:3])
    assert _staging.is_registered_target(torch.empty(0)[:0]) is False  # another storage, no bytes
    del row0, kept
    gc.collect()
    assert not _staging.is_registered_target(pool[0])


def test_a_lookup_is_safe_while_other_threads_register_and_targets_lapse():
    """The lookup walked the registry while another thread registered (found in review: ``dictionary changed size
    during iteration`` out of the user's ``copy_``); it now walks a snapshot of one storage's targets."""
    pool = torch.zeros(256, 4)
    rows = [pool[i] for i in range(0, 256, 2)]
    stop = threading.Event()
    errors = []

    def register():
        try:
            while not stop.is_set():
                for row in rows:
                    _staging._remember_target(row)
                    _staging._remember_target(pool[1][:2])  # made and dropped: lapses at once
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    thread = threading.Thread(target=register, daemon=True)
    thread.start()
    try:
        for _ in range(2000):
            assert not _staging.is_registered_target(pool[3, 1:])  # scans the storage's targets
            _staging.is_registered_target(rows[5][1:3])
    finally:
        stop.set()
        thread.join(10)
    assert not errors, errors
    assert _staging.is_registered_target(rows[7])
