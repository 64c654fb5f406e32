"""Which layers watch for syncs: ``torch`` (debug mode and wrappers) or ``cupti`` (those plus CUPTI).

``syncs.set_backend("auto" | "torch" | "cupti")`` or ``SYNCLESS_SYNC_BACKEND``
chooses. ``auto`` uses CUPTI when cupti-python is installed and CUPTI is
free, and says why when it is not; ``cupti`` insists (a missing package is
an error at :func:`activate`), but still falls back to ``torch`` when
another subscriber holds CUPTI, because that can change while the program
runs. The torch layers are on either way.

The CUPTI subscription is taken when the first checked region is entered
after ``enable()`` and held until ``disable()``. CUPTI allows one
subscriber per process and torch.profiler (kineto) is one: before the first
region and after ``disable()`` the profiler can have it, and when it has it
already, checking falls back to torch (logged once, and in :func:`choice`
and the report's header).

                 enable()   region in ... out   region in ... out    disable()
    torch layers  |========================================================|
    CUPTI                   |==========================================|

It is not given back at every region's exit: subscribing and unsubscribing
once per step cost time, and on 2 x H200 a demo stage whose D2H worker
thread made CUDA calls (each one a CUPTI callback on that thread) while the
main thread unsubscribed at a region's end crashed with SIGSEGV. A
callback may still be running on another thread when ``disable()``
unsubscribes; the callable it runs is kept alive for that reason
(``_cupti._RETIRED``).

Nothing here enqueues GPU work or blocks the host by itself; subscribing
and unsubscribing are host-side CUPTI calls.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from dataclasses import dataclass

from syncless._core import config
from syncless._core.errors import MissingDependencyError
from syncless._core.logs import log_once
from syncless.syncs import _merge, _report, _state

BACKENDS = ("auto", "torch", "cupti")
ENV_VAR = "SYNCLESS_SYNC_BACKEND"

_log = logging.getLogger("syncless.syncs")


@dataclass(frozen=True)
class BackendChoice:
    """What checks syncs, and why.

    Attributes:
        requested: ``auto``, ``torch`` or ``cupti``.
        active: ``torch`` or ``cupti``: the layers in use (or that the next region would use).
        reason: why, in words (for ``torch`` under ``auto``/``cupti``: why not CUPTI).
    """

    requested: str
    active: str
    reason: str


def validate_backend(name: object) -> str:
    """Return ``name`` if it is one of :data:`BACKENDS` (as ``SYNCLESS_SYNC_BACKEND`` reads it); raise otherwise."""
    return config.check_choice(name, "backend", ENV_VAR)


class _Backend:
    """Process-wide: the requested backend, the subscription and the count of active regions."""

    def __init__(self) -> None:
        # A bad SYNCLESS_SYNC_BACKEND never makes the import fail (the pytest plugin imports this in every
        # pytest run): it falls back to auto, warned once; env_error keeps why, for doctor and the plugin.
        self.requested: str
        self.requested, self.env_error = config.read_or_default(ENV_VAR)
        self.lock = threading.Lock()
        self.regions = 0
        self.subscriber = None
        self.api = None  # cupti.cupti, once loaded
        self.pointer_types = None
        self.failure: str | None = None  # why CUPTI is not used until the next activate()
        self.active = False

    # -- choosing -----------------------------------------------------------------------------

    def wants_cupti(self) -> bool:
        return self.active and self.requested != "torch" and self.failure is None

    def choice(self) -> BackendChoice:
        if self.requested == "torch":
            return BackendChoice("torch", "torch", "chosen (torch's sync debug mode and syncless's wrappers)")
        if self.failure is not None:
            return BackendChoice(self.requested, "torch", self.failure)
        if not self.active:
            return BackendChoice(self.requested, "torch", "decided at syncs.enable(); see syncless doctor")
        if self.subscriber is not None:
            return BackendChoice(self.requested, "cupti", "CUPTI is subscribed until syncs.disable()")
        return BackendChoice(self.requested, "cupti", "CUPTI will be subscribed from the first checked region "
                                                      "until syncs.disable()")

    def require(self) -> None:
        """Fail now if ``cupti`` is requested and cupti-python is missing (``enable()`` asks first, before it
        looks for a GPU: a missing package is an error on any machine, not "nothing to check").

        Raises:
            MissingDependencyError: ``cupti`` was requested and cupti-python is not installed.
        """
        from syncless.syncs import _cupti

        with self.lock:
            if self.requested != "cupti" or self.api is not None:
                return
            try:
                self.api = _cupti.load_module()
            except _cupti.CuptiUnavailable as err:
                raise MissingDependencyError(f"syncs backend 'cupti': {err.reason}") from err

    def activate(self) -> BackendChoice:
        """Prepare the requested backend (from ``enable()``); return the choice.

        Raises:
            MissingDependencyError: ``cupti`` was requested and cupti-python is not installed.
        """
        from syncless.syncs import _cupti

        with self.lock:
            self.active = True
            self.failure = None
            if self.requested != "torch":
                try:
                    self.api = _cupti.load_module() if self.api is None else self.api
                except _cupti.CuptiUnavailable as err:
                    if self.requested == "cupti":
                        raise MissingDependencyError(f"syncs backend 'cupti': {err.reason}") from err
                    self.failure = err.reason
                if self.failure is None and self.pointer_types is None:
                    try:
                        self.pointer_types = _cupti.PointerTypes()
                    except MissingDependencyError as err:
                        if self.requested == "cupti":
                            raise
                        self.failure = str(err)
            choice = self.choice()
            _report.recorder.backend = self.describe_layers()
            if choice.active == "torch" and self.requested == "auto":
                log_once(_log, logging.INFO, f"backend-auto-torch:{choice.reason}",
                         "syncless.syncs: checking with the torch backend: %s", choice.reason)
            return choice

    def deactivate(self) -> None:
        """Let CUPTI go and record what it held back (from ``disable()``)."""
        with self.lock:
            self.active = False
            self._unsubscribe()

    def describe_layers(self) -> str:
        choice = self.choice()
        if choice.active == "cupti":
            return "torch + wrappers + CUPTI"
        if self.requested == "torch":
            return "torch + wrappers"
        return f"torch + wrappers; not CUPTI: {choice.reason}"

    # -- regions ------------------------------------------------------------------------------

    def entered(self, token) -> None:
        """A checked region was entered on this thread/task (``token`` from ``_state.enter_checked``)."""
        if token is None:
            return
        with self.lock:
            self.regions += 1
            # Not only in the first of several open regions: disable() lets CUPTI go even while a region is
            # open, and the first region entered after the next enable() takes it again.
            if self.subscriber is None and self.wants_cupti():
                self._subscribe()
            subscribed = self.subscriber is not None
        if subscribed and token.outermost:
            # The outermost region of this thread/task, also when it sits in a context copied from a region
            # (a task or thread started inside one): its depth restarted at 1, and its exit closes these events.
            token.events = _merge.RegionEvents()
            token.events_token = _report.region_events.set(token.events)

    def exited(self, token, failing: bool) -> None:
        """A checked region was left; the outermost one records what CUPTI held back (and raises in error mode).

        Raises:
            SyncViolation: in ``error`` mode, for a sync only CUPTI saw in the region.
        """
        if token is None:
            return
        events, token.events = token.events, None
        if events is not None:
            try:
                _report.region_events.reset(token.events_token)
            except ValueError:  # left in another context (a generator resumed on another thread): nothing to undo
                pass
        with self.lock:
            self.regions = max(self.regions - 1, 0)  # the subscription stays until disable() (module docstring)
        if events is not None:
            _merge.close_region(events, failing)

    def _subscribe(self) -> None:
        from syncless.syncs import _cupti

        try:
            self.subscriber = _cupti.Subscriber(self.api, self.pointer_types)
        except _cupti.CuptiUnavailable as err:
            self.failure = err.reason
            _report.recorder.backend = self.describe_layers()
            log_once(_log, logging.WARNING, f"cupti-fallback:{err.reason}",
                     "syncless.syncs: CUPTI cannot be used, checking with the torch backend (syncs inside C/C++ "
                     "extensions, cupy, cuda-bindings and the allocator are not seen): %s. It is tried again at "
                     "the next syncs.enable().", err.reason)

    def _unsubscribe(self) -> None:
        subscriber, self.subscriber = self.subscriber, None
        if subscriber is not None:
            subscriber.close()
            _warn_if_profiler_ran()
            _merge.flush_all()


def _warn_if_profiler_ran() -> None:
    """Say so when torch's profiler is on now: while we held CUPTI its CUDA activities were lost."""
    import sys

    torch = sys.modules.get("torch")
    enabled = getattr(getattr(getattr(torch, "autograd", None), "profiler", None), "_is_profiler_enabled", False)
    if enabled:
        log_once(_log, logging.WARNING, "cupti-profiler-overlap",
                 "syncless.syncs: torch.profiler ran while the CUPTI backend held CUPTI inside a checked region; "
                 "the profiler's CUDA activities from that time are missing. Profile with "
                 "syncs.set_backend('torch'), or outside checked regions.")


