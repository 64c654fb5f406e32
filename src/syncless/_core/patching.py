"""Reversible, composable patches of torch attributes that leave other libraries' patches alone.

``syncless.syncs`` and ``syncless.cc`` both wrap ``Tensor.to``,
``Tensor.cuda``, ``Tensor.copy_`` and the synchronize calls. Each patch is a
*layer* with a rank; the layers compose as ``layer_n(...layer_1(base))`` in
rank order, so two capabilities compose whichever installs first, and either
can leave without undoing the other. ``base`` is whatever the attribute was
when the first layer arrived; it comes back (by identity) when the last layer
leaves.

Ranks: lower is closer to the base. The CC emulator sits lowest (it stands
for the driver), the CC shim above it, the sync detector on top (it sees the
user's call, not syncless's internal copies).

Another library may patch the same attribute after syncless (it saves what
it finds, our function, and calls it from its own). So that its patch keeps
working and survives us, the attribute holds one *entry* per chain for the
chain's whole life: a small function that calls the current composition.
Adding or removing a layer re-points the entry and never reassigns the
attribute. When the last layer leaves:

* the attribute is still our entry: the base comes back by identity;
* someone else's function is there: it stays; our entry, which it may call,
  becomes a plain pass-through to the base.

An entry costs one Python call per use. torch keeps a few tables keyed by
its own method objects (``UninitializedParameter``'s allowed methods,
``torch.overrides``' tensor-method set and name index); while an entry
fronts such a method it is listed there too, so a ``__torch_function__``
that receives ``func`` (the entry, the attribute as it is at call time)
finds it (:func:`_list_beside`). torch.compile's own tables of tensor
methods and torch callables are built once from the attributes as they are
then: they are built before the first entry arrives (if dynamo is loaded)
and forgotten when the last one leaves (:func:`_prime_compiler_tables`).
Attributes that are classes (cc's
``torch.Event``) or static/class methods cannot be fronted by a function
without changing what they are; they are replaced directly, as before, and a
layer change under another library's later patch of them is refused with a
warning (see ``docs/syncs.md``, "Composition with other libraries").
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import threading
import types
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

# Plain callables a function can stand in for: as a module attribute, or as a class attribute that binds
# like a method (Tensor.to is a method descriptor, Stream.synchronize a function).
_FRONTABLE = (types.FunctionType, types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)


def _current(owner: Any, name: str) -> Any:
    """The attribute as it is set now (on a class: in its own ``__dict__`` only, not inherited)."""
    if isinstance(owner, type):
        return owner.__dict__.get(name, _MISSING)
    return getattr(owner, name, _MISSING)


def _can_front(owner: Any, name: str) -> bool:
    raw = inspect.getattr_static(owner, name)
    return isinstance(raw, _FRONTABLE)


def _method_tables() -> list[Any]:
    """The tables torch keys by its own callables (by identity), as they exist now; none is built here.

    * ``UninitializedTensorMixin._allowed_methods``: a lazy module's
      ``__torch_function__`` lets through only the methods listed (it gets the
      attribute as it is at call time: an entry while syncless is installed).
    * ``torch.overrides._get_tensor_methods()`` and the name index of
      ``_get_overridable_functions()`` (``is_tensor_method_or_property``,
      ``resolve_name``), once built (both are caches built on first use).
    """
    tables: list[Any] = []
    parameter = sys.modules.get("torch.nn.parameter")
    mixin = getattr(parameter, "UninitializedTensorMixin", None)
    allowed = getattr(mixin, "_allowed_methods", None)
    if isinstance(allowed, list):
        tables.append(allowed)
    overrides = sys.modules.get("torch.overrides")
    for name, pick in (("_get_tensor_methods", None), ("_get_overridable_functions", 1)):
        cached = getattr(overrides, name, None)
        info = getattr(cached, "cache_info", None)
        if info is None or not info().currsize:
            continue  # not built yet: it will be built from the attributes as they are then
        table = cached() if pick is None else cached()[pick]
        if isinstance(table, (list, set, dict)):
            tables.append(table)
    return tables


def _script_builtins() -> dict | None:
    """TorchScript's table of builtin callables (``id(fn) -> "aten::op"``), if torch.jit is loaded."""
    builtins = sys.modules.get("torch.jit._builtins")
    get_table = getattr(builtins, "_get_builtin_table", None)
    return get_table() if callable(get_table) else None


