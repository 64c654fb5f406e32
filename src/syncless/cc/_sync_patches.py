"""Event/stream/device ordering and synchronization that also cover offloaded D2H copies.

Each offloaded copy has a job number on its D2H stream's own worker
(:class:`._d2h._D2HStream`), and each D2H stream remembers its last one. An offloaded copy is not on any GPU stream
when its call returns, so whatever torch would order after it on ``D`` is
ordered here, on the host, before the call goes on (see :mod:`._d2h`):

- recording an event, on any stream, stamps it with every offloaded copy
  issued before the record (the seed's any-event rule: under CC without
  the shim those copies had finished when their calls returned); a
  synchronize or query of the event covers those jobs (and raises the
  first failure among them), and so does *waiting* on it from another
  stream (``P.wait_event(e)``, and ``P.wait_stream(S)``, which records such
  an event): the host waits for the jobs before it enqueues the GPU wait;
- synchronizing or querying a D2H stream covers its jobs; a device
  synchronize covers every job submitted before the call; synchronizing an
  ordinary stream covers every job too, conservatively.

What is covered:
- ``torch.cuda.Event``: ``record``, ``wait``, ``synchronize``, ``query`` (all
  events, whenever they were created: the class's methods are patched), so
  also ``torch.cuda.Stream.wait_stream``/``wait_event``/``record_event``.
- ``torch.cuda.Stream`` (and ``ExternalStream``): ``synchronize``, ``query``.
- ``torch.cuda.synchronize`` and ``torch.accelerator.synchronize`` (looked
  up through the module; a reference taken before ``install()`` is not
  covered).
- ``torch.cuda.CUDAGraph.capture_begin`` / ``capture_end`` (queued copies
  finish first; nothing is offloaded while a capture is open).
- Copies that bypass ``Tensor.to/cuda/copy_`` (:mod:`._bypass`).
- ``torch.Event``: a C type whose methods cannot be patched, so
  ``torch.Event`` is *replaced* by a subclass while installed. Only events
  created afterwards through ``torch.Event(...)`` are covered;
  ``torch.Stream.record_event()`` and other C code still make plain
  ``torch.Event`` objects, which are not covered. ``isinstance`` and
  ``issubclass`` against the new ``torch.Event`` answer as against torch's
  own (:func:`_covering_event_type`), for events made before ``install()`` too.
"""

from __future__ import annotations

from typing import Any

from syncless._core import patching
from syncless.cc import _bypass, _d2h, _streams, _worker
from syncless.cc._layers import SHIM_KEY

_MARK = "_syncless_d2h_seq"


def _mark(event: Any) -> None:
    """Stamp ``event``, being recorded now on any stream, with every offloaded copy issued before this call.

    The seed's rule (docs/cc.md, "After the copy"): an event recorded after an offloaded copy's call covers it,
    whichever stream it is recorded on, because under CC without the shim that copy had finished when its call
    returned. The stamp is a tuple of tickets (a worker, the number of its last job; :func:`._d2h.cover_now`).
    The stream it goes on does not matter. Costs two integer reads while nothing is pending. An event
    re-recorded with nothing pending loses an old stamp.
    """
    cover = _d2h.cover_now()
    try:
        if cover or getattr(event, _MARK, None) is not None:
            setattr(event, _MARK, cover or None)
    except AttributeError:  # a C-made torch.Event has no __dict__: not covered (documented)
        pass


def _wait_marked(event: Any) -> None:
    """The host waits for the offloaded copies ``event`` stands for and raises the first failure among them this
    thread has not seen: before ``event.synchronize()``, and before a stream's GPU wait on it is enqueued."""
    tickets = getattr(event, _MARK, None)
    if tickets:
        _d2h.wait_for_tickets(list(tickets), raise_errors=True)


def _marked_pending(event: Any) -> bool:
    """Whether a copy ``event`` covers is unfinished; if none is, raise the first failure among them that this
    thread issued (a query must not say True for a failed copy: docs/cc.md, "errors")."""
    tickets = getattr(event, _MARK, None)
    if not tickets:
        return False
    if _kicked_if_pending(tickets):
        return True
    _d2h.wait_for_tickets(list(tickets), raise_errors=True)  # all finished: waits for nothing
    return False


