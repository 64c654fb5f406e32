"""Collect what this machine offers, one section at a time.

Each probe returns plain data. A piece that is absent (no GPU, no driver, no
cuda-bindings) is reported with how to get it, never raised: ``syncless
doctor`` must work on any machine.
"""

from __future__ import annotations

import importlib.metadata
import platform
import re
from collections.abc import Callable
from typing import Any

from syncless._core import config, cuda, topology
from syncless._core.errors import ConfigError, CudaError, MissingDependencyError
from syncless.syncs import _backend as _sync_backend

Missing = list[dict[str, str]]


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def probe_software(missing: Missing) -> dict[str, Any]:
    """Versions of Python, torch, the CUDA runtime and driver, NCCL, cuda-bindings and NVML."""
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda_runtime": torch.version.cuda,
        "torch_cuda_available": torch.cuda.is_available(),
        "nccl": None,
        "cuda_bindings": _package_version("cuda-bindings") or _package_version("cuda-python"),
        "nvidia_ml_py": _package_version("nvidia-ml-py"),
        "driver": None,
        "driver_cuda": None,
    }
    if torch.version.cuda is None:
        missing.append({"what": "a CUDA build of torch", "fix": "install torch from a CUDA wheel index (this one is CPU-only)"})
    # The same words as the error that importing either one gives (cuda.import_optional), so that
    # _note_missing sees the same piece again below and lists it once.
    if info["cuda_bindings"] is None:
        missing.append({"what": "cuda-bindings", "fix": cuda.CUDA_EXTRA_HINT})
    if info["nvidia_ml_py"] is None:
        missing.append({"what": "nvidia-ml-py", "fix": cuda.CUDA_EXTRA_HINT})
    if torch.cuda.is_available() and torch.distributed.is_available() and torch.distributed.is_nccl_available():
        version = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    try:
        nvml = cuda.ensure_nvml()
        driver = nvml.nvmlSystemGetDriverVersion()
        info["driver"] = driver.decode() if isinstance(driver, bytes) else driver
    except MissingDependencyError as err:
        _note_missing(missing, err)
    try:
        major, minor = cuda.driver_version()
        info["driver_cuda"] = f"{major}.{minor}"
    except MissingDependencyError as err:
        _note_missing(missing, err)
    return info


def _note_missing(missing: Missing, err: MissingDependencyError) -> None:
    text = str(err)
    # "the NVML library (libnvidia-ml) was not found: install the NVIDIA driver, ..." -> what, fix;
    # "nvidia-ml-py is not installed (pynvml.x is missing): install it ..." -> "nvidia-ml-py", fix
    what, _, fix = text.partition(": ")
    what = re.sub(r" (?:was not found|is not installed)(?: \(.*\))?$", "", what)
    if all(entry["what"] != what for entry in missing):
        missing.append({"what": what, "fix": fix or text})


def probe_gpus(missing: Missing) -> dict[str, Any]:
    """Every GPU, and the link between each ordered pair."""
    try:
        gpus = topology.list_gpus()
    except MissingDependencyError as err:
        _note_missing(missing, err)
        return {"gpus": [], "links": []}
    links = topology.link_matrix(gpus)
    return {
        "gpus": [
            {
                "ordinal": g.ordinal,
                "name": g.name,
                "memory_mib": g.total_memory_bytes // (1 << 20),
                "compute_capability": f"{g.compute_capability[0]}.{g.compute_capability[1]}",
                "sm_count": g.sm_count,
                "pci_bus_id": g.pci_bus_id,
                "stream_mem_ops_64bit": g.mem_ops_64bit,
            }
            for g in gpus
        ],
        "links": [
            {"src": link.src, "dst": link.dst, "kind": link.kind, "label": link.label,
             "nvlink_count": link.nvlink_count, "peer_access": link.peer_access}
            for link in links.values()
        ],
    }


def probe_confidential_compute() -> dict[str, Any]:
    """The CC state as NVML reports it, and the mode syncless.cc would use."""
    from syncless import cc
    from syncless.cc._detect import ask_nvml_for_cc

    try:
        nvml_state = "on" if ask_nvml_for_cc() else "off"
    except MissingDependencyError as err:
        nvml_state = f"unknown ({err})"
    decision = cc.decide_mode()
    return {"nvml_state": nvml_state, "requested": decision.requested, "mode": decision.mode, "reason": decision.reason}


