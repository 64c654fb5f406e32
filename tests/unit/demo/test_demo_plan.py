"""The demo's plan (stages, devices, sizes) and its model split, on the CPU."""

import argparse

import pytest
import torch

from syncless.demo import add_arguments, plan
from syncless.demo._config import PRESETS, split_layers
from syncless.demo._model import Stage


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_without_gpu_are_two_cpu_stages():
    options = plan(_args(), gpus=0)
    assert options.stages == 2 and options.devices == ["cpu", "cpu"]
    assert options.model.hidden == PRESETS["tiny"].hidden


def test_defaults_with_two_gpus_put_one_stage_on_each():
    options = plan(_args(), gpus=2)
    assert options.devices == ["cuda:0", "cuda:1"]
    assert options.micro_batches == 2


def test_more_stages_than_gpus_share_them():
    assert plan(_args("--stages", "3"), gpus=2).devices == ["cuda:0", "cuda:1", "cuda:0"]


def test_cache_is_long_enough_for_every_step():
    options = plan(_args("--steps", "1000", "--model", "tiny"), gpus=0)
    assert options.model.max_tokens >= 1000 + options.warmup_steps


@pytest.mark.parametrize("argv", [("--stages", "0"), ("--stages", "9", "--model", "tiny"), ("--steps", "0"), ("--batch", "0")])
def test_bad_options_raise_clear_errors(argv):
    with pytest.raises(ValueError):
        plan(_args(*argv), gpus=0)


def test_split_layers_covers_every_layer_once():
    for layers in range(1, 10):
        for stages in range(1, layers + 1):
            ranges = split_layers(layers, stages)
            flat = [i for r in ranges for i in r]
            assert flat == list(range(layers))
            assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_split_model_computes_what_the_whole_model_computes():
    cfg = PRESETS["tiny"]
    rows = 3
    ids = torch.randint(0, cfg.vocab, (rows,))
    positions = torch.zeros(rows, dtype=torch.int64)
    kwargs = dict(batch=rows, device=torch.device("cpu"), dtype=torch.float32, seed=5)
    with torch.inference_mode():
        whole = Stage(cfg, range(cfg.layers), first=True, last=True, **kwargs)
        expected = whole(ids, positions, 0, 0)
        parts = [Stage(cfg, r, first=i == 0, last=i == 1, **kwargs) for i, r in enumerate(split_layers(cfg.layers, 2))]
        hidden = parts[0](ids, positions, 0, 0)
        got = parts[1](hidden, None, 0, 0)
    assert torch.equal(got, expected)
