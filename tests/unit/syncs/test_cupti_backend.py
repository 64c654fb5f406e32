"""The CUPTI backend on the CPU: merging the layers, attribution, blocked time, fallback.

The stand-in ``fake_cupti`` plays cupti-python and the driver (which calls
exist, the one-subscriber rule, callbacks with the parameters in memory,
what each address is); the backend's decisions are the real ones.
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings

import pytest
import torch

from syncless import syncs
from syncless._core import config
from syncless._core.errors import ConfigError, MissingDependencyError, SyncViolation
from syncless._core.logs import forget_logged
from syncless.syncs import _backend, _debugmode, _report
from syncless.syncs import _cupti_rules as rules

from . import fake_cupti as fake

D2H, H2D, D2D, H2H = rules.KIND_D2H, rules.KIND_H2D, rules.KIND_D2D, rules.KIND_H2H


def here() -> int:
    """The line number of the caller's next line."""
    return sys._getframe(1).f_lineno + 1


@pytest.fixture
def cupti_env(restored_globals, monkeypatch):
    """The detector in record mode, backend auto, on the stand-in cupti and a fake debug-mode switch."""
    fake.driver.reset()
    monkeypatch.setitem(sys.modules, "cupti", fake)
    layers = _backend.backend
    saved = (layers.requested, layers.api, layers.pointer_types)
    layers.requested, layers.api, layers.pointer_types = "auto", None, fake.pointer_types
    forget_logged("cupti")
    forget_logged("backend")
    with _debugmode.fake():
        syncs.set_mode("record")
        syncs.reset()
        yield layers
        syncs.disable()
        syncs.reset()
    layers.requested, layers.api, layers.pointer_types = saved
    layers.failure = None
    assert not fake.driver.subscribers, "the CUPTI subscription outlived the test"


def enabled(layers):
    assert syncs.enable()
    return layers


def rows_at(report, line: int):
    return [s for s in report.sites if s.first.lineno == line and s.first.filename == __file__]


def test_an_item_like_op_is_one_sync_seen_by_torch_and_cupti(cupti_env):
    enabled(cupti_env)
    with syncs.checking():
        for _ in range(3):
            line = here()
            fake.torch_op([("cudaMemcpyAsync", [fake.PAGEABLE_ADDR, fake.DEVICE_ADDR, 4, D2H, 0]),
                           ("cudaStreamSynchronize", [0])])
    found = syncs.report()
    assert len(found.sites) == 1, found.format()
    site = found.sites[0]
    assert (site.first.lineno, site.count) == (line, 3)
    assert site.layers == ("torch", "cupti")
    assert site.api_calls == {"cudaMemcpyAsync": 3, "cudaStreamSynchronize": 3}
    assert site.timed_count == 3
    text = found.format()
    assert "torch+cupti" in text and "blocked ms" in text and "CUDA call: cudaStreamSynchronize x3" in text


def test_a_torch_warning_that_comes_first_still_makes_one_sync(cupti_env):
    enabled(cupti_env)
    with syncs.checking():
        for _ in range(2):
            line = here()
            fake.warn_then_call([("cudaMemcpyAsync", [fake.PAGEABLE_ADDR, fake.DEVICE_ADDR, 4, D2H, 0]),
                                 ("cudaStreamSynchronize", [0])])
    (site,) = syncs.report().sites
    assert (site.first.lineno, site.count, site.layers) == (line, 2, ("torch", "cupti"))
    assert site.api_calls == {"cudaMemcpyAsync": 2, "cudaStreamSynchronize": 2} and site.timed_count == 2


def test_a_wait_syncless_makes_for_the_driver_is_not_a_sync(cupti_env):
    # The CC emulator's and the staging path's driver waits stand for what the driver does under CC: on an H200 the
    # demo with --cc emulate reported its own `host.to(device, non_blocking=True)` 32 times before this.
    from syncless._core.driver_waits import standing_for_the_driver

    enabled(cupti_env)
    with syncs.checking():
        with standing_for_the_driver():
            fake.call("cuStreamSynchronize", [0])
        line = here()
        fake.call("cuStreamSynchronize", [0])  # the user's own wait still counts
    found = syncs.report()
    assert [(s.first.lineno, s.count) for s in found.sites] == [(line, 1)]


