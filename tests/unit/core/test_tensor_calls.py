"""Parsing of ``Tensor.to`` calls shared by syncs and cc."""

import pytest
import torch

from syncless._core.tensor_calls import maybe_non_blocking_to, parse_to


@pytest.mark.parametrize(
    ("args", "kwargs", "maybe"),
    [
        (("cuda",), {}, False),
        (("cuda",), {"non_blocking": True}, True),
        (("cuda",), {"non_blocking": False}, False),
        (("cuda", None, True), {}, True),
        (("float16", True), {}, True),
        (("cuda", None, False), {}, False),
        ((), {"device": "cuda"}, False),
    ],
)
def test_maybe_non_blocking_to(args, kwargs, maybe):
    assert maybe_non_blocking_to(args, kwargs) is maybe


def test_parse_to_reads_calls_like_torch_and_ignores_copy():
    assert parse_to(("cpu",), {"non_blocking": True}) == (torch.device("cpu"), None, True, None)
    assert parse_to(("cpu",), {"non_blocking": True, "copy": True}) == (torch.device("cpu"), None, True, None)
    assert parse_to((torch.float16,), {}) == (None, torch.float16, False, None)
    with pytest.raises(TypeError):
        parse_to(("cpu",), {"nonsense": 1})