def _list_beside(known: Any, new: Any) -> None:
    """Wherever a torch table lists ``known``, list ``new`` too (in a dict: with the same value).

    TorchScript's builtin table too: it compiles a call of ``torch.as_tensor`` by the callable's identity, so an
    entry in its place must map to the same op (``torch.jit.script`` of a function calling it failed otherwise).
    """
    script = _script_builtins()
    if script is not None and id(known) in script and id(new) not in script:
        script[id(new)] = script[id(known)]
    for table in _method_tables():
        if known not in table or new in table:
            continue
        if isinstance(table, dict):
            table[new] = table[known]
        elif isinstance(table, set):
            table.add(new)
        else:
            table.append(new)


def _unlist(gone: Any, keep: Any) -> None:
    """Take ``gone`` out of torch's tables, listing ``keep`` wherever ``gone`` was."""
    _list_beside(gone, keep)
    script = _script_builtins()
    if script is not None and id(keep) in script:
        script.pop(id(gone), None)  # keyed by id: a later object at the same address must not inherit the op
    for table in _method_tables():
        if gone not in table:
            continue
        if isinstance(table, dict):
            del table[gone]
        elif isinstance(table, set):
            table.discard(gone)
        else:
            table.remove(gone)


def _prime_compiler_tables() -> None:
    """Build dynamo's tables of tensor methods and torch callables now, from torch's own attributes.

    Both are caches built on first use from ``getattr(torch.Tensor, name)``
    and friends; built while an entry is installed, they would lack the
    method beneath it, which our wrappers call while compiling (an unbound
    ``torch.Tensor.to(x, ...)`` would then break the graph, even after we
    leave). Cheap once dynamo is loaded; dynamo is never imported here.
    """
    rules = sys.modules.get("torch._dynamo.trace_rules")
    for name in ("get_tensor_method", "get_torch_obj_rule_map"):
        build = getattr(rules, name, None)
        if callable(build):
            build()
    build = _dynamo_handlers()
    if build is not None:
        build()
    # torch's set of factory functions a default device applies to (``torch.set_default_device``, ``with
    # torch.device(...)``), keyed by the function: built while an entry is installed it held the entry, while the
    # device mode is handed torch's own function, so ``torch.as_tensor``/``torch.asarray`` ignored the default
    # device, for the process (found in review). A small module of torch's own, imported here if it is not yet.
    import torch.utils._device as device_module

    constructors = getattr(device_module, "_device_constructors", None)
    if callable(constructors):
        constructors()


def forget_dynamo_class_table() -> None:
    """Drop dynamo's cached set of classes it builds in the graph (``torch.Event`` among them, by identity), so it is
    built again from the class there now: after a class is replaced (``torch.Event`` while cc is installed) and
    after it is restored (found in review: built with either, ``torch.Event(...)`` in a ``fullgraph=True`` region
    failed with the other, after ``uninstall()`` too)."""
    variables = sys.modules.get("torch._dynamo.variables.user_defined")
    table = getattr(getattr(variables, "UserDefinedClassVariable", None), "_in_graph_classes", None)
    clear = getattr(table, "cache_clear", None)
    if callable(clear):
        clear()