def test_a_sync_only_cupti_sees_is_counted_per_call_at_the_users_line(cupti_env):
    enabled(cupti_env)
    with syncs.checking():
        for _ in range(3):
            line = here()
            fake.call("cuStreamSynchronize", [0])
        other = here()
        fake.call("cuMemFree_v2", [fake.DEVICE_ADDR])
    found = syncs.report()
    assert [(s.first.lineno, s.count, s.layers) for s in found.sites] == [(line, 3, ("cupti",)), (other, 1, ("cupti",))]
    assert found.sites[0].first.kind == _report.KIND_WAIT
    assert found.sites[1].first.kind == _report.KIND_ALLOCATOR
    assert "fake.call(\"cuStreamSynchronize\", [0])` made a CUDA call that blocks the host" in found.sites[0].first.operation
    assert "test_cupti_backend.py" in found.format() and "fake_cupti" not in found.format()


def test_a_wrapped_wait_absorbs_the_call_it_makes(cupti_env, monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize_device)
    enabled(cupti_env)
    with syncs.checking():
        line = here()
        torch.cuda.synchronize()
    found = syncs.report()
    assert len(found.sites) == 1, found.format()
    site = found.sites[0]
    assert (site.first.lineno, site.count, site.layers) == (line, 1, ("wrapper", "cupti"))
    assert site.api_calls == {"cudaDeviceSynchronize": 1}
    assert site.timed_count == 1 and site.blocked_max_ns >= 2_000_000  # the host was in the call >= 2 ms
    syncs.disable()


def test_a_runtime_call_answered_by_watched_driver_calls_counts_once(cupti_env):
    enabled(cupti_env)
    with syncs.checking():
        line = here()
        fake.call("cudaMemcpy", [fake.PAGEABLE_ADDR, fake.DEVICE_ADDR, 64, D2H],
                  body=lambda: fake.call("cuMemcpyDtoH_v2", [fake.PAGEABLE_ADDR, fake.DEVICE_ADDR, 64]))
    (site,) = syncs.report().sites
    assert (site.first.lineno, site.count, site.api_calls) == (line, 1, {"cudaMemcpy": 1})


@pytest.mark.parametrize(("name", "params"), [
    ("cudaMemcpyAsync", [fake.DEVICE_ADDR, fake.PINNED_ADDR, 64, H2D, 0]),   # pinned H2D async
    ("cudaMemcpyAsync", [fake.PINNED_ADDR, fake.DEVICE_ADDR, 64, D2H, 0]),   # D2H into pinned, async
    ("cudaMemcpyAsync", [fake.DEVICE_ADDR, fake.DEVICE_ADDR, 64, D2D, 0]),   # D2D async
    ("cudaMemcpy", [fake.DEVICE_ADDR, fake.DEVICE_ADDR, 64, D2D]),           # D2D: no host sync
    ("cuMemcpyHtoDAsync_v2", [fake.DEVICE_ADDR, fake.PINNED_ADDR, 64, 0]),
    ("cuMemcpyAsync", [fake.DEVICE_ADDR, fake.PINNED_ADDR, 64, 0]),
    ("cudaMemset", [fake.DEVICE_ADDR, 0, 64]),                              # into device memory: async to the host
    ("cuMemsetD8_v2", [fake.DEVICE_ADDR, 0, 64]),
    ("cudaFree", [0]),                                                      # cudaFree(NULL) frees nothing
    ("cudaMemsetAsync", [fake.PINNED_ADDR, 0, 64, 0]),                      # not watched: always async
    ("cudaLaunchKernel", [0, 0, 0, 0, 0, 0]),
    ("cuMemUnmap", [fake.DEVICE_ADDR, 64]),
    ("cudaEventQuery", [0]),
])
def test_calls_that_do_not_block_are_silent(cupti_env, name, params):
    enabled(cupti_env)
    with syncs.checking():
        fake.call(name, params)
        fake.call(name, params)
    assert not syncs.report(), syncs.report().format()


