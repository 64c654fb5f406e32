"""Every send link of this process is recorded, whatever its backend or depth (CPU only).

A ``depth="auto"`` link stops posting while this process also sends to the process it receives
from (``_copy_engine_auto``): the cycle through a slot wait that ``docs/pp-auto.md`` describes.
The link back is often a fixed-depth one (what the docs recommend for it) or the torch.distributed
fallback, so those must be recorded too, and dropped when they close or die.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import pathlib
import random

import pytest
import torch

from syncless.pp import _copy_engine_auto as auto
from syncless.pp._group import StageMap
from syncless.pp._layout import TensorSpec
from syncless.pp._torch_dist import TorchDistTransport

_spec = importlib.util.spec_from_file_location(
    "auto_transport_cpu", pathlib.Path(__file__).with_name("test_auto_transport_cpu.py")
)
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)

PEER = 4_000_000 + os.getpid() % 1000  # a process id that is not this process's


@pytest.mark.parametrize("depth", [0, 2])
def test_a_fixed_depth_copy_engine_link_is_recorded_until_it_is_gone(depth, monkeypatch):
    monkeypatch.setattr(sim.meta_channel.Sender, "peer_pid", lambda self: PEER)
    before = auto._sends_to.get(PEER, 0)
    link = sim.Link(sim.SimGPU(random.Random(0)), depth=depth)
    try:
        assert auto._sends_to.get(PEER, 0) == before + 1
        assert auto.links_back_to(PEER)  # an auto link receiving from PEER now stops posting
    finally:
        link.close()
    link.sender._forget_links()  # what close() does first (the simulated transport has no GPU to tear down)
    assert auto._sends_to.get(PEER, 0) == before
    link = sim.Link(sim.SimGPU(random.Random(0)), depth=depth)
    link.close()
    del link
    gc.collect()  # a transport dropped without close(): its finalizer drops the link
    assert auto._sends_to.get(PEER, 0) == before


def test_a_torch_distributed_link_is_recorded_until_close():
    transport = TorchDistTransport(
        group=object(), side_group=None, stages=StageMap((0, 1), 0), tag=1000, recv_specs={},
        send_specs={"h": TensorSpec(torch.float32, (4,), 2)}, persistent={}, device=torch.device("cpu"),
        timeout_s=5.0, fallback_reason=None, next_pid=PEER,
    )
    assert auto.links_back_to(PEER)
    transport.close()
    assert not auto.links_back_to(PEER)
