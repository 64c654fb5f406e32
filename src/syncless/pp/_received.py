"""What ``recv(wait=False)`` returns: a step whose GPU wait is queued at first use, not inside recv()."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch


def stream_handle(stream: Any) -> int | None:
    """The raw handle of ``stream`` (a ``torch.cuda.Stream``), or None for "the current stream"."""
    if stream is None:
        return None
    handle = getattr(stream, "cuda_stream", None)
    if not isinstance(handle, int):
        raise TypeError(f"stream must be a torch.cuda.Stream or None; got {type(stream).__name__}")
    return handle


class ReceivedStep(Mapping[str, torch.Tensor]):
    """One received step whose GPU wait is not queued yet; a read-only mapping of name -> view.

    ``recv(wait=False)`` returns it once the step's metadata arrived: its
    keys (the ones the sender sent) and row counts are known, its data may
    still be on the way. The first access to a tensor (``step["hidden"]``,
    ``values()``, ``items()``), :meth:`wait` or :attr:`tensors` queues the
    wait for the data (each transport's docstring says on which stream, and
    that the stream current then, or the one given, waits for it). Every
    later access from another stream (current, or given to :meth:`wait`)
    orders that stream after the step too, once per stream. Keys, ``len()``
    and ``in`` never wait. The next ``recv()`` (and ``close()``) queues it
    first if nobody did. The views are the persistent tensors, which the
    next step overwrites (see ``Transport.recv``).
    """

    def __init__(self, keys: list[str], finish: Callable[[int | None], dict[str, torch.Tensor]],
                 order: tuple[Callable[[], int], Callable[[int], None]] | None = None):
        """``finish(stream)`` queues the step's wait for ``stream`` (None: the current one) and returns the views;
        ``order`` is ``(current stream's handle, order a stream after the step)``, or None where readers need no
        stream ordering (the host waited for the data: gloo on the CPU)."""
        self._keys = keys
        self._finish: Callable[[int | None], dict[str, torch.Tensor]] | None = finish
        self._views: dict[str, torch.Tensor] | None = None
        self._order = order
        self._ordered: set[int | None] = set()  # the streams the step's data is ordered before

    @property
    def waited(self) -> bool:
        """Whether the step's wait has been queued."""
        return self._finish is None

    def wait(self, stream: Any = None) -> dict[str, torch.Tensor]:
        """Order ``stream`` (default: the current stream) after the step's data; return the views.

        The first call queues the step's wait; a later one from a stream not ordered yet makes that
        stream wait for the step's end. Does not block the host on the copy-engine or NCCL transports
        (gloo: the first call waits for the data, at most the timeout).

        Raises:
            TransportError: the transport failed or was closed before the step could be finished.
        """
        handle = stream_handle(stream)
        order = self._order
        if order is not None and handle is None:
            handle = order[0]()
        if self._finish is not None:
            finish = self._finish
            self._views = finish(handle)
            self._finish = None
            self._ordered.add(handle)
        elif order is not None and handle not in self._ordered:
            order[1](handle)
            self._ordered.add(handle)
        return self._views  # type: ignore[return-value]

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The views, after queuing the wait on the current stream (vLLM's ``IntermediateTensors.tensors``)."""
        return self.wait()

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        return self.wait()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __repr__(self) -> str:
        return f"ReceivedStep(keys={self._keys}, waited={self.waited})"