@pytest.mark.parametrize(("name", "params", "kind", "words"), [
    ("cudaMemcpyAsync", [fake.DEVICE_ADDR, fake.PAGEABLE_ADDR, 64, H2D, 0], _report.KIND_BLOCKING_COPY, "pageable"),
    ("cudaMemcpyAsync", [fake.PAGEABLE_ADDR, fake.DEVICE_ADDR, 64, D2H, 0], _report.KIND_BLOCKING_COPY, "pageable"),
    ("cudaMemcpyAsync_ptsz", [fake.PINNED_ADDR, fake.PAGEABLE_ADDR, 64, H2H, 0], _report.KIND_BLOCKING_COPY, "host to host"),
    ("cudaMemcpy", [fake.DEVICE_ADDR, fake.PINNED_ADDR, 64, H2D], _report.KIND_BLOCKING_COPY, "pinned"),
    ("cudaMemcpy", [fake.PINNED_ADDR, fake.DEVICE_ADDR, 64, rules.KIND_DEFAULT], _report.KIND_BLOCKING_COPY, "device to host"),
    ("cudaMemcpy", [fake.DEVICE_ADDR, fake.MANAGED_ADDR, 64, rules.KIND_DEFAULT], _report.KIND_BLOCKING_COPY, "Unified"),
    ("cudaMemcpy2D", [fake.PAGEABLE_ADDR, 64, fake.DEVICE_ADDR, 64, 64, 2, D2H], _report.KIND_BLOCKING_COPY, "pageable"),
    ("cuMemcpyDtoHAsync_v2", [fake.PAGEABLE_ADDR, fake.DEVICE_ADDR, 64, 0], _report.KIND_BLOCKING_COPY, "pageable"),
    ("cuMemcpyHtoD_v2", [fake.DEVICE_ADDR, fake.PAGEABLE_ADDR, 64], _report.KIND_BLOCKING_COPY, "pageable"),
    ("cuMemcpyAsync", [fake.PAGEABLE_ADDR, fake.DEVICE_ADDR, 64, 0], _report.KIND_BLOCKING_COPY, "pageable"),
    ("cudaMemset", [fake.PINNED_ADDR, 0, 64], _report.KIND_MEMSET, "pinned"),
    ("cuMemsetD8_v2", [fake.MANAGED_ADDR, 0, 64], _report.KIND_MEMSET, "managed"),
    ("cudaFreeHost", [fake.PINNED_ADDR], _report.KIND_ALLOCATOR, "synchronizes the device"),
    ("cuMemFreeHost", [fake.PINNED_ADDR], _report.KIND_ALLOCATOR, "synchronizes the device"),
    ("cuEventSynchronize", [0], _report.KIND_WAIT, "event"),
    ("cuCtxSynchronize_v2", [], _report.KIND_WAIT, "context"),
])
def test_calls_that_block_are_reported_once_with_why(cupti_env, name, params, kind, words):
    enabled(cupti_env)
    with syncs.checking():
        line = here()
        fake.call(name, params)
    (site,) = syncs.report().sites
    assert (site.first.lineno, site.count, site.first.kind, list(site.api_calls)) == (line, 1, kind, [name])
    assert words in site.reasons[name]


def test_copy_rules_follow_the_cuda_documentation():
    blocks = rules.copy_blocks
    for is_async in (False, True):
        assert blocks(is_async, "pageable", "device") is not None  # stream sync to stage
        assert blocks(is_async, "device", "pageable") is not None  # returns when done
        assert blocks(is_async, "pageable", "pinned") is not None  # host to host
        assert blocks(is_async, "device", "device") is None
        assert blocks(is_async, "unknown", "device") is None  # never guess
    assert blocks(False, "pinned", "device") is not None and blocks(True, "pinned", "device") is None
    assert blocks(False, "device", "pinned") is not None and blocks(True, "device", "pinned") is None
    assert blocks(False, "managed", "device") is not None and blocks(True, "managed", "device") is None
    assert rules.memset_blocks("device") is None and rules.memset_blocks("pinned") and rules.memset_blocks("managed")
    assert rules.base_name("cudaMemcpyAsync_ptsz_v7000") == "cudaMemcpyAsync_ptsz"
    assert rules.base_name("cuMemFree_v2") == "cuMemFree_v2" and rules.base_name("cudaFree_v3020") == "cudaFree"


