"""The error hierarchy shared by every syncless capability.

Everything syncless raises on purpose derives from :class:`SynclessError`,
except bad arguments, which raise the built-in ``ValueError``/``TypeError``
that Python users expect (``ConfigError`` is both).
"""

from __future__ import annotations


class SynclessError(Exception):
    """Root of every error that syncless raises on purpose."""


class ConfigError(SynclessError, ValueError):
    """A ``SYNCLESS_*`` variable or an explicit setting has a bad value."""


class MissingDependencyError(SynclessError, ImportError):
    """A package, the CUDA driver or a GPU that a call needs is not there.

    The message always says how to get it.
    """


class NoGPUError(MissingDependencyError, RuntimeError):
    """A call needs a CUDA GPU and torch has none usable (a CPU-only build, no GPU, no driver).

    Both a :class:`MissingDependencyError` (an ``ImportError``) and a ``RuntimeError``, which is what torch raises
    for a CUDA call without a GPU: code ported from vLLM that catches ``RuntimeError`` catches it too.
    """


class CudaError(SynclessError, RuntimeError):
    """A CUDA driver call failed.

    A ``RuntimeError`` too, as torch's own CUDA errors are (``torch.AcceleratorError``): where the ``cc`` shim's
    driver call is the first to fail, code that catches torch's error with ``except RuntimeError`` catches it.

    Attributes:
        call: the driver function that failed, e.g. ``"cuIpcOpenMemHandle"``.
        code: the numeric ``CUresult``.
        name: the driver's error name, e.g. ``"CUDA_ERROR_INVALID_VALUE"``.
        explanation: the driver's own description of the error.
    """

    def __init__(self, call: str, code: int, name: str, explanation: str, hint: str = ""):
        self.call = call
        self.code = code
        self.name = name
        self.explanation = explanation
        self.hint = hint
        message = f"{call} failed with {name} ({code}): {explanation}"
        if hint:
            message += f". {hint}"
        super().__init__(message)


class SyncViolation(SynclessError, RuntimeError):
    """Raised in ``error`` mode when code marked hot synchronizes with the GPU.

    A ``RuntimeError`` too, as vLLM's sync check raises: code ported from it
    that says ``except RuntimeError`` (or ``pytest.raises(RuntimeError)``)
    still catches it.
    """


class TransportError(SynclessError):
    """Root of every error a pipeline transport (:mod:`syncless.pp`) raises on purpose.

    Bad arguments still raise ``ValueError``/``TypeError``. See
    ``docs/pp.md`` (failure model) for what each subclass means and how to
    rebuild a transport after one.

    Attributes:
        leaked_nbytes: for an error raised by a failed ``make_transport``, the
            device bytes its set-up kept allocated by design because a peer may
            still map them (0 otherwise; a built transport reports its own in
            ``transport.leaked_nbytes``). A ``KeyboardInterrupt`` or other
            error that ends a copy-engine set-up carries the same attribute.
    """

    leaked_nbytes: int = 0


class TransportSetupError(TransportError, RuntimeError):
    """``make_transport`` could not build the transport (raised alike on every stage)."""


class CopyEngineUnavailable(TransportSetupError):
    """The copy-engine pipeline transport cannot be used on this group.

    Raised identically on every rank of the group, with the first rank's
    reason, so that all ranks take the same fallback.
    """


class PeerTimeoutError(TransportError, TimeoutError):
    """A pipeline peer sent nothing within the configured timeout (it may have died)."""


class TransportFailedError(TransportError, RuntimeError):
    """The transport is unusable: an earlier step failed, it was aborted, or it is closed.

    Every later ``send``/``recv`` raises it (or the :class:`PeerTimeoutError`
    that broke the transport). Close or abort it and build a new one.
    """


class TransportClosedError(TransportFailedError):
    """``send``/``recv`` on a transport after a ``close()`` with no failure before it.

    After ``abort()`` or a failure, later calls raise the recorded error instead
    (:attr:`Transport.error`: the abort's :class:`TransportFailedError`, or the failure).
    """