def _kicked_if_pending(tickets: Any) -> bool:
    """Whether a copy among ``tickets`` is unfinished; the queue of each unfinished one is kicked (its thread runs
    what is queued now, not after the grace period: a program that polls ``query()`` sees its copy land about when
    torch's would, once the GPU work it reads is done). Does not block."""
    pending = False
    for ticket in tickets:
        if _d2h.ticket_pending(ticket):
            ticket[0].kick()
            pending = True
    return pending


def _cover_all() -> list:
    """Tickets for every copy offloaded so far, of every D2H stream."""
    return _d2h.all_tickets()


# Reading a call ----------------------------------------------------------------------
# Every wrapper takes ``*args, **kwargs`` and passes them on untouched, so torch reads the call itself: its
# forms, errors and messages stay its own. A wrapper acts only on a form it understands (the object first,
# then torch's own parameters); any other goes on as given, and torch accepts or refuses it.


def _only_self(args: tuple, kwargs: dict, cls: type) -> Any:
    """The object of a call ``method(self)`` on an instance of ``cls``, or None for any other form."""
    if len(args) != 1 or kwargs or not isinstance(args[0], cls):
        return None
    return args[0]


def _self_and_stream(args: tuple, kwargs: dict, cls: type) -> tuple[Any, Any] | None:
    """``(self, stream)`` of a call ``method(self, stream=None)`` on an instance of ``cls``, or None for any other."""
    if not args or len(args) > 2 or not kwargs.keys() <= {"stream"} or (len(args) == 2 and kwargs):
        return None
    if not isinstance(args[0], cls):
        return None
    return args[0], (args[1] if len(args) == 2 else kwargs.get("stream"))


# torch.cuda.Event ------------------------------------------------------------------


def _event_class() -> type:
    import torch

    return torch.cuda.Event


def _compiling():
    """torch's own ``is_compiling`` (dynamo folds it to True while tracing): every wrapper here asks it first and
    passes the call straight on while dynamo traces, so no wrapper's reads of the shim's state (the jobs, the
    covers) become guards of a compiled frame, recompiling it at each offloaded copy. The compiled graph's ops call
    the patched methods at run time (dynamo's stream and event ops call them through torch's modules)."""
    import torch

    return torch.compiler.is_compiling


def _wrap_event_record(next_record):
    event_class = _event_class()
    compiling = _compiling()

    def record(*args, **kwargs):
        if compiling():
            return next_record(*args, **kwargs)
        call = _self_and_stream(args, kwargs, event_class)
        if call is not None:
            _mark(call[0])
        return next_record(*args, **kwargs)

    return record


def _wrap_event_wait(next_wait):
    event_class = _event_class()
    compiling = _compiling()

    def wait(*args, **kwargs):
        if compiling():
            return next_wait(*args, **kwargs)
        call = _self_and_stream(args, kwargs, event_class)
        if call is not None:
            _wait_marked(call[0])
        return next_wait(*args, **kwargs)

    return wait


def _wrap_event_synchronize(next_sync):
    event_class = _event_class()
    compiling = _compiling()

    def synchronize(*args, **kwargs):
        if compiling():
            return next_sync(*args, **kwargs)
        result = next_sync(*args, **kwargs)
        event = _only_self(args, kwargs, event_class)
        if event is not None:
            _wait_marked(event)
        return result

    return synchronize


def _wrap_event_query(next_query):
    event_class = _event_class()
    compiling = _compiling()

    def query(*args, **kwargs):
        if compiling():
            return next_query(*args, **kwargs)
        event = _only_self(args, kwargs, event_class)
        if event is not None and _marked_pending(event):
            return False
        return next_query(*args, **kwargs)

    return query


# torch.cuda.Stream -------------------------------------------------------------------


def _stream_class() -> type:
    import torch

    return torch.cuda.Stream


def _stream_jobs(stream: Any) -> list:
    """The jobs a synchronize of ``stream`` covers (tickets): its own on a D2H stream, every one elsewhere."""
    record = _d2h.lookup(stream)
    if record is not None:
        return [(record.worker, record.last_job)] if record.last_job else []
    return _cover_all()