def test_a_thread_started_before_enable_is_caught_on_its_own_line(cupti_env):
    go, done = threading.Event(), []

    def worker():
        go.wait(10)
        with syncs.checking():
            done.append(here())
            fake.call("cuCtxSynchronize")

    thread = threading.Thread(target=worker, name="early-worker")
    thread.start()
    enabled(cupti_env)
    go.set()
    thread.join(10)
    (site,) = syncs.report().sites
    assert (site.first.lineno, site.first.thread, site.layers) == (done[0], "early-worker", ("cupti",))


def test_other_threads_outside_regions_are_not_reported(cupti_env):
    enabled(cupti_env)
    inside, outside_done = threading.Event(), threading.Event()

    def outsider():
        inside.wait(10)
        fake.call("cuCtxSynchronize")  # while another thread holds a region: not this thread's business
        outside_done.set()

    thread = threading.Thread(target=outsider)
    thread.start()
    with syncs.checking():
        inside.set()
        outside_done.wait(10)
    thread.join(10)
    assert not syncs.report(), syncs.report().format()


def test_cupti_is_held_from_the_first_region_until_disable(cupti_env):
    enabled(cupti_env)
    assert not fake.driver.subscribers  # enable() alone leaves CUPTI to the profiler
    entered, leave = threading.Event(), threading.Event()

    def other():
        with syncs.checking():
            entered.set()
            leave.wait(10)

    with syncs.checking():
        assert len(fake.driver.subscribers) == 1
        with syncs.checking():
            assert len(fake.driver.subscribers) == 1
        thread = threading.Thread(target=other)
        thread.start()
        entered.wait(10)
    leave.set()
    thread.join(10)
    # Not given back at a region's end: a CUDA call's callback may be running on another thread (a D2H worker)
    # while the last region ends; unsubscribing there crashed a demo stage on an H200.
    assert len(fake.driver.subscribers) == 1
    with syncs.checking():
        assert len(fake.driver.subscribers) == 1  # the next step's region reuses it
    assert syncs.backend_choice().active == "cupti"
    syncs.disable()
    assert not fake.driver.subscribers  # disable() lets the profiler have CUPTI again


def test_cupti_taken_falls_back_to_torch_and_says_why_once(cupti_env, caplog):
    fake.hold_by_other_tool()
    enabled(cupti_env)
    with caplog.at_level(logging.WARNING, logger="syncless.syncs"):
        for _ in range(3):
            with syncs.checking():
                line = here()
                fake.torch_op([("cudaStreamSynchronize", [0])])
    assert fake.driver.subscribe_calls == 1  # not retried per region
    choice = syncs.backend_choice()
    assert choice.active == "torch" and "another CUPTI subscriber" in choice.reason
    assert sum("CUPTI cannot be used" in r.getMessage() for r in caplog.records) == 1
    (site,) = syncs.report().sites
    assert (site.first.lineno, site.count, site.layers) == (line, 3, ("torch",))
    assert "not CUPTI: another CUPTI subscriber" in syncs.report().format()
    fake.hold_by_other_tool(False)
    syncs.disable()
    enabled(cupti_env)  # enable() tries again
    with syncs.checking():
        assert fake.driver.subscribers


def test_cupti_refusing_for_another_reason_names_it(cupti_env):
    fake.driver.refuse_with = fake.Result.ERROR_NOT_INITIALIZED
    enabled(cupti_env)
    with syncs.checking():
        pass
    assert "ERROR_NOT_INITIALIZED" in syncs.backend_choice().reason