def probe_pp_choice() -> dict[str, Any]:
    """Which pipeline transport make_transport would pick here, and why."""
    from syncless import pp

    return pp.describe_local_choice()


def probe_config() -> list[dict[str, Any]]:
    """Every SYNCLESS_* variable, its effective value and where it came from."""
    return config.effective()


def probe_unknown_settings() -> list[dict[str, Any]]:
    """Every ``SYNCLESS_*`` variable that is not a setting (a typo is ignored otherwise), with the likely one."""
    return [{"name": name, "closest": closest, "message": config.describe_unknown(name, closest)}
            for name, closest in config.unknown_names()]


def probe_other_variables() -> list[dict[str, Any]]:
    """The variables of other software that syncless reads (``VLLM_GPU_SYNC_CHECK``), like :func:`probe_config`'s rows."""
    import os
    import warnings

    from syncless.syncs import SyncCheckConfigWarning

    with warnings.catch_warnings():
        # Importing the adapter reads the variable and warns about a bad value: this report says it instead.
        warnings.simplefilter("ignore", SyncCheckConfigWarning)
        from syncless.compat import vllm
    raw = os.environ.get(vllm.ENV_VAR)
    mode, error = vllm.parse_mode(raw)
    meaning = (f"syncless.compat.vllm sets syncless's mode to {mode!r}" if mode is not None
               else "off: syncless.compat.vllm follows SYNCLESS_SYNC_CHECK")
    return [{"name": vllm.ENV_VAR, "value": "unset" if raw is None else raw,
             "source": "default" if raw is None else "env", "error": error, "doc": meaning}]


def probe_sync_detector() -> dict[str, Any]:
    """Whether the hidden-sync detector can check anything with this torch build, and why not."""
    try:
        from syncless.syncs import _debugmode
    except ConfigError as err:  # a bad SYNCLESS_SYNC_CHECK, read when the detector loads
        return {"can_run": False, "reason": f"the detector cannot load: {err}"}
    reason = _debugmode.backend().unavailable_reason()
    if reason is None:
        return {"can_run": True, "reason": "torch's CUDA sync debug mode is available"}
    return {"can_run": False, "reason": reason}


def merge_missing(missing: Missing) -> Missing:
    """One entry per fix: pieces that the same step provides (the NVIDIA driver's libraries) are listed together."""
    merged: dict[str, list[str]] = {}
    for entry in missing:
        whats = merged.setdefault(entry["fix"], [])
        if entry["what"] not in whats:
            whats.append(entry["what"])
    return [{"what": "; ".join(whats), "fix": fix} for fix, whats in merged.items()]


def _guarded(probe: Callable[[], Any]) -> Any:
    try:
        return probe()
    except (MissingDependencyError, CudaError, ConfigError) as err:
        return {"error": str(err)}


def collect() -> dict[str, Any]:
    """Run every probe; return one JSON-able report."""
    missing: Missing = []
    report: dict[str, Any] = {"software": probe_software(missing)}
    report.update(probe_gpus(missing))
    report["confidential_compute"] = _guarded(probe_confidential_compute)
    report["pp_transport"] = _guarded(probe_pp_choice)
    report["sync_detector"] = probe_sync_detector()
    report["sync_backend"] = _guarded(_sync_backend.describe)
    report["config"] = probe_config()
    report["unknown_settings"] = probe_unknown_settings()
    report["other_variables"] = probe_other_variables()
    report["missing"] = merge_missing(missing)
    report["docs"] = _docs_location()
    return report


def _docs_location() -> str:
    from syncless.doctor._pages import docs_dir

    folder = docs_dir()
    return str(folder) if folder is not None else "not found next to this installation"


def config_problems(report: dict[str, Any]) -> int:
    """How many settings are invalid or unknown in ``report`` (the doctor exits non-zero if any)."""
    return (sum(1 for row in report["config"] + report.get("other_variables", []) if row["error"])
            + len(report.get("unknown_settings", [])))
