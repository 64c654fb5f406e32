"""The pytest plugin, run through pytester.

From a source tree the plugin is not installed, so each run loads it with
``-p syncless.syncs._pytest_plugin``; ``-p no:syncless`` first blocks the
entry point of an installed copy, so the module is never registered twice.
On a machine without CUDA the inner tests fake torch's debug-mode switch
and issue torch's warning themselves; the GPU test syncs for real.
"""

from __future__ import annotations

import os
import re
import sys
import warnings

import pytest
import torch

from syncless import syncs
from syncless.syncs import _debugmode, _hook

PLUGIN = ["-p", "no:syncless", "-p", "syncless.syncs._pytest_plugin", "--strict-markers", "-p", "no:cacheprovider"]

FAKE_CONFTEST = """
import functools, warnings
import pytest
from syncless.syncs import _debugmode

sync = functools.partial(warnings.warn, "called a synchronizing CUDA operation", UserWarning)

@pytest.fixture(autouse=True)
def fake_debug_mode():
    with _debugmode.fake():
        yield
"""

FAKE_TESTS = """
import pytest
from conftest import sync

@pytest.mark.sync_checked
def test_syncs():
    x = 1
    sync()

@pytest.mark.sync_checked
def test_quiet():
    assert sum(range(4)) == 6

def test_unmarked_syncs():
    sync()
"""


@pytest.fixture
def untouched():
    """The inner runs share this process: check they leave the detector as they found it.

    ``warnings.showwarning`` itself is not compared: pytest swaps it inside its
    own ``catch_warnings`` blocks (around ``pytest_configure`` and each test),
    so only "our hook and our filter are gone" is a property of the plugin.
    """
    before = (syncs.mode(), syncs.is_enabled(), torch.Tensor.to, torch.Tensor.copy_, torch.cuda.synchronize)
    yield
    assert (syncs.mode(), syncs.is_enabled(), torch.Tensor.to, torch.Tensor.copy_, torch.cuda.synchronize) == before
    assert warnings.showwarning is not _hook.showwarning
    assert not [f for f in warnings.filters if getattr(f[1], "pattern", None) == re.escape(_hook.TORCH_SYNC_TEXT)]


@pytest.fixture
def isolated(monkeypatch):
    """Runs that enable the detector go to a subprocess: the parent's warnings state stays out of it.

    (Restoration in-process is checked by ``test_in_process_run_leaves_no_hook_behind``.)
    """
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))


def test_in_process_run_leaves_no_hook_behind(pytester, untouched):
    _fake_project(pytester)
    with _debugmode.fake():  # the detector enables at configure time, as it does on a GPU
        result = pytester.runpytest(*PLUGIN, "--sync-check=error", "-W", "ignore::UserWarning")
    result.assert_outcomes(passed=2, failed=1)


def _fake_project(pytester):
    pytester.makeconftest(FAKE_CONFTEST)
    pytester.makepyfile(test_hot=FAKE_TESTS)


def test_without_the_option_it_does_nothing(pytester, untouched):
    _fake_project(pytester)
    result = pytester.runpytest(*PLUGIN, "-W", "ignore::UserWarning")
    result.assert_outcomes(passed=3)
    assert "syncless sync check" not in result.stdout.str()


def test_error_fails_the_test_that_syncs_and_passes_the_quiet_one(pytester, isolated):
    _fake_project(pytester)
    result = pytester.runpytest_subprocess(*PLUGIN, "--sync-check=error", "-W", "ignore::UserWarning")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*SyncViolation: hidden GPU sync in a checked region at *test_hot.py:7 (in test_syncs)*"])
    assert "test_hot.py:14" not in result.stdout.str()  # the unmarked test is not checked


def test_record_prints_the_sites_in_the_terminal_summary(pytester, isolated):
    _fake_project(pytester)
    result = pytester.runpytest_subprocess(*PLUGIN, "--sync-check=record", "-W", "ignore::UserWarning")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines([
        "*syncless sync check (record)*",
        "*1 hidden GPU sync(s) at 1 call site(s)*",
        "*1  *test_hot.py:7 *explicit*",
    ])


CANNOT_START_CONFTEST = """
from syncless.syncs import _debugmode

_faking = _debugmode.fake()  # kept referenced: a collected generator would put the real one back
_stand_in = _faking.__enter__()  # the plugin enables the detector after conftests load
_stand_in.unavailable_reason = lambda: "this torch build has no CUDA sync debug mode (forced by the test)"
"""