def test_without_cupti_python_auto_uses_torch_and_cupti_is_an_error(cupti_env, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "cupti", None)  # import fails: not installed
    with caplog.at_level(logging.INFO, logger="syncless.syncs"):
        enabled(cupti_env)
    choice = syncs.backend_choice()
    assert choice.active == "torch" and "pip install 'syncless[cupti]'" in choice.reason
    assert any("torch backend" in r.getMessage() for r in caplog.records)
    syncs.disable()
    syncs.set_backend("cupti")
    with pytest.raises(MissingDependencyError, match=r"syncless\[cupti\]"):
        syncs.enable()
    syncs.set_backend("torch")
    assert syncs.enable() and syncs.backend_choice().active == "torch"


def test_torch_backend_never_subscribes(cupti_env):
    syncs.set_backend("torch")
    enabled(cupti_env)
    with syncs.checking():
        fake.call("cuStreamSynchronize", [0])
    assert fake.driver.subscribe_calls == 0 and not syncs.report()


def test_error_mode_raises_a_cupti_only_sync_when_the_region_exits(cupti_env):
    syncs.set_mode("error")
    enabled(cupti_env)
    with pytest.raises(SyncViolation) as caught:
        with syncs.checking():
            line = here()
            fake.call("cuStreamSynchronize", [0])
            reached = True
    assert reached  # the driver call itself cannot raise
    assert f"test_cupti_backend.py:{line}" in str(caught.value) and "cuStreamSynchronize" in str(caught.value)
    with pytest.raises(KeyError):  # the user's own error is not masked
        with syncs.checking():
            fake.call("cuStreamSynchronize", [0])
            raise KeyError("mine")

    @syncs.checked
    def step():
        fake.call("cuMemFreeHost", [fake.PINNED_ADDR])

    with pytest.raises(SyncViolation, match="cuMemFreeHost"):
        step()


def test_warn_mode_warns_once_per_cupti_sync(cupti_env):
    syncs.set_mode("warn")
    enabled(cupti_env)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with syncs.checking():
            line = here()
            fake.call("cuEventSynchronize", [0])
    ours = [w for w in seen if issubclass(w.category, syncs.SyncWarning)]
    assert len(ours) == 1 and ours[0].lineno == line and "cuEventSynchronize" in str(ours[0].message)


def test_allowed_syncs_are_not_reported(cupti_env):
    enabled(cupti_env)
    with syncs.checking(), syncs.allowed():
        fake.call("cuStreamSynchronize", [0])
    assert not syncs.report()


def test_set_backend_validates():
    with pytest.raises(ValueError, match="auto, torch, cupti"):
        syncs.set_backend("nvtx")
    with pytest.raises(TypeError):
        syncs.set_backend(3)
    with pytest.raises(ConfigError, match="SYNCLESS_SYNC_BACKEND"):
        config.read("SYNCLESS_SYNC_BACKEND", {"SYNCLESS_SYNC_BACKEND": "cuda"})
    assert config.read("SYNCLESS_SYNC_BACKEND", {}) == "auto"


def test_describe_for_doctor_says_what_would_be_used(monkeypatch):
    monkeypatch.setattr(_backend, "_package_version", lambda name: None)
    described = _backend.describe()
    assert described["would_use"] == "torch" and "syncless[cupti]" in described["reason"]


def test_trace_with_the_cupti_backend_shows_blocked_time_per_site(cupti_env, tmp_path, capsys):
    import argparse
    import textwrap

    from syncless.syncs import _trace

    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent("""
        import cupti

        def step(i):
            cupti.call("cuStreamSynchronize", [0], body=cupti.wait_ms(1))
            return i

        assert sum(step(i) for i in range(3)) == 3
    """))
    parser = argparse.ArgumentParser()
    _trace.add_arguments(parser)
    cupti_env.requested = "torch"  # what trace puts back
    assert _trace.run(parser.parse_args(["--backend", "cupti", "--fn", "__main__:step", str(script)])) == 0
    out = capsys.readouterr().out
    assert "checked by torch + wrappers + CUPTI" in out and "blocked ms" in out, out
    (row,) = [line.split() for line in out.splitlines() if f"{script.name}:5" in line and line.split()[0].isdigit()]
    assert row[0] == "3" and "cupti" in row
    assert float(row[row.index("cupti") + 1]) >= 3.0  # blocked ms in total: three calls of >= 1 ms
    assert cupti_env.requested == "torch" and not syncs.is_enabled()


