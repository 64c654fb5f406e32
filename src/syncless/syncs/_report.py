"""Violations: where they happened in the user's code, what to do, and the record.

A violation names the operation, the user's own file:line (frames of
syncless, of torch and of the warnings machinery are skipped; the demo's
stages count as user code) and the fix.
Every violation is recorded (a count and the first stack per call site), in
every mode; ``record`` mode only records, ``warn`` also warns, ``error``
also raises :class:`~syncless._core.errors.SyncViolation`.

Three layers may see one sync: torch's debug mode (``torch``), syncless's
wrappers (``wrapper``) and, with the CUPTI backend, the driver/runtime call
that blocked (``cupti``). They are merged into one event per Python call
(:mod:`._merge`), so an ``.item()`` is one sync, not three records; each
row says which layers saw it, and CUPTI adds the host time blocked.
"""

from __future__ import annotations

import atexit
import dataclasses
import linecache
import os
import sys
import sysconfig
import threading
import time
import traceback
import warnings
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import FrameType

import syncless
from syncless._core.errors import SyncViolation
from syncless.syncs import _timeline
from syncless.syncs._state import settings


class SyncWarning(UserWarning):
    """Issued in ``warn`` mode for a hidden GPU sync in a checked region."""


KIND_EXPLICIT = "explicit"
KIND_IMPLICIT = "implicit copy"
KIND_WAIT = "host wait"
KIND_BLOCKING_COPY = "blocking copy"
KIND_ALLOCATOR = "allocator"
KIND_MEMSET = "blocking memset"
KIND_TEARDOWN = "teardown"

LAYER_TORCH = "torch"      # torch's sync debug mode (its warning)
LAYER_WRAPPER = "wrapper"  # syncless's wrappers of copies and waits
LAYER_CUPTI = "cupti"      # the CUDA driver/runtime call itself, through CUPTI
LAYERS = (LAYER_TORCH, LAYER_WRAPPER, LAYER_CUPTI)

FIX_EXPLICIT = (
    "keep the value on the GPU (torch.where or masks instead of branching on tensor values in Python, "
    "nonzero_static or precomputed indices instead of nonzero and boolean masks), read results back with a "
    "non_blocking copy into pinned memory and an event, or move this call out of the hot region; if the sync "
    "is intended, wrap it in `with syncless.syncs.allowed():`"
)
FIX_WAIT = (
    "do not block the host in the hot loop: order GPU work with stream.wait_event()/wait_stream(), poll "
    "event.query(), or read results a step later; if the wait is intended, wrap it in "
    "`with syncless.syncs.allowed():`"
)

_SYNCLESS_DIR = os.path.dirname(os.path.abspath(syncless.__file__)) + os.sep

# syncless code that is an application of syncless rather than its plumbing: the demo's stages run a
# decode loop under the detector, and their syncs (``--plant-sync``'s ``.item()``) belong to their own
# lines, not to the multiprocessing frame that started the stage.
_APPLICATION_DIRS = (os.path.join(_SYNCLESS_DIR, "demo") + os.sep,)


def is_plumbing_file(filename: str) -> bool:
    """Whether frames of ``filename`` sit between a sync and the user's code (syncless's own, but not the demo)."""
    return filename.startswith(_SYNCLESS_DIR) and not filename.startswith(_APPLICATION_DIRS)


def _module_files(*names: str) -> frozenset[str]:
    files = set()
    for name in names:
        try:
            module = __import__(name)
        except ImportError:  # _py_warnings exists from Python 3.14 on
            continue
        if getattr(module, "__file__", None):
            files.add(os.path.abspath(module.__file__))
    return frozenset(files)


# The warnings machinery and context-manager plumbing sit between a sync and the user's frame.
_STDLIB_SKIP = _module_files("warnings", "_py_warnings", "contextlib")

# Directories of packages whose Python frames sit between a CUDA call and the user (the cupti
# package, should it call our callback through Python code of its own); filled by the CUPTI backend.
_extra_skip_dirs: tuple[str, ...] = ()


# Installed packages (a frame's file under a site-packages or dist-packages directory): a sync made through
# one (numba's, cupy's, transformers') is the user's line that called it, "via" the package's frame. The rule
# is on the frame's file name: a package installed in editable mode lives where its source is, and its frames
# are the user's own.
_INSTALLED_PARTS = tuple(os.sep + part + os.sep for part in ("site-packages", "dist-packages"))
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


