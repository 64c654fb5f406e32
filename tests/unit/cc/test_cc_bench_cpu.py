"""`syncless bench cc` says clearly that it needs a GPU."""

import argparse

import pytest
import torch

from syncless._core.errors import MissingDependencyError


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_bench_cc_needs_a_gpu():
    from syncless.bench import _cc

    with pytest.raises(MissingDependencyError, match="needs a CUDA GPU"):
        _cc.run(argparse.Namespace(out=None, quick=True), lambda message: None)


def test_the_host_bound_rounds_run_every_setup_once_each_in_a_rotated_order():
    from syncless.bench import _cc

    setups = _cc.HOST_BOUND_SETUPS
    orders = [_cc.rotated(setups, index) for index in range(len(setups))]
    assert all(sorted(order) == sorted(setups) for order in orders)  # each round runs every setup once
    assert sorted(order[0] for order in orders) == sorted(setups)  # each setup runs first in one round of len()
    assert orders[0] == setups and _cc.rotated(setups, len(setups)) == setups
