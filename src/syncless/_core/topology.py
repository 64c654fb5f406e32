"""What the GPUs of this node are and how they are connected.

Facts come from the CUDA driver (cuda-bindings) and NVML, never from parsing
``nvidia-smi`` text. GPUs are named by their CUDA ordinal; NVML handles are
matched to them by PCI bus id, since the two enumerations may differ.
The decisions built on these facts (which link counts as NVLink, whether a
pipeline is eligible) are plain functions of :class:`LinkInfo` values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from syncless._core import cuda
from syncless._core.errors import MissingDependencyError

_BUS_ID = re.compile(r"^(?:([0-9a-fA-F]+):)?([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-9a-fA-F]+)")


def normalize_bus_id(bus_id: str) -> tuple[int, int, int, int]:
    """Turn ``"0000:18:00.0"`` or NVML's ``"00000000:18:00.0"`` into comparable numbers."""
    match = _BUS_ID.match(bus_id.strip())
    if match is None:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    domain, bus, device, function = match.groups()
    return int(domain or "0", 16), int(bus, 16), int(device, 16), int(function, 16)


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as the driver sees it."""

    ordinal: int
    name: str
    total_memory_bytes: int
    compute_capability: tuple[int, int]
    sm_count: int
    pci_bus_id: str
    mem_ops_64bit: bool


@dataclass(frozen=True)
class LinkInfo:
    """How GPU ``src`` reaches GPU ``dst``.

    Attributes:
        kind: ``"same"`` (one GPU), ``"nvlink"``, ``"pcie"`` (peer access
            without NVLink) or ``"none"`` (no peer access).
        nvlink_count: active NVLink links on ``src`` when ``kind`` is nvlink
            (through NVSwitch every link reaches every peer), else 0.
        peer_access: the driver allows ``src`` to map ``dst``'s memory.
    """

    src: int
    dst: int
    kind: str
    nvlink_count: int
    peer_access: bool

    @property
    def label(self) -> str:
        """A short label in the style of ``nvidia-smi topo -m`` (``X``, ``NV18``, ``PCIe``, ``-``)."""
        if self.kind == "same":
            return "X"
        if self.kind == "nvlink":
            return f"NV{self.nvlink_count}" if self.nvlink_count else "NV"
        return "PCIe" if self.kind == "pcie" else "-"


def classify_link(src: int, dst: int, peer_access: bool, nvlink_p2p_ok: bool, nvlink_count: int) -> LinkInfo:
    """Combine the driver's and NVML's answers for one ordered pair of GPUs."""
    if src == dst:
        return LinkInfo(src, dst, "same", 0, True)
    if peer_access and nvlink_p2p_ok:
        return LinkInfo(src, dst, "nvlink", nvlink_count, True)
    if peer_access:
        return LinkInfo(src, dst, "pcie", 0, True)
    return LinkInfo(src, dst, "none", 0, False)


def list_gpus() -> list[GpuInfo]:
    """Describe every GPU the driver sees (blocks the host briefly; no stream work).

    Raises:
        MissingDependencyError: no cuda-bindings, no driver or no GPU.
    """
    drv = cuda.ensure_driver()
    count = cuda.call("cuDeviceGetCount")
    gpus = []
    for ordinal in range(count):
        device = cuda.call("cuDeviceGet", ordinal)
        name = cuda.call("cuDeviceGetName", 256, device)
        name = name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)
        attr = drv.CUdevice_attribute
        gpus.append(
            GpuInfo(
                ordinal=ordinal,
                name=name,
                total_memory_bytes=int(cuda.call("cuDeviceTotalMem", device)),
                compute_capability=(
                    cuda.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device),
                    cuda.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device),
                ),
                sm_count=cuda.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device),
                pci_bus_id=_bus_id_of(device),
                mem_ops_64bit=cuda.supports_64bit_stream_mem_ops(ordinal),
            )
        )
    return gpus


def _bus_id_of(device: Any) -> str:
    raw = cuda.call("cuDeviceGetPCIBusId", 64, device)
    if isinstance(raw, bytes):
        return raw.split(b"\0", 1)[0].decode()
    return str(raw).rstrip("\0")


def _nvml_bus(pci: Any) -> tuple[int, int, int, int]:
    raw = pci.busId
    return normalize_bus_id(raw.decode() if isinstance(raw, bytes) else str(raw))


def nvlink_p2p(nvml: Any, handle_a: Any, handle_b: Any) -> bool:
    """Return whether NVML reports GPU A reaching GPU B over NVLink (the one NVLink answer of syncless).

    Asks ``nvmlDeviceGetP2PStatus`` for the NVLink capability; where that is
    not supported, looks for GPU B's PCI bus id behind one of GPU A's active
    links (``nvmlDeviceGetNvLinkRemotePciInfo``). The doctor's link matrix
    and the copy-engine transport's eligibility both use it, so they agree.
    """
    try:
        status = nvml.nvmlDeviceGetP2PStatus(handle_a, handle_b, nvml.NVML_P2P_CAPS_INDEX_NVLINK)
        return status == nvml.NVML_P2P_STATUS_OK
    except nvml.NVMLError_NotSupported:
        pass
    bus_b = _nvml_bus(nvml.nvmlDeviceGetPciInfo(handle_b))
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            if not nvml.nvmlDeviceGetNvLinkState(handle_a, link):
                continue
            remote = nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle_a, link)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
            continue
        if _nvml_bus(remote) == bus_b:
            return True
    return False


def _nvml_handles(gpus: list[GpuInfo]) -> dict[int, Any]:
    """Map CUDA ordinals to NVML handles by PCI bus id."""
    nvml = cuda.ensure_nvml()
    by_bus: dict[tuple[int, int, int, int], Any] = {}
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        by_bus[_nvml_bus(nvml.nvmlDeviceGetPciInfo(handle))] = handle
    return {g.ordinal: by_bus[normalize_bus_id(g.pci_bus_id)] for g in gpus if normalize_bus_id(g.pci_bus_id) in by_bus}


def _active_nvlinks(nvml: Any, handle: Any) -> int:
    active = 0
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) == nvml.NVML_FEATURE_ENABLED:
                active += 1
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
            continue
    return active


def link_matrix(gpus: list[GpuInfo] | None = None) -> dict[tuple[int, int], LinkInfo]:
    """Return how every ordered pair of GPUs is connected.

    Peer access comes from the driver; NVLink from NVML (:func:`nvlink_p2p`). Without NVML, links with peer access
    are reported as PCIe-or-unknown (``kind="pcie"``), which the copy-engine transport refuses.
    """
    gpus = list_gpus() if gpus is None else gpus
    try:
        handles = _nvml_handles(gpus)
        nvml = cuda.ensure_nvml()
    except MissingDependencyError:
        handles, nvml = {}, None
    links = {}
    for a in gpus:
        nvlink_count = _active_nvlinks(nvml, handles[a.ordinal]) if nvml is not None and a.ordinal in handles else 0
        for b in gpus:
            peer = a.ordinal == b.ordinal or cuda.can_access_peer(a.ordinal, b.ordinal)
            nvlink_ok = False
            if nvml is not None and a.ordinal != b.ordinal and a.ordinal in handles and b.ordinal in handles:
                nvlink_ok = nvlink_p2p(nvml, handles[a.ordinal], handles[b.ordinal])
            links[(a.ordinal, b.ordinal)] = classify_link(a.ordinal, b.ordinal, peer, nvlink_ok, nvlink_count)
    return links