def is_installed_package_file(filename: str) -> bool:
    """Whether ``filename`` belongs to an installed package (under site-packages or dist-packages)."""
    return any(part in filename for part in _INSTALLED_PARTS)


def _is_stdlib_file(filename: str) -> bool:
    return filename.startswith(_STDLIB_DIR) and not is_installed_package_file(filename)


def via_text(frame: FrameType) -> str:
    """``package/path/file.py:line (function)`` of an installed package's frame, relative to its site-packages."""
    filename = frame.f_code.co_filename
    cut = max(filename.rfind(part) + len(part) if part in filename else -1 for part in _INSTALLED_PARTS)
    return f"{filename[cut:] if cut > 0 else filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def skip_frames_under(directory: str) -> None:
    """Treat frames of files under ``directory`` as plumbing, never as the user's code."""
    global _extra_skip_dirs
    directory = os.path.abspath(directory) + os.sep
    if directory not in _extra_skip_dirs:
        _extra_skip_dirs = (*_extra_skip_dirs, directory)

# Frames of torch code that synchronizes by design at compile time (dynamo
# tracing, inductor lowering and autotuning, CUDA graph trees recording and
# warm-up): a sync under one of them is not the user's hot loop. CUDA graph
# trees are also on the stack of every replay, the steady state of a
# ``mode="reduce-overhead"`` loop: see :func:`is_graph_replay`.
_COMPILE_TIME_FILES = (
    "_dynamo/convert_frame.py",
    "_inductor/compile_fx.py",
    "_inductor/select_algorithm.py",
    "_inductor/autotune_process.py",
    "_inductor/runtime/triton_heuristics.py",
    "_inductor/runtime/benchmarking.py",
    "_inductor/cudagraph_trees.py",
    "_inductor/codecache.py",
    "_inductor/async_compile.py",
)
_COMPILE_TIME_SUFFIXES = tuple(part.replace("/", os.sep) for part in _COMPILE_TIME_FILES)

_GRAPH_TREES_SUFFIX = os.path.join("_inductor", "cudagraph_trees.py")
_COMPILE_FX_SUFFIX = os.path.join("_inductor", "compile_fx.py")


def _is_runtime_wrapper(frame: FrameType) -> bool:
    """Whether a frame of a compile-time file is a wrapper that every call of the compiled graph runs.

    compile_fx.py's nested ``run`` functions (the cudagraphify wrapper, and on
    some torch versions the one that copies misaligned inputs) run at each
    call, not while compiling; what they call at compile time (recording a
    CUDA graph) lies nearer the sync and is judged there.
    """
    return frame.f_code.co_name == "run" and frame.f_code.co_filename.endswith(_COMPILE_FX_SUFFIX)

# In cudagraph_trees.py, CUDAGraphTreeManager.execute_node replays a recorded graph; record_function records
# one and run_eager warms one up (both synchronize by design). Neither runs under the other, and both keep
# these names from torch 2.1 to 2.13.
_GRAPH_REPLAY_FUNCTIONS = frozenset({"execute_node"})
_GRAPH_RECORDING_FUNCTIONS = frozenset({"record_function", "run_eager"})


def is_graph_replay(frame: FrameType | None, limit: int = 32) -> bool:
    """Whether a CUDA graph trees frame belongs to a graph's replay rather than its recording or warm-up.

    Walks outwards from ``frame`` over frames of cudagraph_trees.py until one
    says which. A sync there is the hot loop's own (``config.triton.
    force_cudagraph_sync``, or one in a function the replay calls), so it is
    reported; so are the replay's runtime wrappers around it (compile_fx's
    ``run``), which are not compile-time work then. Undecided counts as
    recording, as before.
    """
    while frame is not None and limit:
        if frame.f_code.co_filename.endswith(_GRAPH_TREES_SUFFIX):
            name = frame.f_code.co_name
            if name in _GRAPH_REPLAY_FUNCTIONS:
                return True
            if name in _GRAPH_RECORDING_FUNCTIONS:
                return False
        frame = frame.f_back
        limit -= 1
    return False


