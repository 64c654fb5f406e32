"""The CUPTI layer: every driver/runtime call that blocks the host, from any library.

A CUPTI subscriber (``cupti-python``, extra ``syncless[cupti]``) with only the
calls of :data:`._cupti_rules.RULES` enabled: kernel launches and every
other call never reach Python. CUPTI calls back on the thread that made the
CUDA call, with that thread's Python frames intact, at the call's entry and
exit. Entry decides whether the call blocks (for copies and memsets by
asking the driver what memory each pointer is, ``cuPointerGetAttributes``);
exit measures the host time blocked and hands a violation to the record
(:func:`._merge.cupti_event`), which merges it with torch's and the
wrappers' view of the same Python call.

Only the outermost watched call of a thread counts: a runtime call that the
driver answers with watched driver calls of its own is one call.

CUPTI allows one subscriber per process, and torch.profiler (kineto) is one:
the subscription is held from the first checked region until
``syncs.disable()`` (:mod:`._backend`), and nothing here enqueues GPU work
or blocks the host.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from types import ModuleType

from syncless._core.driver_waits import is_standing_for_the_driver
from syncless._core.cuda import DRIVER_HINT, import_optional
from syncless._core.errors import MissingDependencyError
from syncless.syncs import _cupti_rules as rules
from syncless.syncs import _merge, _report, _state, _timeline
from syncless.syncs._cupti_rules import ApiRule

INSTALL_HINT = "install it with `pip install 'syncless[cupti]'` (cupti-python matching the driver's CUDA version)"

_WORD = ctypes.c_uint64


class CuptiUnavailable(Exception):
    """CUPTI cannot be used here; the message says why (and the fix)."""

    def __init__(self, reason: str, taken: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.taken = taken  # another subscriber (torch.profiler, Nsight) holds CUPTI


def load_module() -> ModuleType:
    """Import and return ``cupti.cupti`` (cupti-python).

    Raises:
        CuptiUnavailable: cupti-python is not installed.
    """
    try:
        return import_optional("cupti", "cupti", "cupti-python", INSTALL_HINT)
    except MissingDependencyError as err:
        raise CuptiUnavailable(str(err)) from err


def _unavailable_errors(api: ModuleType) -> tuple[type[BaseException], ...]:
    """The exceptions by which cupti-python says CUPTI cannot work here."""
    errors: list[type[BaseException]] = [api.cuptiError]
    try:  # raised when libcuda or libcupti cannot be loaded
        from cupti._internal.utils import NotSupportedError
    except ImportError:
        pass
    else:
        errors.append(NotSupportedError)
    return tuple(errors)


def _result_name(api: ModuleType, err: BaseException) -> str:
    status = getattr(err, "status", None)
    if status is None:
        return str(err)
    try:
        return api.Result(status).name
    except ValueError:
        return f"CUPTI error {status}"


class PointerTypes:
    """Asks the driver what memory a pointer addresses (``cuPointerGetAttributes``), from inside callbacks.

    Called through ctypes on the driver library torch already loaded, with
    buffers made once: it runs inside CUPTI callbacks of copies, where
    cuda-bindings' argument and result conversion would cost more, and an
    address the driver does not know (pageable memory) must simply read 0.

    Raises:
        MissingDependencyError: the CUDA driver library cannot be loaded.
    """

    _MEMORY_TYPE, _IS_MANAGED = 2, 8  # CU_POINTER_ATTRIBUTE_*
    _HOST, _DEVICE = 1, 2  # CU_MEMORYTYPE_*

    def __init__(self) -> None:
        try:
            library = ctypes.CDLL("libcuda.so.1")
        except OSError as err:
            raise MissingDependencyError(f"the CUDA driver library cannot be loaded ({err}): {DRIVER_HINT}") from err
        query = library.cuPointerGetAttributes
        query.argtypes = [ctypes.c_uint, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint64]
        query.restype = ctypes.c_int
        self._query = query
        self._attributes = (ctypes.c_int * 2)(self._MEMORY_TYPE, self._IS_MANAGED)
        self._memory_type = ctypes.c_uint64(0)
        self._managed = ctypes.c_uint64(0)
        self._outputs = (ctypes.c_void_p * 2)(ctypes.addressof(self._memory_type), ctypes.addressof(self._managed))
        self._lock = threading.Lock()  # one set of buffers; ctypes lets go of the GIL during the call

    def __call__(self, address: int) -> str:
        with self._lock:
            self._memory_type.value = 0
            self._managed.value = 0
            if self._query(2, self._attributes, self._outputs, address) != 0:
                return rules.UNKNOWN
            memory_type = self._memory_type.value & 0xFFFFFFFF
            managed = self._managed.value != 0
        if managed:
            return rules.MANAGED
        if memory_type == self._HOST:
            return rules.PINNED
        if memory_type == self._DEVICE:
            return rules.DEVICE
        return rules.PAGEABLE  # not known to CUDA: ordinary pageable host memory


def _words(params_address: int, count: int) -> list[int]:
    return list((_WORD * count).from_address(params_address))


class _Watched:
    """A watched call as the callback needs it."""

    __slots__ = ("name", "rule", "kind", "fix")

    def __init__(self, name: str, rule: ApiRule):
        self.name = name
        self.rule = rule
        self.kind = rules.KINDS[rule.category]
        self.fix = rules.FIXES[rule.category]


class Subscriber:
    """One CUPTI subscription with the blocking calls enabled; :meth:`close` lets CUPTI go.

    Args:
        api: the ``cupti.cupti`` module (a stand-in in CPU tests).
        pointer_types: callable from an address to a memory type (``rules.DEVICE``, ...).

    Raises:
        CuptiUnavailable: CUPTI cannot be used (another subscriber holds it,
            the driver and cupti-python do not match, no driver, ...).
    """

    def __init__(self, api: ModuleType, pointer_types) -> None:
        self._api = api
        self._pointer_types = pointer_types
        self._local = threading.local()  # per thread: watched-call depth, and the outermost call's decision
        self._enter = int(api.ApiCallbackSite.API_ENTER)
        self._params_offset = _params_offset(api)
        self._depth_of_checks = _state.checked_depth.get
        self.watched: dict[tuple[int, int], _Watched] = {}
        package = getattr(sys.modules.get("cupti"), "__file__", None)
        if package:
            _report.skip_frames_under(os.path.dirname(package))
        errors = _unavailable_errors(api)
        try:
            # One callable object, kept alive for the life of the process (_RETIRED): a callback already running on
            # another thread when we unsubscribe must never find its callable freed under it.
            self._entry = self._callback
            _RETIRED.append(self._entry)
            self._handle = api.subscribe(self._entry, 0)
        except errors as err:
            name = _result_name(api, err)
            taken = "MULTIPLE_SUBSCRIBERS" in name
            why = ("another CUPTI subscriber holds CUPTI (torch.profiler/kineto, Nsight Systems or another tool; "
                   "CUPTI allows one per process)" if taken else f"CUPTI refused to subscribe: {name}")
            raise CuptiUnavailable(why, taken=taken) from err
        try:
            self._enable(errors)
        except CuptiUnavailable:
            api.unsubscribe(self._handle)
            raise

    def _enable(self, errors) -> None:
        api = self._api
        for domain, cbid, cbid_name, watched in _watch_list(api):
            try:
                api.enable_callback(1, self._handle, domain, cbid)
            except errors as err:
                raise CuptiUnavailable(f"CUPTI refused to enable {cbid_name}: {_result_name(api, err)}") from err
            self.watched[(int(domain), int(cbid))] = watched

    def close(self) -> None:
        """Unsubscribe: CUPTI is free for the profiler again."""
        handle, self._handle = self._handle, None
        if handle is not None:
            self._api.unsubscribe(handle)

    # -- the callback: runs on the thread that made the CUDA call -------------------------------

    def _callback(self, userdata, domain, cbid, cbdata) -> None:
        if not self._depth_of_checks():
            return  # this thread (task) is in no checked region: one ContextVar read
        if is_standing_for_the_driver():
            return  # syncless.cc waits where the driver itself would (CC emulation, the staging wait): not a sync
        watched = self.watched.get((domain, cbid))
        if watched is None:
            return
        local = self._local
        depth = getattr(local, "depth", 0)
        if cbdata.callback_site == self._enter:
            local.depth = depth + 1
            if depth:
                return  # inside another watched call of this thread: that one counts
            local.reason = None
            local.reason = self._decide(watched, cbdata)
            # A range around the call in torch.profiler / NVTX, opened before it blocks (._timeline).
            local.span = (_timeline.open_span(sys._getframe(1))
                          if local.reason is not None and _timeline.is_live() else None)
            local.started_ns = time.perf_counter_ns()
            return
        if depth == 0:
            return  # its entry came before we subscribed
        local.depth = depth - 1
        if depth > 1 or local.reason is None:
            return
        returned_ns = time.perf_counter_ns()
        if local.span is not None:
            _timeline.close_span(local.span)
        self._report(watched, local.reason, returned_ns - local.started_ns, sys._getframe(1), returned_ns)

    def _decide(self, watched: _Watched, cbdata) -> str | None:
        """Return why this call blocks the host, or None (at the call's entry)."""
        rule = watched.rule
        if rule.category in (rules.WAIT, rules.TEARDOWN):
            return rule.reason
        params = ctypes.c_void_p.from_address(cbdata.ptr + self._params_offset).value
        if not params:
            return None
        if rule.category == rules.FREE:
            return rule.reason if _words(params, 1)[0] else None  # cudaFree(NULL) frees nothing
        if rule.category == rules.MEMSET:
            return rules.memset_blocks(self._pointer_types(_words(params, 1)[0]))
        return self._decide_copy(rule.layout, params)

    def _decide_copy(self, layout: rules.CopyLayout, params: int) -> str | None:
        words = _words(params, max(layout.dst, layout.src, layout.kind or 0) + 1)
        if layout.direction == "H2D":
            src, dst = None, rules.DEVICE
        elif layout.direction == "D2H":
            src, dst = rules.DEVICE, None
        elif layout.kind is not None:
            src, dst = rules.kind_sides(words[layout.kind] & 0xFFFFFFFF)
            if (src, dst) == (rules.DEVICE, rules.DEVICE):
                return None  # device to device: decided without asking the driver
        else:
            src = dst = None
        if layout.src == rules.FROM_SYMBOL:
            src = rules.DEVICE
        if layout.dst == rules.FROM_SYMBOL:
            dst = rules.DEVICE
        if src is None:
            src = self._pointer_types(words[layout.src])
        if dst is None:
            dst = self._pointer_types(words[layout.dst])
        return rules.copy_blocks(layout.is_async, src, dst)

    def _report(self, watched: _Watched, reason: str, blocked_ns: int, start, returned_ns: int) -> None:
        if not _state.is_violation_context():
            _merge.cupti_join(start, watched.name, reason, blocked_ns)
            return
        if _report.is_under_compile(start):
            return  # compile-time work (torch.compile, triton autotuning) synchronizes by design
        # When the call returned (perf_counter_ns), on the timeline's clock (time.time_ns).
        returned_ns = time.time_ns() - (time.perf_counter_ns() - returned_ns)
        violation = _report.locate(watched.kind, rules.operation_text, watched.fix, start)
        if violation is None:
            return
        violation.at_ns = returned_ns
        violation.layers = (_report.LAYER_CUPTI,)
        violation.apis = {watched.name: 1}
        violation.reasons = {watched.name: reason}
        violation.blocked_ns = blocked_ns
        violation.timed = True
        _timeline.take_cupti(violation)
        _merge.cupti_event(violation)


_watch_lists: dict[int, tuple[ModuleType, list]] = {}
_RETIRED: list = []  # every callable ever subscribed (one per enable() that used CUPTI): never freed


def _watch_list(api: ModuleType) -> list[tuple[object, object, str, _Watched]]:
    """(domain, cbid, cbid name, watched) for every call of RULES this cupti-python knows (computed once)."""
    cached = _watch_lists.get(id(api))
    if cached is not None and cached[0] is api:
        return cached[1]
    found = []
    for domain, table in ((api.CallbackDomain.RUNTIME_API, api.runtime_api_trace_cbid),
                          (api.CallbackDomain.DRIVER_API, api.driver_api_trace_cbid)):
        for cbid_name, cbid in table.__members__.items():
            name = rules.base_name(cbid_name)
            rule = rules.RULES.get(name)
            if rule is not None:
                found.append((domain, cbid, cbid_name, _Watched(name, rule)))
    _watch_lists[id(api)] = (api, found)
    return found


def _params_offset(api: ModuleType) -> int:
    """Byte offset of ``functionParams`` in ``CUpti_CallbackData`` (16 on 64-bit Linux)."""
    dtype = getattr(api, "callback_data_dtype", None)
    fields = getattr(dtype, "fields", None)
    if fields and "function_params" in fields:
        return int(fields["function_params"][1])
    return 16
