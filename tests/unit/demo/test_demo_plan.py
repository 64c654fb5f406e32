"""The demo's plan (stages, devices, sizes) and its model split, on the CPU."""

import argparse
import dataclasses

import pytest
import torch

from syncless._core.exits import UsageError
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


@pytest.mark.parametrize("argv, message", [
    (("--stages", "0"), "argument --stages: must be at least 1, got 0"),
    (("--stages", "-1"), "argument --stages: must be at least 1, got -1"),
    (("--steps", "0"), "argument --steps: must be at least 1, got 0"),
    (("--batch", "0"), "argument --batch: must be at least 1, got 0"),
    (("--micro-batches", "0"), "argument --micro-batches: must be at least 1, got 0"),
    (("--steps", "many"), "argument --steps: expected a whole number, got 'many'"),
    (("--timeout-s", "-1"), "argument --timeout-s: must be a positive, finite number of seconds, got -1"),
    (("--timeout-s", "inf"), "argument --timeout-s: must be a positive, finite number of seconds, got inf"),
])
def test_bad_numbers_are_usage_errors_before_anything_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _args(*argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, gpus, message", [
    (("--stages", "9", "--model", "tiny"), 0, "--stages 9 is more than the tiny model's 4 layers"),
    (("--stages", "100"), 2, "--stages 100 is more than the large model's 8 layers"),
    (("--cc", "emulate", "--cpu"), 0, "--cc emulate needs a GPU"),
    (("--transport", "copy_engine"), 0, "--transport copy_engine needs CUDA GPUs"),
])
def test_options_that_cannot_run_together_are_usage_errors(argv, gpus, message):
    with pytest.raises(UsageError, match=message):
        plan(_args(*argv), gpus=gpus)


@pytest.mark.parametrize("name, value, argv, message", [
    ("SYNCLESS_PP_TRANSPORT", "copy_engine", (), "SYNCLESS_PP_TRANSPORT=copy_engine needs CUDA GPUs; unset SYNCLESS_PP_TRANSPORT$"),
    ("SYNCLESS_CC", "on", (), "SYNCLESS_CC=on needs a GPU: a CPU run has no host<->device copies; unset SYNCLESS_CC"),
    ("SYNCLESS_CC", "emulate", ("--cpu",), "SYNCLESS_CC=emulate needs a GPU: .*; unset SYNCLESS_CC or --cpu"),
])
def test_a_variable_is_refused_where_its_flag_is(monkeypatch, name, value, argv, message):
    """The flag and its variable get one check before any stage starts (#28 item 7)."""
    monkeypatch.setenv(name, value)
    with pytest.raises(UsageError, match=message):
        plan(_args(*argv), gpus=0)


def test_a_flag_beats_its_variable_in_the_check(monkeypatch):
    monkeypatch.setenv("SYNCLESS_PP_TRANSPORT", "copy_engine")
    monkeypatch.setenv("SYNCLESS_CC", "on")
    options = plan(_args("--transport", "torch_distributed", "--cc", "off"), gpus=0)
    assert (options.transport, options.cc_mode) == ("torch_distributed", "off")
    assert plan(_args(), gpus=2).transport is None  # on GPUs the stages read the variable themselves


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


def test_default_stages_follow_the_gpu_count():
    options = plan(_args(), gpus=4)
    assert options.stages == 4 and options.devices == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert options.micro_batches == 4


def test_defaults_pick_a_gpu_paced_model_on_gpus_and_a_quick_one_on_the_cpu():
    cpu, gpu = plan(_args(), gpus=0), plan(_args(), gpus=1)
    assert (cpu.model_name, cpu.steps, cpu.batch) == ("tiny", 32, 8)
    assert (gpu.model_name, gpu.steps, gpu.batch) == ("large", 128, 32)
    assert gpu.model.hidden == 8192


def test_both_runs_by_default_and_one_with_no_baseline():
    assert plan(_args(), gpus=0).runs == ["syncless", "torch.distributed"]
    assert plan(_args("--no-baseline"), gpus=0).runs == ["syncless"]
    assert plan(_args("--stages", "1"), gpus=0).runs == ["syncless"]  # one stage moves nothing