# Code that torch.compile generates and runs: inductor's wrappers (files in its cache directory,
# /tmp/torchinductor_<user>/ by default) and fx's graph modules (<eval_with_key>.N). A sync in it belongs
# to the user's call of the compiled function, not to a file that changes with every recompile.
_GENERATED_PREFIXES = ("<eval_with_key>", "<fx")
# Bytecode that dynamo made of the user's function: it calls the compiled graph (a global named
# __compiled_fn_N) or resumes after a graph break; its line is not where the user's call happened.
_DYNAMO_NAME_PREFIXES = ("__compiled_fn", "__resume_at_", "torch_dynamo_resume_in_")


def _is_generated(filename: str, cache_dir: str | None) -> bool:
    if filename.startswith(_GENERATED_PREFIXES):
        return True
    if "torchinductor_" in filename:
        return True  # the default cache directory: <tmp>/torchinductor_<user>/
    return cache_dir is not None and filename.startswith(cache_dir)


def _inductor_cache_dir() -> str | None:
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return os.path.abspath(cache) + os.sep if cache else None


def _is_dynamo_bytecode(code) -> bool:
    return code.co_name.startswith(_DYNAMO_NAME_PREFIXES) or any(
        name.startswith(_DYNAMO_NAME_PREFIXES) for name in code.co_names)


def _torch_dir() -> str | None:
    torch = sys.modules.get("torch")
    if torch is None or getattr(torch, "__file__", None) is None:
        return None
    return os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


@dataclass
class Violation:
    """One hidden sync in a checked region.

    Attributes:
        kind: ``explicit`` (torch's debug mode saw it), ``implicit copy``
            (a non_blocking copy that blocks anyway) or ``host wait``.
        operation: what synchronized, in words.
        filename, lineno, function: the user's own frame that made the call.
        fix: what to do about it.
        stack: the user's stack, outermost first, formatted (empty for a repeat of a call site already
            in the record, except in ``error`` mode, where the violation goes out with the exception).
        thread: name of the thread it happened on.
        layers: which layers saw it (:data:`LAYERS`), in that order.
        apis: CUDA calls that blocked the host, with how often (CUPTI only).
        reasons: why each of those calls blocks, by name.
        blocked_ns: host time spent inside those calls, entry to exit (0 when not timed).
        timed: whether CUPTI timed it.
        call_key: identifies the Python call (frame, code, instruction) for merging layers.
        repeats: how many syncs this stands for: more than one for CUPTI-only syncs of one call site held
            back together (their CUDA calls and blocked time summed, ``blocked_max_ns`` the longest one).
        via: the installed package's frame the sync was made through (``package/file.py:line (function)``,
            relative to its site-packages), empty when the user's frame made it directly.
        at_ns: when it was seen, ``time.time_ns()`` (for CUPTI, when the call returned).
    """

    kind: str
    operation: str
    filename: str
    lineno: int
    function: str
    fix: str
    stack: str
    thread: str
    layers: tuple[str, ...] = ()
    apis: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    blocked_ns: int = 0
    timed: bool = False
    call_key: tuple | None = field(default=None, repr=False, compare=False)
    repeats: int = field(default=1, repr=False, compare=False)
    blocked_max_ns: int = field(default=0, repr=False, compare=False)
    via: str = ""
    at_ns: int = field(default_factory=time.time_ns, repr=False, compare=False)  # when seen (the timeline's clock)

    def absorb(self, other: "Violation") -> None:
        """Fold another layer's view of the same sync into this one (no second count)."""
        self.layers = _ordered_layers((*self.layers, *other.layers))
        for api, calls in other.apis.items():
            self.apis[api] = self.apis.get(api, 0) + calls
        self.reasons.update(other.reasons)
        self.blocked_ns += other.blocked_ns
        self.timed = self.timed or other.timed

    @property
    def site(self) -> str:
        return f"{self.filename}:{self.lineno}"

    def message(self) -> str:
        calls = ""
        if self.apis:
            calls = " CUDA calls: " + "; ".join(f"{api} {self.reasons.get(api, 'blocks the host')}" for api in self.apis) + "."
            if self.timed:
                calls += f" The host was blocked for {self.blocked_ns / 1000:.1f} us."
        via = f", via {self.via}" if self.via else ""
        return (
            f"hidden GPU sync in a checked region at {self.site} (in {self.function}{via}): {self.operation} "
            f"[{self.kind}].{calls} The host waits for the GPU here. Fix: {self.fix}."
        )


def _ordered_layers(layers) -> tuple[str, ...]:
    present = set(layers)
    return tuple(layer for layer in LAYERS if layer in present)