@pytest.mark.parametrize("spread", [[], ["-p", "xdist", "-n", "2"]], ids=["serial", "xdist"])
def test_error_fails_a_run_in_which_nothing_could_be_checked(pytester, isolated, spread):
    # The strict form, as on a CPU-only torch: passing with "NOTHING WAS CHECKED" would read as all clear.
    if spread:
        pytest.importorskip("xdist")
    pytester.makeconftest(CANNOT_START_CONFTEST)
    pytester.makepyfile(test_cpu="import pytest\n\n@pytest.mark.sync_checked\ndef test_body():\n    assert True\n")
    result = pytester.runpytest_subprocess(*PLUGIN, *spread, "--sync-check=error")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines(["syncless: NOTHING WAS CHECKED: this torch build has no CUDA sync debug mode*",
                                 "syncless: --sync-check=error FAILS THIS RUN because nothing could be checked*"])
    for lenient in ("warn", "record"):  # how to try the plugin without a GPU
        assert pytester.runpytest_subprocess(*PLUGIN, *spread, f"--sync-check={lenient}").ret == pytest.ExitCode.OK


FIRST_ONLY_TESTS = """
import pytest
from syncless import syncs
from conftest import sync

def load_weights():
    with syncs.allowed(first_only=True):  # a sync meant to happen once per run of the code
        sync()

@pytest.mark.sync_checked
def test_a():
    load_weights()

@pytest.mark.sync_checked
def test_b():
    load_weights()
"""


@pytest.mark.parametrize("selection", [[], ["-k", "test_b"], ["-p", "xdist", "-n", "2"]],
                         ids=["both", "b-alone", "xdist"])
def test_a_first_only_site_is_fresh_in_every_test(pytester, isolated, selection):
    # Spent per session, test_b's outcome depended on whether test_a ran before it in the same process.
    if "xdist" in selection:
        pytest.importorskip("xdist")
    pytester.makeconftest(FAKE_CONFTEST)
    pytester.makepyfile(test_once=FIRST_ONLY_TESTS)
    result = pytester.runpytest_subprocess(*PLUGIN, *selection, "--sync-check=error", "-W", "ignore::UserWarning")
    result.assert_outcomes(passed=1 if "-k" in selection else 2)


PORTED_TESTS = """
import pytest
from syncless.compat import vllm
from conftest import sync

@vllm.with_gpu_sync_check
def step():
    sync()

@pytest.mark.sync_checked
def test_allowed_with_the_vllm_name():
    with vllm.gpu_sync_allowed():  # intended, and allowed with the seed's name
        sync()

def test_a_hidden_sync_in_a_ported_step():
    step()
"""


def test_ported_vllm_code_follows_sync_check_error(pytester, isolated, monkeypatch):
    # VLLM_GPU_SYNC_CHECK unset: the compat allow held nothing (a nullcontext) and with_gpu_sync_check checked
    # nothing, so the allowed sync failed its test and the hidden one passed.
    monkeypatch.delenv("VLLM_GPU_SYNC_CHECK", raising=False)
    pytester.makeconftest(FAKE_CONFTEST)
    pytester.makepyfile(test_ported=PORTED_TESTS)
    result = pytester.runpytest_subprocess(*PLUGIN, "--sync-check=error", "-W", "ignore::UserWarning")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*_ test_a_hidden_sync_in_a_ported_step _*",
                                 "*SyncViolation: hidden GPU sync in a checked region at *test_ported.py:7 (in step)*"])


def test_where_the_detector_cannot_start_the_summary_says_so_once(pytester, isolated):
    # As on a CPU-only build of torch (forced here, so that it also holds on a GPU machine).
    pytester.makeconftest(CANNOT_START_CONFTEST)
    pytester.makepyfile(test_cpu="""
        import pytest

        @pytest.mark.sync_checked
        def test_body():
            assert True
    """)
    result = pytester.runpytest_subprocess(*PLUGIN, "--sync-check=record")
    result.assert_outcomes(passed=1)
    out = result.stdout.str()
    result.stdout.fnmatch_lines([
        "*syncless sync check (record)*",
        "syncless: NOTHING WAS CHECKED: this torch build has no CUDA sync debug mode (forced*",
    ])
    assert out.count("nothing was checked") + out.count("NOTHING WAS CHECKED") == 1, out
    assert "no hidden GPU syncs recorded" not in out


def test_warn_reports_a_sync_warning(pytester, isolated):
    _fake_project(pytester)
    result = pytester.runpytest_subprocess(*PLUGIN, "--sync-check=warn", "-W", "ignore::UserWarning",
                                "-W", "default::syncless.syncs.SyncWarning")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*SyncWarning: hidden GPU sync in a checked region at *test_hot.py:7*"])