def test_pointer_types_read_what_the_driver_writes(monkeypatch):
    import ctypes

    from syncless.syncs import _cupti

    answers = {0x1000: (2, 0), 0x2000: (1, 0), 0x3000: (0, 0), 0x4000: (2, 1)}  # memory type, is managed

    class Driver:
        class cuPointerGetAttributes:  # noqa: N801 - the driver's name
            argtypes = restype = None

            def __call__(self, count, attributes, outputs, address):
                if address == 0x5000:
                    return 201  # CUDA_ERROR_INVALID_CONTEXT
                assert list(attributes) == [2, 8] and count == 2
                memory_type, managed = answers[address]
                ctypes.c_uint32.from_address(outputs[0]).value = memory_type
                ctypes.c_uint32.from_address(outputs[1]).value = managed
                return 0

        cuPointerGetAttributes = cuPointerGetAttributes()

    monkeypatch.setattr(_cupti.ctypes, "CDLL", lambda name: Driver())
    types = _cupti.PointerTypes()
    assert [types(a) for a in (0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x3000)] == [
        "device", "pinned", "pageable", "managed", "unknown", "pageable"]


def test_cupti_is_taken_again_after_a_re_enable_while_another_region_is_open(cupti_env):
    # disable() lets CUPTI go even while a region is open (say, a server thread's long-running region); the
    # first region entered after the next enable() must take it again, not only a region that finds no other open.
    enabled(cupti_env)
    with syncs.checking():
        assert len(fake.driver.subscribers) == 1
        syncs.disable()
        assert not fake.driver.subscribers
        enabled(cupti_env)
        with syncs.checking():
            assert len(fake.driver.subscribers) == 1, "CUPTI was not taken again after enable()"
            assert syncs.backend_choice().active == "cupti"
            line = here()
            fake.call("cuStreamSynchronize", [0])
    assert [(s.first.lineno, s.layers) for s in syncs.report().sites] == [(line, ("cupti",))]


def test_cupti_without_cupti_python_is_an_error_even_where_nothing_could_be_checked(restored_globals, monkeypatch):
    # On a CPU machine (no sync debug mode) enable() returned False, although the docs promise the error.
    monkeypatch.setitem(sys.modules, "cupti", None)  # import fails: not installed
    layers = _backend.backend
    monkeypatch.setattr(layers, "api", None)
    monkeypatch.setattr(layers, "requested", layers.requested)

    class NoDebugMode(_debugmode.FakeDebugMode):
        def unavailable_reason(self):
            return "this torch build has no CUDA sync debug mode (forced by the test)"

    monkeypatch.setattr(_debugmode, "_backend", NoDebugMode())
    syncs.set_mode("record")
    syncs.set_backend("cupti")
    with pytest.raises(MissingDependencyError, match=r"syncless\[cupti\]"):
        syncs.enable()
    assert not syncs.is_enabled()
    syncs.set_backend("auto")
    assert syncs.enable() is False  # auto: nothing to check here, said as before


def test_trace_with_the_cupti_backend_without_cupti_python_stops_with_the_error(restored_globals, monkeypatch,
                                                                                  tmp_path, capsys):
    import argparse

    from syncless.syncs import _trace

    monkeypatch.setitem(sys.modules, "cupti", None)
    monkeypatch.setattr(_backend.backend, "api", None)
    script = tmp_path / "ran.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    parser = argparse.ArgumentParser()
    _trace.add_arguments(parser)
    syncs.set_mode("record")
    assert _trace.run(parser.parse_args(["--backend", "cupti", str(script)])) == 2
    assert "syncless[cupti]" in capsys.readouterr().err
    assert not (tmp_path / "ran").exists()  # it did not carry on silently
