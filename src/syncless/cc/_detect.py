"""Is this machine running NVIDIA Confidential Computing, and which mode applies.

The decision (:func:`resolve_mode`) is plain Python so that unit tests can feed
it any NVML answer; :func:`is_confidential_compute` is the thin NVML call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from syncless._core import config
from syncless._core import cuda as _cuda
from syncless._core.errors import MissingDependencyError
from syncless._core.logs import log_once

_log = logging.getLogger(__name__)

MODES = ("auto", "on", "off", "emulate")


@dataclass(frozen=True)
class ModeDecision:
    """The effective CC mode and why.

    Attributes:
        requested: what was asked for (explicit argument or ``SYNCLESS_CC``).
        mode: ``"on"``, ``"off"`` or ``"emulate"`` (``auto`` is resolved).
        reason: one line saying how ``mode`` was reached.
    """

    requested: str
    mode: str
    reason: str


def validate_mode(mode: object) -> str:
    """Return ``mode`` normalized as ``SYNCLESS_CC`` reads it; raise ``ValueError``/``TypeError`` naming the values."""
    return config.check_choice(mode, "CC mode", "SYNCLESS_CC")


def resolve_mode(requested: str, probe: Callable[[], bool]) -> ModeDecision:
    """Resolve ``requested`` to ``on``/``off``/``emulate``; ask ``probe`` only for ``auto``.

    ``probe`` returns whether CC is on, or raises :class:`MissingDependencyError`
    when NVML cannot answer (then ``auto`` resolves to ``off``, with that reason).
    """
    requested = validate_mode(requested)
    if requested != "auto":
        return ModeDecision(requested, requested, f"SYNCLESS_CC or the explicit argument asked for {requested!r}")
    try:
        enabled = probe()
    except MissingDependencyError as err:
        return ModeDecision("auto", "off", f"NVML could not be asked ({err}); assuming CC is off")
    if enabled:
        return ModeDecision("auto", "on", "NVML reports Confidential Computing enabled")
    return ModeDecision("auto", "off", "NVML reports Confidential Computing disabled")


def is_confidential_compute() -> bool:
    """Return whether the system runs with Confidential Computing enabled (False where NVML cannot say).

    Reads ``nvmlSystemGetConfComputeState().ccFeature``; never touches a GPU
    stream and does not block on GPU work. Without nvidia-ml-py, the NVML
    library or a driver it returns False, as vLLM's platform check does (a
    machine without a driver runs no CC); ``syncless doctor`` and
    ``decide_mode("auto")`` say why.
    """
    try:
        return ask_nvml_for_cc()
    except MissingDependencyError as err:
        log_once(_log, logging.DEBUG, "cc-nvml-missing", "NVML cannot be asked whether CC is on (%s): False", err)
        return False


def ask_nvml_for_cc() -> bool:
    """:func:`is_confidential_compute`, raising where NVML cannot answer.

    Raises:
        MissingDependencyError: nvidia-ml-py, the NVML library or the driver
            is missing.
    """
    nvml = _cuda.ensure_nvml()
    try:
        state = nvml.nvmlSystemGetConfComputeState()
    except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound) as err:
        # Drivers or GPUs without CC support cannot be in CC mode.
        log_once(_log, logging.DEBUG, "cc-nvml-unsupported", "NVML has no CC state here (%s): CC is off", err)
        return False
    return int(state.ccFeature) == int(nvml.NVML_CC_SYSTEM_FEATURE_ENABLED)


def decide_mode(mode: str | None = None) -> ModeDecision:
    """Return the effective mode: ``mode`` if given, else ``SYNCLESS_CC``; ``auto`` asks NVML."""
    requested = validate_mode(mode) if mode is not None else config.read("SYNCLESS_CC")
    return resolve_mode(requested, ask_nvml_for_cc)


def cc_mode(mode: str | None = None) -> str:
    """Return the effective CC mode, ``"on"``, ``"off"`` or ``"emulate"`` (explicit beats env)."""
    return decide_mode(mode).mode