def call_key(frame: FrameType) -> tuple:
    """Identify the Python call a frame is making right now: (frame, code, instruction offset)."""
    return (id(frame), frame.f_code, frame.f_lasti)


def _user_frame(start: FrameType | None) -> tuple[FrameType | None, bool, FrameType | None]:
    """Walk outwards from ``start`` to the first frame of the user's code.

    Frames of syncless, torch, the warnings and context-manager machinery
    and of installed packages (:func:`is_installed_package_file`) are passed.

    Returns:
        (frame, compile_time, via): the user's frame (the outermost one seen
        if every frame belongs to syncless/torch), whether a compile-time
        torch frame lies between the sync and the user's code, and the
        innermost installed package's frame passed on the way (None if
        none). A package's frame called from the standard library with no
        user frame between (a thread or event loop the package started) is
        itself the site, with no via.
    """
    torch_dir = _torch_dir()
    cache_dir = _inductor_cache_dir()
    frame = start
    last = None
    via = None
    replaying = False  # under a CUDA graph's replay: the compile-time files further out are its runtime wrappers
    compiled = False  # a frame of generated code was passed: the user's frame is the caller of the compiled function
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename) if not frame.f_code.co_filename.startswith("<") else frame.f_code.co_filename
        last = frame
        if torch_dir is not None and filename.startswith(torch_dir):
            if not replaying and filename.endswith(_COMPILE_TIME_SUFFIXES) and not _is_runtime_wrapper(frame):
                if not (filename.endswith(_GRAPH_TREES_SUFFIX) and is_graph_replay(frame)):
                    return frame, True, None
                replaying = True
        elif _is_generated(filename, cache_dir):
            compiled = True
        elif compiled and _is_dynamo_bytecode(frame.f_code):
            pass  # the user's function as dynamo rewrote it, calling the graph: its caller is the user's line
        elif (is_plumbing_file(filename) or filename in _STDLIB_SKIP or filename.startswith("<frozen")
              or (_extra_skip_dirs and filename.startswith(_extra_skip_dirs))):
            pass
        elif is_installed_package_file(filename) and not filename.startswith(_APPLICATION_DIRS):
            if via is None:
                via = frame
        elif via is not None and _is_stdlib_file(filename):
            return via, False, None  # the package was started by the standard library: no user line above it
        else:
            return frame, False, via
        frame = frame.f_back
    if via is not None:
        return via, False, None
    return last, False, None


def is_under_compile(start: FrameType | None, limit: int = 96) -> bool:
    """Whether compile-time torch code (inductor, dynamo, CUDA graph trees but not a replay) is on the stack.

    The CUPTI layer also sees syncs made by libraries that torch.compile
    drives (triton's benchmarking and loading): their frames are not torch's,
    so the check looks past the first frame outside torch.
    """
    frame = start
    while frame is not None and limit:
        filename = frame.f_code.co_filename
        if filename.endswith(_COMPILE_TIME_SUFFIXES) and not _is_runtime_wrapper(frame):
            return not (filename.endswith(_GRAPH_TREES_SUFFIX) and is_graph_replay(frame))
        frame = frame.f_back
        limit -= 1
    return False


def user_call_key(start: FrameType | None) -> tuple | None:
    """The :func:`call_key` of the user's frame above ``start``; None under compile-time torch code."""
    frame, compile_time, _ = _user_frame(start)
    if compile_time or frame is None:
        return None
    return call_key(frame)


def locate(kind: str, operation, fix: str, start: FrameType | None) -> Violation | None:
    """Build a :class:`Violation` for a sync seen at ``start`` (a frame inside the call).

    Args:
        operation: what synchronized, in words; None for torch's wording
            around the user's source line, or a callable that words it from
            that source line (empty when the source is not available).

    Returns None when the sync comes from compile-time work (see
    ``_COMPILE_TIME_FILES``), which synchronizes by design.
    """
    frame, compile_time, via = _user_frame(start)
    if compile_time:
        return None
    if frame is None:
        text = operation if isinstance(operation, str) else "a synchronizing CUDA operation"
        return Violation(kind, text, "<unknown>", 0, "<unknown>", fix, "", threading.current_thread().name)
    filename = frame.f_code.co_filename
    lineno = frame.f_lineno
    if operation is None:
        source = linecache.getline(filename, lineno).strip()
        operation = f"`{source}` called a synchronizing CUDA operation" if source else "a synchronizing CUDA operation"
    elif callable(operation):
        operation = operation(linecache.getline(filename, lineno).strip())
    if settings.mode != "error" and recorder.knows(filename, lineno, operation):
        stack = ""  # a repeat: the record keeps the first one's stack, and only error mode hands this one out
    else:
        frames = [e for e in traceback.extract_stack(frame, limit=24) if not is_plumbing_file(e.filename)]
        stack = "".join(traceback.format_list(frames[-16:]))
    return Violation(kind, operation, filename, lineno, frame.f_code.co_name, fix, stack,
                     threading.current_thread().name, call_key=call_key(frame),
                     via="" if via is None else via_text(via))


