"""Reversible, composable patches of torch attributes.

``syncless.syncs`` and ``syncless.cc`` both wrap ``Tensor.to``,
``Tensor.cuda`` and ``Tensor.copy_``. Each patch is a *layer* with a rank;
the attribute is rebuilt as ``layer_n(...layer_1(base))`` in rank order, so
two capabilities compose whichever installs first, and either can leave
without undoing the other. ``base`` is whatever the attribute was when the
first layer arrived; it comes back (by identity) when the last layer leaves.

Ranks: lower is closer to the base. The CC emulator sits lowest (it stands
for the driver), the CC shim above it, the sync detector on top (it sees the
user's call, not syncless's internal copies).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

RANK_CC_EMULATION = 10
RANK_CC_SHIM = 20
RANK_SYNC_DETECTOR = 30

Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]

_log = logging.getLogger(__name__)
_lock = threading.RLock()
_MISSING = object()


@dataclass
class _Chain:
    owner: Any
    name: str
    base: Any
    base_was_own: bool
    layers: dict[str, tuple[int, Wrapper]] = field(default_factory=dict)
    installed: Any = None
    below: dict[str, Any] = field(default_factory=dict)

    def rebuild(self) -> None:
        current = self.owner.__dict__.get(self.name, _MISSING) if isinstance(self.owner, type) else getattr(self.owner, self.name, _MISSING)
        if self.installed is not None and current is not self.installed:
            _log.warning("%s.%s was replaced by someone else; syncless re-applies its layers over the saved original",
                         getattr(self.owner, "__name__", self.owner), self.name)
        fn = self.base
        self.below = {}
        for key, (_, wrap) in sorted(self.layers.items(), key=lambda item: item[1][0]):
            self.below[key] = fn
            fn = wrap(fn)
        self.installed = fn
        setattr(self.owner, self.name, fn)

    def restore(self) -> None:
        if self.base_was_own:
            setattr(self.owner, self.name, self.base)
        else:
            delattr(self.owner, self.name)


_chains: dict[tuple[int, str], _Chain] = {}


def add_layer(owner: Any, name: str, key: str, rank: int, wrap: Wrapper) -> None:
    """Wrap ``owner.name`` with ``wrap(next_fn)`` at ``rank``; idempotent per ``key``.

    ``wrap`` receives the function beneath it (the base or a lower layer) and
    returns the new callable.
    """
    with _lock:
        chain_key = (id(owner), name)
        chain = _chains.get(chain_key)
        if chain is None:
            own = isinstance(owner, type) and name in owner.__dict__ or not isinstance(owner, type)
            chain = _Chain(owner, name, getattr(owner, name), own)
            _chains[chain_key] = chain
        if key in chain.layers:
            return
        chain.layers[key] = (rank, wrap)
        chain.rebuild()


def remove_layer(owner: Any, name: str, key: str) -> None:
    """Remove layer ``key`` from ``owner.name``; restore the base when none is left."""
    with _lock:
        chain_key = (id(owner), name)
        chain = _chains.get(chain_key)
        if chain is None or key not in chain.layers:
            return
        del chain.layers[key]
        if chain.layers:
            chain.rebuild()
        else:
            chain.restore()
            del _chains[chain_key]


def original(owner: Any, name: str) -> Any:
    """Return ``owner.name`` as it was before any syncless layer."""
    with _lock:
        chain = _chains.get((id(owner), name))
        return getattr(owner, name) if chain is None else chain.base


def beneath(owner: Any, name: str, key: str) -> Any:
    """Return the callable directly beneath layer ``key`` (what it wraps now)."""
    with _lock:
        chain = _chains.get((id(owner), name))
        if chain is None or key not in chain.below:
            return original(owner, name)
        return chain.below[key]


def is_layered(owner: Any, name: str, key: str | None = None) -> bool:
    """Return whether ``owner.name`` carries layer ``key`` (any layer if None)."""
    with _lock:
        chain = _chains.get((id(owner), name))
        if chain is None:
            return False
        return True if key is None else key in chain.layers
