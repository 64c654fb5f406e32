"""Bookkeeping for registered in-place H2D targets and D2H streams (plain Python).

Entries are keyed by what the shim can read off a tensor or a stream cheaply
(device index and storage address, or device index and stream handle).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable
from typing import Any


class WeakKeyedRegistry:
    """Map keys to live objects; an entry lapses when its object dies.

    A later object at the same key (a new tensor at a reused address) does not
    match an entry whose object is gone, and the old object's death never
    removes the new object's entry.
    """

    def __init__(self) -> None:
        # Reentrant: a garbage collection inside a locked section may run a lapse callback on this thread.
        self._lock = threading.RLock()
        self._entries: dict[Hashable, weakref.ref] = {}

    def register(self, key: Hashable, obj: Any) -> bool:
        """Register ``obj`` under ``key``; return True if this is a new registration.

        Raises:
            TypeError: ``obj`` cannot be weakly referenced.
        """
        with self._lock:
            current = self._entries.get(key)
            if current is not None and current() is obj:
                return False
            ref = weakref.ref(obj, self._make_lapse(key))
            self._entries[key] = ref
            return True

    def _make_lapse(self, key: Hashable):
        def lapse(ref: weakref.ref) -> None:
            with self._lock:
                if self._entries.get(key) is ref:
                    del self._entries[key]

        return lapse

    def lookup(self, key: Hashable) -> Any | None:
        """Return the live object under ``key``, or None."""
        ref = self._entries.get(key)
        return None if ref is None else ref()

    def unregister(self, key: Hashable) -> bool:
        """Remove ``key``; return whether it was there."""
        with self._lock:
            return self._entries.pop(key, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for ref in self._entries.values() if ref() is not None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