def _short(filename: str) -> str:
    """``filename`` relative to the working directory when it lies below it."""
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        return filename
    return filename if relative.startswith("..") else relative


@dataclass
class SyncSite:
    """One call site in the record: how often it synchronized, and its first occurrence.

    Attributes:
        first: the first violation recorded here (with its stack).
        count: syncs at this site (one per Python call, however many layers saw it).
        layers: every layer that saw a sync here.
        api_calls: CUDA calls that blocked the host here, with how often (CUPTI).
        reasons: why each of those calls blocks.
        blocked_total_ns, blocked_max_ns, timed_count: host time blocked, over the syncs CUPTI timed.
    """

    first: Violation
    count: int = 1
    layers: tuple[str, ...] = ()
    api_calls: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    blocked_total_ns: int = 0
    blocked_max_ns: int = 0
    timed_count: int = 0

    @property
    def site(self) -> str:
        return self.first.site

    @property
    def blocked_mean_ns(self) -> float:
        return self.blocked_total_ns / self.timed_count if self.timed_count else 0.0

    def take(self, violation: Violation) -> None:
        """Add what one more sync here contributes (not its count)."""
        self.layers = _ordered_layers((*self.layers, *violation.layers))
        self.add_calls(violation.apis, violation.reasons)
        if violation.timed:
            self.timed_count += violation.repeats
            self.blocked_total_ns += violation.blocked_ns
            self.blocked_max_ns = max(self.blocked_max_ns, violation.blocked_max_ns or violation.blocked_ns)

    def snapshot(self) -> "SyncSite":
        """A copy that later syncs at this site leave as it is."""
        first = dataclasses.replace(self.first, apis=dict(self.first.apis), reasons=dict(self.first.reasons))
        return dataclasses.replace(self, first=first, api_calls=dict(self.api_calls), reasons=dict(self.reasons))

    def to_plain(self) -> dict:
        """This site as plain values (for another process: pytest-xdist hands a worker's record over so)."""
        first = self.first
        return {"kind": first.kind, "operation": first.operation, "filename": first.filename, "lineno": first.lineno,
                "function": first.function, "fix": first.fix, "stack": first.stack, "thread": first.thread,
                "layers": list(self.layers), "count": self.count, "api_calls": dict(self.api_calls),
                "reasons": dict(self.reasons), "blocked_total_ns": self.blocked_total_ns,
                "blocked_max_ns": self.blocked_max_ns, "timed_count": self.timed_count, "via": first.via}

    @classmethod
    def from_plain(cls, plain: dict, where: str = "") -> "SyncSite":
        """The site :meth:`to_plain` gave; ``where`` (a worker's name) goes in front of the thread's name."""
        thread = f"{where}:{plain['thread']}" if where else plain["thread"]
        first = Violation(plain["kind"], plain["operation"], plain["filename"], int(plain["lineno"]), plain["function"],
                          plain["fix"], plain["stack"], thread, tuple(plain["layers"]), via=plain.get("via", ""))
        return cls(first, int(plain["count"]), tuple(plain["layers"]), dict(plain["api_calls"]), dict(plain["reasons"]),
                   int(plain["blocked_total_ns"]), int(plain["blocked_max_ns"]), int(plain["timed_count"]))

    def add_calls(self, apis: dict[str, int], reasons: dict[str, str]) -> None:
        for api, calls in apis.items():
            self.api_calls[api] = self.api_calls.get(api, 0) + calls
        self.reasons.update(reasons)


def _us(ns: float) -> str:
    return f"{ns / 1000:.1f}"