backend = _Backend()
if backend.env_error is not None:
    _state.warn_bad_setting(backend.env_error, "the hidden-sync detector uses the backend auto")


def env_error() -> str | None:
    """Return why ``SYNCLESS_SYNC_BACKEND`` was refused at import (the backend then started ``auto``), or None.

    Like :func:`syncless.syncs.env_error`, it describes the environment as read
    at import; :func:`set_backend` changes the backend but not this.
    """
    return backend.env_error


def set_backend(name: str) -> None:
    """Choose the layers: ``auto``, ``torch`` or ``cupti``; takes effect at the next ``enable()``.

    Raises:
        ValueError, TypeError: ``name`` is not one of :data:`BACKENDS`.
        RuntimeError: a checked region is active (the subscription cannot change under it).
    """
    name = validate_backend(name)
    with backend.lock:
        if backend.regions:
            raise RuntimeError(f"syncs.set_backend({name!r}) while a checked region is active; "
                               "call it before syncs.enable() or between regions")
        backend.requested = name
        backend.failure = None


def choice() -> BackendChoice:
    """Return what checks syncs now (or would, in the next checked region), and why."""
    return backend.choice()


def describe() -> dict[str, str]:
    """What ``syncless doctor`` shows: the backend requested, the one that would be used, and why.

    Looks only at what is installed (no subscription is made, no CUDA call).
    A bad ``SYNCLESS_SYNC_BACKEND`` adds ``setting_error``: the message, and that ``auto`` is used instead.
    """
    described = _describe_requested(backend.requested)
    if backend.env_error is not None:
        described["setting_error"] = f"{backend.env_error}; auto is used until it is fixed or unset"
    return described


def _describe_requested(requested: str) -> dict[str, str]:
    version = _package_version("cupti-python")
    if requested == "torch":
        return {"requested": requested, "would_use": "torch", "reason": "requested", "cupti_python": version or "missing"}
    if version is None:
        would = "torch" if requested == "auto" else "nothing (enable() fails)"
        return {"requested": requested, "would_use": would, "reason": "cupti-python is not installed: pip install "
                "'syncless[cupti]'", "cupti_python": "missing"}
    reason = ("cupti-python is installed; CUPTI is subscribed from the first checked region until syncs.disable(), "
              "unless another subscriber (torch.profiler, Nsight) holds it, then torch is used")
    driver = _driver_cuda()
    if driver is not None and version.split(".")[:2] != driver.split("."):
        reason += f"; note: cupti-python {version} against a driver for CUDA {driver} (they should match)"
    return {"requested": requested, "would_use": "cupti", "reason": reason, "cupti_python": version}


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_cuda() -> str | None:
    from syncless._core import cuda
    from syncless._core.errors import CudaError

    try:
        major, minor = cuda.driver_version()
    except (MissingDependencyError, CudaError):
        return None
    return f"{major}.{minor}"
