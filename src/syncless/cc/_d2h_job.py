"""One offloaded D2H copy: the snapshot taken on the D2H stream at the call, and the job that copies it to the host.

::

    D    : ... src -> snap (D2D)  R#n   [later kernels on D] ...
    W    :                          (whoever runs job #n) wait R#n ; snap -> dst (D2H) ; wait W ; done

The job is three driver calls (:mod:`._raw`) on whichever thread runs it
(:mod:`._worker`: the thread that waits for it, or the queue's own), with
GPU ``index``'s context made current for them. The snapshot has the
destination's dtype, shape and strides, and holds the destination's
*stored* bits (a conjugate or negative destination's are resolved in it), so
the job moves one dense block as it lies, with no torch call and no bump of
the destination's version counter (the offload bumps it once, at the call,
where torch's ``copy_`` does).
"""

from __future__ import annotations

from typing import Any

from syncless._core import patching
from syncless._core.layouts import is_dense_layout
from syncless.cc import _raw

# A copy this large is handed to the queue's own thread at once, so that its transfer overlaps the host's work;
# a smaller one is run by the thread that first waits for it (docs/cc.md, "Who runs the copy").
EAGER_BYTES = 1 << 20


def snapshot(src: Any, dst: Any, stream: Any) -> Any:
    """Copy device ``src``, as ``dst`` will store it, into a new device tensor, on ``stream`` (the current one).

    The read happens at this point of the D2H stream's queue, where torch's
    own D2H would read ``src``; the broadcast and any dtype conversion happen
    here too. Enqueues one device-to-device copy (asynchronous, CC or not: a
    raw driver copy when ``src`` already is that block, torch's ``copy_``
    otherwise, a ZeroTensor ``src`` included, whose data pointer is 0: torch
    zero-fills the snapshot); the host does not block. Raises torch's
    ``OutOfMemoryError`` when there is no room for it.
    """
    import torch

    snap = torch.empty_strided(dst.shape, dst.stride(), dtype=dst.dtype, device=src.device)
    conj, neg = dst.is_conj(), dst.is_neg()
    if (not conj and not neg and src.dtype == dst.dtype and src.shape == dst.shape and src.stride() == dst.stride()
            and not src.is_conj() and not src.is_neg() and (src.is_contiguous()
                                                             or is_dense_layout(src.shape, src.stride()))
            and not src._is_zerotensor()):  # (the shim routes a ZeroTensor to torch's own copy before this)
        if snap.nbytes:  # an empty tensor has no memory to copy (its data pointer may be null)
            _raw.copy_device_block(src.device.index, snap.data_ptr(), src.data_ptr(), snap.nbytes, stream)
        return snap
    source = src
    if conj:  # dst stores conj(value): so must the block it receives
        source = source.conj()
    if neg:
        source = torch._neg_view(source)
    with torch.no_grad():
        patching.original(torch.Tensor, "copy_")(snap, source)  # torch's own device copy, beneath every layer
    return snap


def snapshot_block(src: Any, stream: Any, index: int) -> Any:
    """:func:`snapshot` of a contiguous ``src`` that its destination stores as it lies (same dtype, shape, strides,
    no conjugate or negative bit), with memory of its own (not a ZeroTensor: the lane checked): a new device tensor
    and one raw device copy on ``stream``. Does not block."""
    import torch

    snap = torch.empty_like(src)
    nbytes = src.nbytes
    if nbytes:  # an empty tensor has no memory to copy (its data pointer may be null)
        _raw.copy_device_block(index, snap.data_ptr(), src.data_ptr(), nbytes, stream)
    return snap


class CopyJob:
    """Job ``#n`` of a D2H stream's queue: wait for ``ready``, copy ``snap``'s bytes into ``dst``, wait for that.

    Runs on the thread that first waits for it, or on the queue's own thread
    (:mod:`._worker`); it blocks that thread until ``ready`` has fired and
    then until the copy is done, so the job counts as finished only once its
    bytes are in ``dst``. ``settled`` (set by the offload) lowers the count
    of unfinished copies once the queue has recorded the job's end. ``snap``
    and ``dst`` are let go as soon as the copy has run or failed; the ready
    event goes back to its pool.
    """

    __slots__ = ("index", "ready", "dst", "snap", "copy_stream", "nbytes", "verb", "shape", "src_dtype", "device",
                 "settled")

    def __init__(self, index: int, ready: Any, dst: Any, snap: Any, copy_stream: Any, verb: str, src: Any):
        self.index = index
        self.ready = ready
        self.dst = dst
        self.snap = snap
        self.copy_stream = copy_stream
        self.nbytes = snap.nbytes
        self.verb = verb
        self.shape, self.src_dtype, self.device = src.shape, src.dtype, src.device
        self.settled = None

    def __call__(self) -> None:
        dst = self.dst
        if dst is None:
            return  # copied and released already: a run again after an interrupt that came after the copy
        try:
            _raw.run_copy_job(self.index, self.ready, dst.data_ptr(), self.snap.data_ptr(), self.nbytes,
                              self.copy_stream)
        except Exception:
            self._release()
            raise
        # (A KeyboardInterrupt keeps everything: the queue runs the job again from its start.)
        self._release()

    def _release(self) -> None:
        """Let go of the snapshot and the destination (only after the copy has run, or failed) and give the ready
        event back, once: an interrupt in here leaves at most an event out of the pool, never one in it twice (two
        later offloads sharing one event would each wait for the other's record)."""
        self.dst = self.snap = None
        ready, self.ready = self.ready, None
        if ready is not None:
            _raw.give_back_ready_event(self.index, ready)

    def describe(self) -> str:
        """How errors name the copy (built only when one failed)."""
        return f"{self.verb} of a {tuple(self.shape)} {self.src_dtype} tensor from {self.device}"


class HelperJob:
    """Job ``#n`` of a D2H stream's queue whose copy the D2H helper process makes (:mod:`._helper`).

    Enqueued already, at the offload: ``src -> ring[slot]`` and the slot's ready event on the D2H stream, and the
    post to the helper. Running the job (on the thread that first waits for it, or the queue's own) waits until the
    helper's done word for the slot says its copy ``hseq`` is made, then moves the bytes from the shared staging
    into ``dst`` (a ``memmove``) and frees the slot: no driver call on this process's side, and the GIL is let go
    only while it sleeps between looks (the copy is usually made by then: a decode loop waits a step late). A copy
    the helper reports failed raises :class:`CudaError`; a helper that died raises ``D2HHelperGoneError``: the job's
    failure either way, raised at the covering call as any copy's. Run again (after an interrupt) it delivers
    nothing twice: the channel knows which copy each slot holds.
    """

    __slots__ = ("helper", "slot", "hseq", "dst", "nbytes", "settled")

    def __init__(self, helper: Any, slot: int, hseq: int, dst: Any, nbytes: int):
        self.helper, self.slot, self.hseq, self.dst, self.nbytes = helper, slot, hseq, dst, nbytes
        self.settled = None

    def __call__(self) -> None:
        dst = self.dst
        if dst is not None:  # (None: delivered, and this is a run again after an interrupt)
            self.helper.deliver(self.slot, self.hseq, dst.data_ptr(), self.nbytes)
            self.dst = None  # (kept on a failure: describe() reads it)

    def describe(self) -> str:
        """How errors name the copy (built only when one failed; ``dst`` has the source's shape and dtype)."""
        return (f".to('cpu', non_blocking=True) of a {tuple(self.dst.shape)} {self.dst.dtype} tensor from "
                f"cuda:{self.helper.index} (made by the D2H helper process)")