@dataclass
class SyncReport:
    """Every call site recorded since the last :func:`reset`, most frequent first.

    Attributes:
        sites: the call sites.
        not_checked: why nothing could be checked (the detector never became
            active since the record started), or None when it was active.
        backend: which layers checked, in words (e.g. ``"torch + CUPTI"``), and why CUPTI was not used.
        timeline: each sync with its time and each checked region, while ``syncs.record_timeline()`` was on.
    """

    sites: list[SyncSite] = field(default_factory=list)
    not_checked: str | None = None
    backend: str = ""
    timeline: _timeline.Timeline | None = None

    def to_chrome_trace(self, path) -> None:
        """Write :attr:`timeline` as Chrome trace-event JSON (Perfetto, ``chrome://tracing``); see ``._chrome_trace``."""
        from syncless.syncs import _chrome_trace

        _chrome_trace.write(self, path)

    def plot(self, path) -> None:
        """Draw :attr:`timeline` to an image (one lane per thread; needs matplotlib); see ``._plot``."""
        from syncless.syncs import _plot

        _plot.plot(self, path)

    @property
    def total(self) -> int:
        return sum(site.count for site in self.sites)

    def __bool__(self) -> bool:
        return bool(self.sites)

    def format(self, stacks: bool = True) -> str:
        """Render the table of call sites (count, site, kind, layers, blocked time, operation) and one stack per site."""
        checked_by = f" (checked by {self.backend})" if self.backend else ""
        if not self.sites:
            if self.not_checked is not None:
                return f"syncless: NOTHING WAS CHECKED: {self.not_checked}. No sync could be seen, so none is listed."
            return f"syncless: no hidden GPU syncs recorded{checked_by}"
        lines = [f"syncless: {self.total} hidden GPU sync(s) at {len(self.sites)} call site(s){checked_by}"]
        names = [_short(s.first.filename) + f":{s.first.lineno}" for s in self.sites]
        width = max(len(name) for name in names)
        layers = ["+".join(s.layers) for s in self.sites]
        layer_width = max(7, *(len(text) for text in layers))
        timed = any(s.timed_count for s in self.sites)
        blocked_head = f"  {'blocked ms':>10} {'mean us':>9} {'max us':>9}" if timed else ""
        lines.append(f"{'count':>7}  {'site':<{width}}  {'kind':<15}  {'seen by':<{layer_width}}{blocked_head}  operation")
        for s, name, seen in zip(self.sites, names, layers):
            blocked = ""
            if timed:
                blocked = (f"  {s.blocked_total_ns / 1e6:>10.3f} {_us(s.blocked_mean_ns):>9} {_us(s.blocked_max_ns):>9}"
                           if s.timed_count else f"  {'-':>10} {'-':>9} {'-':>9}")
            via = f" (via {s.first.via})" if s.first.via else ""
            lines.append(f"{s.count:>7}  {name:<{width}}  {s.first.kind:<15}  {seen:<{layer_width}}{blocked}  {s.first.operation}{via}")
        if stacks:
            for s in self.sites:
                lines.append("")
                lines.append(f"--- {s.site} in {s.first.function} ({s.count}x, first on thread {s.first.thread}) ---")
                lines.append(s.first.stack.rstrip())
                if s.first.via:
                    lines.append(f"via: {s.first.via}")
                for api, calls in s.api_calls.items():
                    lines.append(f"CUDA call: {api} x{calls}: {s.reasons.get(api, 'blocks the host')}")
                lines.append(f"fix: {s.first.fix}")
        return "\n".join(lines)


NOT_ENABLED = "syncs.enable() has not made the detector active in this process"