def _dynamo_handlers() -> Any:
    """dynamo's cached table of the torch callables it handles specially (``torch.cuda.synchronize`` among them),
    keyed by the callable; None where this torch has none or dynamo is not loaded.

    Built while an entry is installed it is keyed by the entry, and torch's own callable, which our wrappers pass
    a call to while compiling, then lost its handling, for the process (found in review: a
    ``torch.cuda.synchronize`` in a ``fullgraph=True`` region failed to trace, after ``uninstall()`` too).
    """
    variables = sys.modules.get("torch._dynamo.variables.torch")
    handlers = getattr(getattr(variables, "TorchInGraphFunctionVariable", None), "_get_handlers", None)
    return handlers if callable(handlers) and callable(getattr(handlers, "cache_clear", None)) else None


def _forget_compiler_tables() -> None:
    """Drop dynamo's cached tables (they may have been built while our entries were installed)."""
    handlers = _dynamo_handlers()
    if handlers is not None:
        handlers.cache_clear()
    rules = sys.modules.get("torch._dynamo.trace_rules")
    clear = getattr(rules, "clear_lru_cache", None)
    if callable(clear):
        clear()
        return
    for name in ("get_tensor_method", "get_torch_obj_rule_map"):
        cache_clear = getattr(getattr(rules, name, None), "cache_clear", None)
        if callable(cache_clear):
            cache_clear()


def _make_entry(base: Any) -> tuple[Callable[..., Any], Callable[..., None]]:
    """Return (entry, retarget): entry calls whatever retarget last pointed it at (first: ``base``).

    ``retarget(fn, idle_when=None, beneath=None)``: with ``idle_when`` (the
    top layer's C callable of no arguments), a call while it returns a falsy
    value goes to ``beneath`` (the layers under the top one) directly, so a
    layer with nothing to do costs the entry's one Python call and no call of
    its own. dynamo never traces the entry (``idle_when`` is not traceable):
    its ``_torchdynamo_inline`` names ``fn``, which dynamo traces instead.
    """
    target = base
    idle: Callable[[], Any] | None = None
    below = base

    # Named like the base ("to", "copy_", "synchronize", ...), its doc, and __wrapped__ set to it, so that
    # inspect.signature and inspect.unwrap give the torch callable.
    @functools.wraps(base)
    def entry(*args: Any, **kwargs: Any) -> Any:
        if idle is not None and not idle():
            return below(*args, **kwargs)
        return target(*args, **kwargs)

    def retarget(fn: Any, idle_when: Callable[[], Any] | None = None, beneath: Any = None) -> None:
        nonlocal target, idle, below
        idle = None  # never a bypass that points at what is being replaced
        target = fn
        if isinstance(fn, types.FunctionType):
            entry._torchdynamo_inline = fn  # type: ignore[attr-defined]
        else:
            entry.__dict__.pop("_torchdynamo_inline", None)  # a C method: dynamo may trace the entry itself
        if idle_when is not None and beneath is not None and isinstance(fn, types.FunctionType):
            below = beneath
            idle = idle_when

    return entry, retarget