def _wrap_stream_synchronize(next_sync):
    stream_class = _stream_class()
    compiling = _compiling()

    def synchronize(*args, **kwargs):
        if compiling():
            return next_sync(*args, **kwargs)
        stream = _only_self(args, kwargs, stream_class)
        if stream is None:
            return next_sync(*args, **kwargs)  # torch refuses the call
        tickets = _stream_jobs(stream)
        result = next_sync(*args, **kwargs)
        _d2h.wait_for_tickets(tickets, raise_errors=True)
        return result

    return synchronize


def _wrap_stream_query(next_query):
    stream_class = _stream_class()
    compiling = _compiling()

    def query(*args, **kwargs):
        if compiling():
            return next_query(*args, **kwargs)
        stream = _only_self(args, kwargs, stream_class)
        if stream is not None and (_d2h.pending() or _worker.UNRAISED[0]):
            tickets = _stream_jobs(stream)
            if _kicked_if_pending(tickets):
                return False
            _d2h.wait_for_tickets(tickets, raise_errors=True)  # all finished: raises this thread's failure, if any
        return next_query(*args, **kwargs)

    return query


# device-wide -------------------------------------------------------------------------


def _wrap_device_synchronize(next_sync):
    compiling = _compiling()

    def synchronize(*args, **kwargs):
        if compiling():
            return next_sync(*args, **kwargs)  # the graph's op calls torch.accelerator.synchronize (patched) at run time
        # Whatever the device argument, the wait covers every job submitted before the call (conservative).
        tickets = _cover_all()
        result = next_sync(*args, **kwargs)
        _d2h.wait_for_tickets(tickets, raise_errors=True)
        return result

    return synchronize


# CUDA graph capture -------------------------------------------------------------------
# A capture in global mode (torch's default) is invalidated when any other thread makes a potentially unsafe call,
# such as the worker's host synchronize of its ready event or stream. So a capture begun through CUDAGraph (which
# torch.cuda.graph and make_graphed_callables use) first lets the queued copies finish, and while it is open nothing
# is offloaded and the emulator makes no wait (_streams.CAPTURES):
#
#   host   : capture_begin -> [wait for jobs #..n] -> begin ... capture_end
#   worker : ... #n done                              (idle: no offload while capturing)


def _wrap_capture_begin(next_begin):
    return _streams.wrap_capture_begin(next_begin, before=_d2h.begin_capture)


_wrap_capture_end = _streams.wrap_capture_end


# torch.Event -------------------------------------------------------------------------


def _wrap_torch_event(base):
    # Each method takes what the caller gave and calls the base class's (a C method) with it unchanged, so
    # torch reads the call; only torch's own forms are acted on.
    compiling = _compiling()

    def record(*args, **kwargs):
        call = None if compiling() else _self_and_stream(args, kwargs, Event)
        if call is not None:
            _mark(call[0])
        return base.record(*args, **kwargs)

    def wait(*args, **kwargs):
        call = None if compiling() else _self_and_stream(args, kwargs, Event)
        if call is not None:
            _wait_marked(call[0])
        return base.wait(*args, **kwargs)

    def synchronize(*args, **kwargs):
        result = base.synchronize(*args, **kwargs)
        event = None if compiling() else _only_self(args, kwargs, Event)
        if event is not None:
            _wait_marked(event)
        return result

    def query(*args, **kwargs):
        event = None if compiling() else _only_self(args, kwargs, Event)
        if event is not None and _marked_pending(event):
            return False
        return base.query(*args, **kwargs)

    methods = {"record": record, "wait": wait, "synchronize": synchronize, "query": query}
    for name, method in methods.items():
        method.__name__ = name
        method.__qualname__ = f"{base.__qualname__}.{name}"
        method.__doc__ = getattr(getattr(base, name, None), "__doc__", None)
    Event = _covering_event_type(base)(base.__name__, (base,), {
        **methods,
        "__doc__": "``torch.Event`` whose record/wait/synchronize/query also cover syncless's D2H copies.",
        "_syncless_covers": True,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
    })
    return Event