def test_the_pending_receive_is_measured_only_between_two_gpus():
    assert plan(_args(), gpus=2).measure_pending
    assert not plan(_args(), gpus=0).measure_pending
    assert not plan(_args("--stages", "2"), gpus=1).measure_pending  # both stages on one GPU
    assert not plan(_args("--stages", "3"), gpus=3).measure_pending


def test_one_stage_per_layer_is_allowed():
    options = plan(_args("--stages", "4", "--model", "tiny"), gpus=0)
    assert options.stages == 4 and options.devices == ["cpu"] * 4


def test_options_pass_through_as_given():
    options = plan(_args("--micro-batches", "3", "--batch", "5", "--transport", "copy_engine", "--cc", "emulate"),
                   gpus=2)
    assert (options.micro_batches, options.batch, options.transport, options.cc_mode) == (3, 5, "copy_engine",
                                                                                           "emulate")
    auto = plan(_args("--transport", "auto"), gpus=2)
    assert auto.transport is None and auto.cc_mode is None  # None: the stages read the env registry


@pytest.mark.parametrize("steps, every", [(1, 1), (3, 1), (4, 2), (100, 50)])
def test_progress_is_printed_about_twice_per_run(steps, every):
    assert plan(_args("--steps", str(steps)), gpus=0).progress_every == every


@pytest.mark.parametrize("stages", [0, -1, 5])
def test_split_layers_rejects_impossible_stage_counts(stages):
    with pytest.raises(ValueError, match=f"between 1 and the layer count \\(4\\), got {stages}"):
        split_layers(4, stages)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_valid_models(name):
    config = PRESETS[name]
    config.validate()
    assert config.head_dim * config.heads == config.hidden


@pytest.mark.parametrize("changes, message", [
    ({"layers": 0}, "model layers must be positive, got 0"),
    ({"vocab": -1}, "model vocab must be positive, got -1"),
    ({"hidden": 1000, "heads": 16}, "hidden \\(1000\\) must be a multiple of heads \\(16\\)"),
])
def test_model_sizes_that_cannot_form_a_model_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(PRESETS["tiny"], **changes).validate()


def test_stages_sharing_a_gpu_run_without_the_nccl_baseline():
    # NCCL refuses two ranks on one GPU ("Duplicate GPU detected", seen on an H200): only syncless's run.
    assert plan(_args("--stages", "2"), gpus=1).runs == ["syncless"]
    assert plan(_args("--stages", "3"), gpus=2).runs == ["syncless"]
    assert plan(_args("--stages", "2"), gpus=2).runs == ["syncless", "torch.distributed"]


def test_a_cpu_run_that_would_not_fit_in_memory_is_refused_before_start():
    """#28 item 6: --model large on a 24 GiB machine: the kernel killed a stage; check the memory up front."""
    from syncless.demo import check_cpu_memory, cpu_memory_nbytes

    options = plan(_args("--model", "large"), gpus=0)
    needed = cpu_memory_nbytes(options)
    # 8 layers of 12 * 8192^2 float32 weights alone are 24 GiB
    assert needed > 8 * 12 * 8192 * 8192 * 4
    with pytest.raises(UsageError, match=r"the large model needs about 3\d\.\d GiB .* has 24\.0 GiB available; "
                                         r"use --model medium"):
        check_cpu_memory(options, 24 << 30)
    check_cpu_memory(options, needed)  # fits exactly: no error
    check_cpu_memory(options, None)  # unknown: no check
    tiny = plan(_args(), gpus=0)
    with pytest.raises(UsageError, match="the tiny model needs .*; free some memory"):
        check_cpu_memory(tiny, 1 << 20)


def test_the_memory_estimate_matches_what_a_stage_allocates():
    from syncless.demo._config import stage_nbytes

    cfg = PRESETS["tiny"]
    for first, last in [(True, False), (False, True), (True, True)]:
        stage = Stage(cfg, range(0, 2), first=first, last=last, batch=6, device=torch.device("cpu"),
                      dtype=torch.float32)
        held = sum(t.numel() * t.element_size() for t in [*stage.parameters(), *stage.buffers()]
                   if t.dtype == torch.float32)
        estimate = stage_nbytes(cfg, 2, first=first, last=last, rows=6, element_nbytes=4)
        assert 0.97 * held <= estimate <= held  # the norms' few weights are left out
