"""The one NVLink answer (topology.nvlink_p2p) that the doctor and the copy-engine eligibility share, on a fake NVML."""

from __future__ import annotations

import types

from syncless._core import topology


class _NotSupported(Exception):
    pass


class _InvalidArgument(Exception):
    pass


def fake_nvml(*, p2p=None, links=None, buses=None):
    """``p2p``: status to return, or None for NotSupported; ``links``: {(gpu, link): remote gpu or None}."""
    links = links or {}
    buses = buses or {"a": "00000000:18:00.0", "b": "00000000:2A:00.0", "c": "00000000:3B:00.0"}

    def p2p_status(a, b, caps):
        assert caps == "NVLINK"
        if p2p is None:
            raise _NotSupported()
        return p2p

    def link_state(handle, link):
        if (handle, link) not in links:
            raise _InvalidArgument()
        return links[(handle, link)] is not None

    def remote_pci(handle, link):
        return types.SimpleNamespace(busId=buses[links[(handle, link)]].lower().encode())

    return types.SimpleNamespace(
        NVML_P2P_CAPS_INDEX_NVLINK="NVLINK", NVML_P2P_STATUS_OK=0, NVML_NVLINK_MAX_LINKS=4,
        NVMLError_NotSupported=_NotSupported, NVMLError_InvalidArgument=_InvalidArgument,
        nvmlDeviceGetP2PStatus=p2p_status, nvmlDeviceGetNvLinkState=link_state,
        nvmlDeviceGetNvLinkRemotePciInfo=remote_pci,
        nvmlDeviceGetPciInfo=lambda handle: types.SimpleNamespace(busId=buses[handle]),
    )


def test_the_p2p_status_decides_where_nvml_supports_it():
    assert topology.nvlink_p2p(fake_nvml(p2p=0), "a", "b") is True
    assert topology.nvlink_p2p(fake_nvml(p2p=3, links={("a", 0): "b"}), "a", "b") is False  # status wins


def test_without_p2p_status_an_active_link_to_the_peer_counts():
    nvml = fake_nvml(links={("a", 0): "c", ("a", 1): None, ("a", 2): "b"})
    assert topology.nvlink_p2p(nvml, "a", "b") is True
    assert topology.nvlink_p2p(nvml, "a", "c") is True


def test_without_p2p_status_inactive_or_other_links_do_not_count():
    nvml = fake_nvml(links={("a", 0): "c", ("a", 1): None})
    assert topology.nvlink_p2p(nvml, "a", "b") is False
    assert topology.nvlink_p2p(fake_nvml(), "a", "b") is False  # no link answers at all
