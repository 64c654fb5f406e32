"""syncless.compat.vllm driven the way vLLM's engine code drives its seed modules, on the CPU.

The sync check: a worker decorates its step with ``with_gpu_sync_check``,
its compiled model code holds ``gpu_sync_allowed()`` regions, it calls
``enable_gpu_sync_check()`` after warm-up and catches ``RuntimeError``; its
tests set the module attribute ``_SYNC_CHECK_MODE``. The CC copies:
``install()``, a D2H readback stream from ``new_external_d2h_stream()`` and
``register_inplace_h2d_target``; those need a GPU for real copies
(tests/gpu/compat/test_vllm_compat_gpu.py), so here they are checked for
what they do without one.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch

import syncless
import syncless.compat.vllm as vllm
from syncless import cc, syncs
from syncless._core.errors import MissingDependencyError, SyncViolation
from syncless.syncs import _debugmode, _hook

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.testing import CompileCounter  # noqa: E402

# What torch issues for a sync in debug mode "warn": a UserWarning raised from C code on the caller's line.
torch_sync_warning = functools.partial(warnings.warn, _hook.TORCH_SYNC_TEXT + " (Triggered internally at x.cpp:1.)",
                                       UserWarning)


@pytest.fixture
def detector_restored():
    mode_before = syncs.mode()
    yield
    syncs.disable()
    syncs.reset()
    syncs.set_mode(mode_before)
    assert warnings.showwarning is not _hook.showwarning
    assert _debugmode.armer.count == 0


def _fresh_import(env_value):
    env = {k: v for k, v in os.environ.items() if k != vllm.ENV_VAR}
    if env_value is not None:
        env[vllm.ENV_VAR] = env_value
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    code = ("import sys, syncless.compat.vllm as v; print(repr(v._SYNC_CHECK_MODE)); "
            "print(sorted(v.__all__)); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          check=True)
    return done.stdout.splitlines(), done.stderr


@pytest.mark.parametrize("value, expected", [(None, "None"), ("", "None"), ("off", "None"), (" OFF ", "None"),
                                             ("warn", "'warn'"), (" Error ", "'error'")])
def test_the_variable_is_read_at_import(value, expected):
    out, err = _fresh_import(value)
    assert out[0] == expected
    assert out[1] == str(sorted(["enable_gpu_sync_check", "gpu_sync_allowed", "install", "new_external_d2h_stream",
                                 "register_inplace_h2d_target", "with_gpu_sync_check"]))
    assert out[2] == "False"  # importing it needs no torch, let alone a GPU
    assert "VLLM_GPU_SYNC_CHECK" not in err


def test_a_bad_value_warns_at_the_users_import_and_leaves_the_check_off(tmp_path):
    out, err = _fresh_import("loud")
    assert out[0] == "None"
    assert "VLLM_GPU_SYNC_CHECK='loud' is not one of: unset or off, warn, error" in err
    with pytest.warns(syncs.SyncCheckConfigWarning, match="VLLM_GPU_SYNC_CHECK='1'") as caught:
        assert vllm.mode_from_env({vllm.ENV_VAR: "1"}) is None
    assert caught[0].filename == __file__  # the caller's line, not compat/vllm.py
    # Imported from the user's file: the warning names that file's import line.
    script = tmp_path / "worker.py"
    script.write_text("import os\nimport syncless.compat.vllm\n")
    env = {**os.environ, vllm.ENV_VAR: "loud", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120,
                          check=True)
    assert done.stderr.startswith(f"{script}:2: SyncCheckConfigWarning: VLLM_GPU_SYNC_CHECK='loud'"), done.stderr


def test_off_changes_nothing(monkeypatch, detector_restored):
    monkeypatch.setattr(vllm, "_SYNC_CHECK_MODE", None)
    syncs.set_mode("off")  # and syncless's own mode is off too

    def step():
        return 1

    assert vllm.with_gpu_sync_check(step) is step
    assert isinstance(vllm.gpu_sync_allowed(), contextlib.nullcontext)
    assert isinstance(vllm.gpu_sync_allowed(first_only=True), contextlib.nullcontext)
    with _debugmode.fake() as fake:
        vllm.enable_gpu_sync_check()
        assert not syncs.is_enabled() and fake.history == []
    with pytest.raises(TypeError, match=r"gpu_sync_allowed\(first_only=...\) expects a bool, got str"):
        vllm.gpu_sync_allowed(first_only="yes")


@pytest.mark.parametrize("native_mode", ["error", "warn"])
def test_the_vllm_names_follow_syncless_own_mode_when_theirs_is_unset(monkeypatch, detector_restored, native_mode):
    # SYNCLESS_SYNC_CHECK=error or pytest --sync-check=error, with VLLM_GPU_SYNC_CHECK unset: an intended sync
    # allowed with the vLLM name passes, as it does with syncs.allowed(); a hidden one is caught.
    monkeypatch.setattr(vllm, "_SYNC_CHECK_MODE", None)
    syncs.set_mode(native_mode)

    @vllm.with_gpu_sync_check
    def step(plant):
        if plant == "allowed":
            with vllm.gpu_sync_allowed():
                torch_sync_warning()
        elif plant == "native":
            with syncs.allowed():
                torch_sync_warning()
        else:
            torch_sync_warning()

    with _debugmode.fake():
        vllm.enable_gpu_sync_check()
        assert syncs.is_enabled() and syncs.mode() == native_mode
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an allowed sync neither raises nor warns
            step("allowed")
            step("native")
        if native_mode == "error":
            with pytest.raises(SyncViolation):
                step("hidden")
        else:
            with pytest.warns(syncs.SyncWarning):
                step("hidden")
        syncs.disable()


def test_setting_the_vllm_mode_back_to_none_gives_syncless_its_own_mode_back(monkeypatch, detector_restored):
    syncs.set_mode("record")
    monkeypatch.setattr(vllm, "_SYNC_CHECK_MODE", "error")
    vllm.with_gpu_sync_check(lambda: None)
    assert syncs.mode() == "error"
    monkeypatch.setattr(vllm, "_SYNC_CHECK_MODE", "warn")
    vllm.gpu_sync_allowed()
    assert syncs.mode() == "warn"
    monkeypatch.setattr(vllm, "_SYNC_CHECK_MODE", None)
    vllm.gpu_sync_allowed()
    assert syncs.mode() == "record"  # what it was before the vLLM mode overrode it
    # A mode set by hand meanwhile is kept: the vLLM names put back only what they changed.
    monkeypatch.setattr(vllm, "_SYNC_CHECK_MODE", "error")
    vllm.enable_gpu_sync_check()
    syncs.disable()
    syncs.set_mode("warn")
    monkeypatch.setattr(vllm, "_SYNC_CHECK_MODE", None)
    vllm.gpu_sync_allowed()
    assert syncs.mode() == "warn"


@pytest.mark.parametrize("compiled_first", [True, False], ids=["warm-up-before-enable", "compiled-after-enable"])
def test_an_engine_step_ported_from_vllm(monkeypatch, detector_restored, compiled_first):
    monkeypatch.setattr(vllm, "_SYNC_CHECK_MODE", "error")  # as vLLM's tests set the seed's mode
    dynamo.reset()

    def model_forward(x):  # the model code the engine compiles, with allow regions in it
        with vllm.gpu_sync_allowed():
            x = x * 2
        with vllm.gpu_sync_allowed(first_only=True):
            x = x + 1
        return torch.tanh(x)

    counter = CompileCounter()
    forward = torch.compile(model_forward, fullgraph=True, backend=counter)

    @vllm.with_gpu_sync_check
    def execute_model(x, plant=None):
        out = forward(x)
        if plant == "hidden":
            torch_sync_warning()  # PLANTED: a hidden sync in the step
        if plant == "once":
            with vllm.gpu_sync_allowed(first_only=True):  # a sync meant to happen once (site A)
                torch_sync_warning()
        if plant == "other site":
            with vllm.gpu_sync_allowed(first_only=True):  # another site (B): its own first entry
                torch_sync_warning()
        if plant == "allowed":
            with vllm.gpu_sync_allowed():
                torch_sync_warning()
        return out

    x = torch.randn(8)
    expected = model_forward(x)
    with _debugmode.fake():
        if compiled_first:
            assert torch.equal(execute_model(x), expected)  # warm-up before the gate, as a worker does
        vllm.enable_gpu_sync_check()
        assert syncs.is_enabled() and syncs.mode() == "error"
        assert torch.equal(execute_model(x), expected)
        caught = None
        try:
            execute_model(x, plant="hidden")
        except RuntimeError as err:  # how vLLM's code catches the seed's error
            caught = err
        assert isinstance(caught, SyncViolation), caught
        source = open(__file__).read().splitlines()
        assert "PLANTED" in source[caught.violation.lineno - 1]
        execute_model(x, plant="allowed")
        execute_model(x, plant="allowed")
        execute_model(x, plant="once")  # site A's first entry: allowed
        execute_model(x, plant="other site")  # site B's first entry: allowed (first_only is per caller line)
        with pytest.raises(RuntimeError, match="hidden GPU sync"):
            execute_model(x, plant="once")  # site A again: checked
        assert torch.equal(execute_model(x), expected)
        syncs.disable()
    assert counter.frame_count == 1, "enable_gpu_sync_check() made the compiled model code recompile"
    dynamo.reset()


def test_the_cc_names_without_a_gpu():
    # A D2H readback stream needs CUDA: the error says so (the GPU test uses one).
    if not torch.cuda.is_available():
        with pytest.raises(MissingDependencyError):
            vllm.new_external_d2h_stream()
        # Issue 35 item 11: an ImportError alone slipped past a ported `except RuntimeError` (what torch raises
        # for CUDA without a GPU); it is both.
        with pytest.raises(RuntimeError, match="needs a CUDA GPU") as info:
            vllm.new_external_d2h_stream()
        assert isinstance(info.value, syncless.NoGPUError) and isinstance(info.value, ImportError)
    # Unlike vLLM's (a silent no-op), a bad argument raises.
    with pytest.raises(TypeError, match="expects a torch.Tensor, got list"):
        vllm.register_inplace_h2d_target([1, 2])
    with pytest.raises(ValueError, match="strided CUDA tensor, got device=cpu"):
        vllm.register_inplace_h2d_target(torch.zeros(4))


@pytest.mark.parametrize("env, emulating", [(None, False), ("emulate", True)])
def test_install_is_cc_on_unless_syncless_cc_says(monkeypatch, env, emulating):
    monkeypatch.setattr(cc, "_cuda_available", lambda: True)  # pretend torch sees a GPU, as tests/unit/cc does
    if env is None:
        monkeypatch.delenv("SYNCLESS_CC", raising=False)
    else:
        monkeypatch.setenv("SYNCLESS_CC", env)
    try:
        assert vllm.install() is True
        assert cc.is_installed() and cc.is_emulating() is emulating
        assert vllm.install() is True  # a second call changes nothing
    finally:
        cc.uninstall()
    assert not cc.is_installed()


def test_install_without_cuda_patches_nothing(monkeypatch):
    monkeypatch.delenv("SYNCLESS_CC", raising=False)
    if torch.cuda.is_available():
        pytest.skip("this checks a torch without CUDA")
    assert vllm.install() is False
    assert not cc.is_installed()


def test_the_port_table_says_what_each_seed_name_does_and_raises():
    # docs/porting-from-vllm.md: one row per name of the seed's sync check and CC modules, saying what ours does
    # and what it raises (or that it raises nothing), and the differences a port meets (#35 items 6 and 7).
    page = (pathlib.Path(__file__).resolve().parents[3] / "docs" / "porting-from-vllm.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in page.splitlines() if line.startswith("| ") and line.count("|") > 2}
    seed_names = ["`VLLM_GPU_SYNC_CHECK`", "module attribute `_SYNC_CHECK_MODE`", "`enable_gpu_sync_check()`",
                  "`with_gpu_sync_check(fn)`", "`gpu_sync_allowed(first_only=False)`", "`install()`",
                  "`new_external_d2h_stream(device=None)`", "`register_inplace_h2d_target(t)`"]
    for name in seed_names:
        row = next((line for key, line in rows.items() if key.startswith(name)), None)
        assert row is not None, f"no row for {name}"
        assert "Raises" in row or "raises" in row, f"the row for {name} does not say what it raises: {row}"
    assert "`RuntimeError` in mode `error`" in rows and "`SYNC_ERROR_MESSAGE`" in rows
    differences = page[page.index("### The sync check"):page.index("### Confidential Computing copies")]
    assert "One mode for the process, not one per decorated function" in differences
    assert "`first_only` and warm-up" in differences