@dataclass
class _Chain:
    owner: Any
    name: str
    base: Any
    base_was_own: bool
    layers: dict[str, tuple[int, Wrapper]] = field(default_factory=dict)
    idle: dict[str, Callable[[], Any]] = field(default_factory=dict)  # per layer: "nothing to do now" (see add_layer)
    below: dict[str, Any] = field(default_factory=dict)
    entry: Any = None  # what the attribute was set to
    retarget: Callable[..., None] | None = None  # None: replaced directly, no entry

    def compose(self) -> Any:
        fn = self.base
        self.below = {}
        for key, (_, wrap) in sorted(self.layers.items(), key=lambda item: item[1][0]):
            self.below[key] = fn
            fn = wrap(fn)
        return fn

    def rebuild(self) -> None:
        composed = self.compose()
        if self.retarget is not None:
            # Whoever holds the entry (the attribute, or a library that patched over it) sees the change.
            top = max(self.layers, key=lambda key: self.layers[key][0])
            self.retarget(composed, self.idle.get(top), self.below.get(top))
            return
        current = _current(self.owner, self.name)
        if self.entry is not None and current is not self.entry:
            _log.warning("%s.%s was patched by another library after syncless; syncless leaves that patch in place "
                         "and cannot change its own layers beneath it", _label(self.owner), self.name)
            return
        self.entry = composed
        setattr(self.owner, self.name, composed)

    def restore(self) -> None:
        current = _current(self.owner, self.name)
        if current is not self.entry:
            # Another library patched over us: keep its patch; our entry, which it calls, passes straight through.
            if self.retarget is not None:
                self.retarget(self.base)
                _retired[id(self.entry)] = (self.entry, self.base, self.base_was_own)
                _list_beside(self.entry, self.base)  # the entry stays listed: the other library still calls it
            else:
                _log.warning("%s.%s was patched by another library after syncless; syncless leaves that patch "
                             "in place, with syncless's layers still beneath it", _label(self.owner), self.name)
            return
        if self.base_was_own:
            setattr(self.owner, self.name, self.base)
        else:
            delattr(self.owner, self.name)
        if self.retarget is not None:
            # A reference to the entry taken while installed (an alias, a functools.partial, a table built
            # then) passes straight through to the base from now on, never through a layer that has left.
            self.retarget(self.base)
            _unlist(self.entry, self.base)


def _label(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None) or repr(owner)


_chains: dict[tuple[int, str], _Chain] = {}
# Entries whose chain ended under another library's patch: id -> (entry, base, base_was_own). If that library
# later puts our entry back, the next chain on the attribute starts from the base, not from the pass-through.
_retired: dict[int, tuple[Any, Any, bool]] = {}


def add_layer(owner: Any, name: str, key: str, rank: int, wrap: Wrapper,
              idle: Callable[[], Any] | None = None) -> None:
    """Wrap ``owner.name`` with ``wrap(next_fn)`` at ``rank``; idempotent per ``key``.

    ``wrap`` receives the function beneath it (the base or a lower layer) and
    returns the new callable. ``idle``, for a layer that often has nothing to
    do: a callable of no arguments (a C one, such as ``ContextVar.get``) that
    is falsy while the layer would only pass the call on; while this layer is
    the top one, the entry then calls the layer beneath directly.
    """
    with _lock:
        chain_key = (id(owner), name)
        chain = _chains.get(chain_key)
        if chain is None:
            own = not isinstance(owner, type) or name in owner.__dict__
            base = getattr(owner, name)
            retired = _retired.get(id(base))
            taken_back = None  # our old pass-through, if that is what the attribute holds
            if retired is not None and retired[0] is base:
                # Our own pass-through, put back by a library that patched over us: start from what it passes to.
                del _retired[id(base)]
                taken_back = base
                base, own = retired[1], retired[2]
            chain = _Chain(owner, name, base, own)
            if not _chains:
                _prime_compiler_tables()
            if _can_front(owner, name):
                chain.entry, chain.retarget = _make_entry(base)
                _list_beside(base, chain.entry)
                setattr(owner, name, chain.entry)
                if taken_back is not None:
                    _unlist(taken_back, base)  # the old pass-through is replaced: torch's tables drop it
            _chains[chain_key] = chain
        if key in chain.layers:
            return
        chain.layers[key] = (rank, wrap)
        if idle is not None:
            chain.idle[key] = idle
        chain.rebuild()


def remove_layer(owner: Any, name: str, key: str) -> None:
    """Remove layer ``key`` from ``owner.name``; restore the base when none is left."""
    with _lock:
        chain_key = (id(owner), name)
        chain = _chains.get(chain_key)
        if chain is None or key not in chain.layers:
            return
        del chain.layers[key]
        chain.idle.pop(key, None)
        if chain.layers:
            chain.rebuild()
        else:
            chain.restore()
            del _chains[chain_key]
            if not _chains:
                # Only once every attribute is torch's again: rebuilt earlier, they would lack the methods
                # beneath the entries still installed.
                _forget_compiler_tables()


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