def test_the_marker_is_registered_for_strict_markers(pytester, untouched):
    result = pytester.runpytest(*PLUGIN, "--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.sync_checked:*"])


@pytest.mark.gpu
def test_error_with_a_real_gpu_sync(pytester, isolated):
    pytester.makepyfile(test_gpu="""
        import pytest, torch

        @pytest.mark.sync_checked
        def test_item():
            x = torch.randn(16, device="cuda")
            return x.sum().item()

        @pytest.mark.sync_checked
        def test_gpu_only():
            x = torch.randn(16, device="cuda")
            assert (x * 2).shape == (16,)
    """)
    result = pytester.runpytest_subprocess(*PLUGIN, "--sync-check=error")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*SyncViolation: hidden GPU sync in a checked region at *test_gpu.py:6 (in test_item)*"])


# ---- a bad SYNCLESS_SYNC_CHECK or SYNCLESS_SYNC_BACKEND in the environment ------------------------------


class BadEnv:
    def __init__(self, name, value, allowed, consequence, probe):
        self.name, self.value, self.consequence = name, value, consequence
        self.text = f"{name}={value!r} is not valid; allowed: {allowed}"
        self.probe = probe  # what `import syncless.syncs` then prints


BAD_ENVS = {
    "SYNCLESS_SYNC_CHECK": BadEnv("SYNCLESS_SYNC_CHECK", "sometimes", "off, warn, error, record",
                                  "the hidden-sync detector stays off", "mode off"),
    "SYNCLESS_SYNC_BACKEND": BadEnv("SYNCLESS_SYNC_BACKEND", "cuptii", "auto, torch, cupti",
                                    "the hidden-sync detector uses the backend auto", "backend auto"),
}
PROBE = ("import syncless.syncs as s, syncless.compat.vllm; from syncless.syncs import _backend as b; "
         "print('mode', s.mode()); print('backend', b.backend.requested); print('error', s.env_error() or b.env_error())")


@pytest.fixture(params=list(BAD_ENVS))
def bad_env(request, isolated, monkeypatch):
    bad = BAD_ENVS[request.param]
    monkeypatch.setenv(bad.name, bad.value)
    return bad


def test_a_bad_env_value_only_warns_in_a_run_without_sync_check(pytester, bad_env):
    _fake_project(pytester)
    result = pytester.runpytest_subprocess(*PLUGIN)
    result.assert_outcomes(passed=3)
    output = result.stdout.str() + result.stderr.str()
    assert output.count(bad_env.text) == 1, output
    assert bad_env.consequence in output


def test_a_bad_env_value_never_fails_a_test_that_does_not_use_syncless(pytester, bad_env):
    # The plugin is loaded as the installed entry point would load it, and the test knows nothing of syncless.
    pytester.makepyfile(test_trivial="def test_trivial():\n    assert 1 + 1 == 2\n")
    result = pytester.runpytest_subprocess("-p", "no:syncless", "-p", "syncless.syncs._pytest_plugin", "-p",
                                           "no:cacheprovider")
    output = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.OK, output
    result.assert_outcomes(passed=1)
    # The one warning from the import. Whether pytest counts it in its summary depends on its version
    # (9.2 captures warnings issued while `-p` plugins are imported, 9.1 leaves them on stderr), so the
    # output is what is checked, not the summary's count.
    assert output.count(bad_env.text) == 1, output


def test_a_bad_env_value_fails_a_run_with_sync_check_as_a_usage_error(pytester, bad_env):
    _fake_project(pytester)
    result = pytester.runpytest_subprocess(*PLUGIN, "--sync-check=error")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --sync-check=error: {bad_env.text}; fix or unset it"])
    assert "Traceback" not in result.stderr.str()


def test_a_bad_env_value_never_breaks_the_import(pytester, bad_env):
    # Even with every warning turned into an error: the message is logged instead.
    for warnings_flag in ("default", "error"):
        result = pytester.run(sys.executable, "-W", warnings_flag, "-c", PROBE)
        assert result.ret == 0, result.stderr.str()
        result.stdout.fnmatch_lines([bad_env.probe, f"error {bad_env.text}"])
        assert result.stderr.str().count(bad_env.text) == 1, result.stderr.str()
        assert "Traceback" not in result.stderr.str()


def test_a_good_env_value_has_no_error(pytester, isolated, monkeypatch):
    monkeypatch.setenv("SYNCLESS_SYNC_CHECK", " Record ")
    result = pytester.run(sys.executable, "-W", "error", "-c",
                          "import syncless.syncs as s; print('mode', s.mode()); print('error', s.env_error())")
    assert result.ret == 0, result.stderr.str()
    result.stdout.fnmatch_lines(["mode record", "error None"])
