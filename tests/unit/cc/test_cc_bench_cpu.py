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