class _Recorder:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sites: dict[tuple[str, int, str], SyncSite] = {}
        self._atexit_registered = False
        # Why nothing is being checked (None once enable() made the detector active); kept across reset().
        self.not_checked: str | None = NOT_ENABLED
        self.backend = ""
        # Called before a report is taken: lets the CUPTI layer record syncs it is still holding back (._merge).
        self.before_report: list = []

    def knows(self, filename: str, lineno: int, operation: str) -> bool:
        """Whether this call site and operation are in the record with a stack (no lock: a dict lookup)."""
        site = self._sites.get((filename, lineno, operation))
        return site is not None and bool(site.first.stack)

    @staticmethod
    def key(violation: Violation) -> tuple[str, int, str]:
        return (violation.filename, violation.lineno, violation.operation)

    def add(self, violation: Violation) -> None:
        key = self.key(violation)
        with self._lock:
            site = self._sites.get(key)
            if site is None:
                site = self._sites[key] = SyncSite(violation, count=violation.repeats)
            else:
                site.count += violation.repeats
                if not site.first.stack and violation.stack:
                    # The site was recorded from a repeat without its stack (a reset() came between
                    # locate() and add() on another thread): keep this one's instead.
                    site.first = violation
            site.take(violation)

    def add_site(self, other: SyncSite) -> None:
        """Fold a whole site recorded elsewhere (another process) into the record."""
        key = self.key(other.first)
        with self._lock:
            site = self._sites.get(key)
            if site is None:
                self._sites[key] = other.snapshot()
                return
            site.count += other.count
            site.layers = _ordered_layers((*site.layers, *other.layers))
            site.add_calls(other.api_calls, other.reasons)
            site.timed_count += other.timed_count
            site.blocked_total_ns += other.blocked_total_ns
            site.blocked_max_ns = max(site.blocked_max_ns, other.blocked_max_ns)

    def annotate(self, key: tuple[str, int, str], api: str, reason: str, blocked_ns: int, event_total_ns: int,
                 first_timing: bool) -> None:
        """Add a CUDA call CUPTI saw inside an already recorded sync (a wrapper's), without counting it again."""
        with self._lock:
            site = self._sites.get(key)
            if site is None:  # reset() in between
                return
            site.layers = _ordered_layers((*site.layers, LAYER_CUPTI))
            site.add_calls({api: 1}, {api: reason})
            if first_timing:
                site.timed_count += 1
            site.blocked_total_ns += blocked_ns
            site.blocked_max_ns = max(site.blocked_max_ns, event_total_ns)

    def report(self) -> SyncReport:
        for flush in list(self.before_report):
            flush()
        with self._lock:
            # Copies, taken under the lock: the record keeps changing on other threads, a report does not.
            sites = sorted((site.snapshot() for site in self._sites.values()), key=lambda s: (-s.count, s.site))
        return SyncReport(sites, self.not_checked, self.backend, _timeline.snapshot())

    def reset(self) -> None:
        with self._lock:
            self._sites.clear()
        _timeline.forget()

    def print_at_exit(self) -> None:
        """Arrange for the record to be printed (to stderr) when the process exits."""
        with self._lock:
            if self._atexit_registered:
                return
            self._atexit_registered = True
        atexit.register(self._print_if_any)

    def _print_if_any(self) -> None:
        report = self.report()
        if report:
            print(report.format(), file=sys.stderr)


recorder = _Recorder()


def record_and_act(violation: Violation, forward_warning, may_raise: bool = True) -> None:
    """Add ``violation`` to the record and warn or raise as the mode says."""
    recorder.add(violation)
    mode = settings.mode
    if mode == "error" and may_raise:
        err = SyncViolation(violation.message())
        err.violation = violation
        raise err
    if mode == "warn":
        text = violation.message()
        if forward_warning is not None:
            forward_warning(SyncWarning(text), SyncWarning, violation.filename, violation.lineno)
        else:
            warnings.warn_explicit(text, SyncWarning, violation.filename, violation.lineno, registry=None)


def handle(violation: Violation, forward_warning=None) -> None:
    """Record ``violation`` and act on it in the current mode.

    Called by torch's debug-mode hook and by the wrappers; with CUPTI on,
    the CUDA calls of the same Python call are merged into it first
    (:mod:`._merge`).

    Args:
        forward_warning: in ``warn`` mode, a ``showwarning``-style callable to
            deliver the warning to directly; used by the warnings hook, which
            must not re-enter the warnings machinery. Without it, the warning
            goes through ``warnings.warn_explicit`` (and its filters).

    Raises:
        SyncViolation: in ``error`` mode.
    """
    if not violation.layers:
        violation.layers = (LAYER_TORCH,) if violation.kind == KIND_EXPLICIT else (LAYER_WRAPPER,)
    events = region_events.get()
    if events is not None:
        merge_into_torch_level(events, violation)
    _timeline.take_reported(violation)
    record_and_act(violation, forward_warning)


def _no_merge(events, violation: Violation) -> None:
    return None


# The state of the outermost checked region of this thread/task while CUPTI watches (see ._merge), and
# how a torch-level report takes CUPTI's view of the same call; both set by ._merge.
region_events: ContextVar = ContextVar("syncless_region_events", default=None)
merge_into_torch_level = _no_merge
