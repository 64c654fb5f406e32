"""Link classification and PCI bus id matching (plain logic)."""

import pytest

from syncless._core.topology import classify_link, normalize_bus_id


def test_bus_ids_from_driver_and_nvml_match():
    assert normalize_bus_id("0000:18:00.0") == normalize_bus_id("00000000:18:00.0")
    assert normalize_bus_id("18:00.0") == (0, 0x18, 0, 0)
    assert normalize_bus_id("0001:9A:00.1") != normalize_bus_id("0000:9A:00.1")
    with pytest.raises(ValueError, match="not a PCI bus id"):
        normalize_bus_id("GPU-1234")


@pytest.mark.parametrize(
    ("src", "dst", "peer", "nvlink", "count", "kind", "label"),
    [
        (0, 0, False, False, 0, "same", "X"),
        (0, 1, True, True, 18, "nvlink", "NV18"),
        (0, 1, True, False, 0, "pcie", "PCIe"),
        (0, 1, False, False, 0, "none", "-"),
        (0, 1, False, True, 18, "none", "-"),
    ],
)
def test_classify_link(src, dst, peer, nvlink, count, kind, label):
    link = classify_link(src, dst, peer, nvlink, count)
    assert (link.kind, link.label) == (kind, label)