def _covering_event_type(base: type) -> type:
    """The metaclass of the ``torch.Event`` put in while installed: ``isinstance`` and ``issubclass`` against it
    answer as against torch's own ``base``.

    Without it every event torch makes in C (``torch.Stream.record_event()``, and on CUDA builds every
    ``torch.cuda.Event``, whose C type derives from ``base``) stopped being a ``torch.Event`` while installed, and
    dynamo, which tells events by ``isinstance(value, torch.Event)`` read as it traces, no longer knew them: their
    ``record``/``wait``/``synchronize``/``query`` broke a ``torch.compile(fullgraph=True)`` region (found in
    review). Derived from ``base``'s own metaclass, so the class is a valid subclass of it.
    """

    class CoveringEventType(type(base)):
        # Only the covering class itself answers as ``base``: a subclass of it defined while installed (torch's own
        # _EventBase, a program's) keeps Python's own answer (found in review: every subclass claimed every event).
        def __instancecheck__(cls, obj: Any) -> bool:
            if "_syncless_covers" in cls.__dict__:
                return isinstance(obj, base)
            return type.__instancecheck__(cls, obj)

        def __subclasscheck__(cls, sub: type) -> bool:
            if "_syncless_covers" in cls.__dict__:
                return issubclass(sub, base)
            return type.__subclasscheck__(cls, sub)

    return CoveringEventType


def patch_targets() -> list[tuple[Any, str, Any]]:
    """Return ``(owner, attribute, wrapper)`` for every patch the shim installs besides ``Tensor.to/cuda/copy_`` and
    the blocking reads: synchronization, CUDA graph capture, and the copies that bypass those wrappers."""
    import torch

    targets = [
        (torch.cuda.Event, "record", _wrap_event_record),
        (torch.cuda.Event, "wait", _wrap_event_wait),
        (torch.cuda.Event, "synchronize", _wrap_event_synchronize),
        (torch.cuda.Event, "query", _wrap_event_query),
        (torch.cuda.Stream, "synchronize", _wrap_stream_synchronize),
        (torch.cuda.Stream, "query", _wrap_stream_query),
        (torch.cuda, "synchronize", _wrap_device_synchronize),
        (torch, "Event", _wrap_torch_event),
    ]
    targets += _bypass.patch_targets()  # copies that bypass Tensor.to/cuda/copy_ (issue 27 item 1)
    graph = getattr(torch.cuda, "CUDAGraph", None)
    if graph is not None and "capture_begin" in vars(graph) and "capture_end" in vars(graph):
        targets += [(graph, "capture_begin", _wrap_capture_begin), (graph, "capture_end", _wrap_capture_end)]
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        targets.append((accelerator, "synchronize", _wrap_device_synchronize))
    return targets


# The layers that only cover offloaded copies: with none unfinished and no failure kept (``_d2h.busy()`` False) they
# have nothing to do, so the patch's entry calls torch directly (``patching.add_layer``'s ``idle``): a decode step's
# record, wait, synchronize and indexed write then cost one check each, not a wrapper's reading of the call. The
# capture hooks always run (they note every capture); ``torch.Event`` is a class, replaced outright.
_IDLE_WHEN_NOTHING_PENDING = {"record", "wait", "synchronize", "query", "__setitem__", "new_tensor", "as_tensor",
                              "asarray", "copy_"}


def install_sync_patches() -> None:
    """Add the shim's layer to every synchronization entry point (idempotent per attribute)."""
    _streams.start_noting("shim")
    for owner, name, wrap in patch_targets():
        idle = _d2h.busy if name in _IDLE_WHEN_NOTHING_PENDING else None
        patching.add_layer(owner, name, SHIM_KEY, patching.RANK_CC_SHIM, wrap, idle=idle)
    patching.forget_dynamo_class_table()  # torch.Event is the covering class now


def uninstall_sync_patches() -> None:
    """Remove the shim's layer from every synchronization entry point."""
    for owner, name, _ in patch_targets():
        patching.remove_layer(owner, name, SHIM_KEY)
    patching.forget_dynamo_class_table()  # torch.Event is torch's own again
    _streams.stop_noting("shim")
