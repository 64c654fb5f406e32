"""The interface both pipeline transports implement."""

from __future__ import annotations

import abc
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from syncless._core.errors import SynclessError, TransportClosedError, TransportError

if TYPE_CHECKING:
    from syncless.pp._group import StageMap

logger = logging.getLogger(__name__)

_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def refuse_graph_capture(stage: str, call: str) -> None:
    """Raise :class:`~syncless.TransportError` if the current CUDA stream is capturing a graph.

    A step's host-side part (the metadata, the step counters, the
    watchdog's brackets) happens once, at capture; a replay would repeat
    only the GPU part, with stale step numbers, and wait forever. Costs one
    call into torch (no CUDA call when CUDA was never initialised).
    """
    if _capturing is None or not torch.cuda.is_initialized():
        return
    if _capturing():
        raise TransportError(
            f"{stage}: {call}() was called while the current CUDA stream is capturing a graph; a pipeline "
            "transport cannot be captured (its host-side bookkeeping would not replay). Call it outside "
            "torch.cuda.graph(...) and capture only the compute around it"
        )


def check_wait(wait: object) -> None:
    """Raise :class:`TypeError` unless ``recv``'s ``wait`` is a bool (``recv(pp_group)`` is the seed's form)."""
    if wait is True or wait is False:
        return
    raise TypeError(
        f"recv(wait=...) takes a bool; got {type(wait).__name__}. The seed's recv(pp_group) form is gone: the "
        "group is bound when the transport is made (make_transport(pp_group, persistent)), so call recv() or "
        "recv(wait=False)"
    )


class Transport(abc.ABC):
    """Moves one step's named tensors from each pipeline stage to the next.

    Attributes:
        backend: ``"copy_engine"`` or ``"torch_distributed"``.
        fallback_reason: why the copy-engine transport was not used when it
            was asked for with ``backend="auto"``; None otherwise.
        device: the device this stage's tensors live on.
        direct_unavailable_reason: with the copy-engine transport and ``depth="auto"``, why a link of
            this stage sends every step through a slot; None otherwise.
        direct_steps_sent: with the copy-engine transport and ``depth="auto"``, how many steps this
            stage sent straight into the next stage's persistent tensors; 0 otherwise.
        depth: the ``depth`` every stage passed to ``make_transport`` (an int, or ``"auto"``). The
            torch.distributed transport keeps the value but queues its sends in its backend.
        auto_slots: with the copy-engine transport and ``depth="auto"``, the slots per link
            (``SYNCLESS_PP_AUTO_SLOTS``); 0 otherwise.
        batched_copies: whether send() issues a step's tensors as one batched copy-engine operation
            (copy-engine transport only; False on the torch.distributed transport).
        error, leaked_nbytes: the failure model's properties (below).
    """

    backend: str = ""
    fallback_reason: str | None = None
    direct_unavailable_reason: str | None = None
    direct_steps_sent: int = 0
    depth: int | str = 2
    auto_slots: int = 0
    batched_copies: bool = False
    device: torch.device
    #: what every later call raises once set (a timeout, a failed step, abort()); set by the implementations
    _failure: BaseException | None = None
    _closed: bool = False
    _stages: StageMap

    @property
    def error(self) -> BaseException | None:
        """The error that made this transport unusable (raised again by every later call); None while healthy."""
        return self._failure

    def _release_side_group(self) -> None:
        """Destroy this transport's private gloo group (at the end of ``close()``; never in ``abort()``)."""
        from syncless.pp._group import release_cpu_group

        side = getattr(self, "_side_group", None)
        self._side_group = None
        release_cpu_group(side, self._stages.name())

    def _check_usable(self) -> None:
        """Raise the recorded failure, or :class:`~syncless.TransportClosedError` once closed or aborted."""
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise TransportClosedError(f"{self._stages.name()}: this transport is closed")

    @property
    def leaked_nbytes(self) -> int:
        """Device bytes kept allocated on purpose after a failure (a peer may still map them); 0 otherwise."""
        return 0

    @abc.abstractmethod
    def abort(self) -> int:
        """Stop at once, on this stage only (no collective); return :attr:`leaked_nbytes`.

        Usable from a signal handler or another thread. Every later call
        raises. See each implementation for what it releases.
        """

    @abc.abstractmethod
    def send(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Send this step's tensors (any row count up to the next stage's maximum) to the next stage.

        Enqueues on the caller's current stream and returns without waiting
        for the GPU; the caller may overwrite the tensors at once (on that
        stream). Each implementation says when the host may wait.
        """

    @abc.abstractmethod
    def recv(self, wait: bool = True) -> Mapping[str, torch.Tensor]:
        """Receive the previous stage's next step into the persistent tensors; return views of them.

        Blocks the host until the step's metadata arrives (at most the
        timeout); the data lands in stream order on the caller's current
        stream, so work queued there afterwards sees it. The keys are the
        ones the sender sent. With ``wait=False`` the GPU wait is queued at
        first use of the returned :class:`~syncless.pp.ReceivedStep` instead
        (input preparation queued in between overlaps the transfer). ``wait``
        must be a bool (the seed's ``recv(pp_group)`` raises ``TypeError``).

        The views are the persistent tensors themselves: the next step
        overwrites them in place, so consume or copy them before the next
        ``recv()`` (an async scheduler that keeps a step longer copies it).
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything; every stage calls it.

        Enqueues nothing on the caller's streams; blocks the host (each
        implementation says for what: its queued transfers, the other stages).
        """

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        # Never mask the error that ended the block with one from tearing down.
        try:
            self.close()
        except (SynclessError, TransportError, RuntimeError) as close_err:
            logger.warning("closing the %s transport after an error also failed: %s", self.backend, close_err)
