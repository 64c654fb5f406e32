"""install()/uninstall() on a CPU-only torch: identity restore, composition, CPU copies untouched."""

import pytest
import torch

import syncless.cc as cc
from syncless._core import patching
from syncless.cc import _sync_patches


def _snapshot():
    owners = [(torch.Tensor, n) for n in ("to", "cuda", "copy_")]
    owners += [(owner, name) for owner, name, _ in _sync_patches.patch_targets()]
    return {(id(o), n): (o.__dict__.get(n, "<absent>") if isinstance(o, type) else getattr(o, n)) for o, n in owners}


@pytest.fixture(autouse=True)
def _clean():
    cc.reset_stats()
    yield
    cc.uninstall()


def test_install_uninstall_restores_identity():
    before = _snapshot()
    assert cc.install("emulate") is True
    assert cc.is_installed() and cc.is_emulating()
    after = _snapshot()
    assert all(after[k] is not before[k] for k in before), "every target must be patched"
    assert cc.install("emulate") is True  # idempotent
    assert _snapshot() == after
    cc.uninstall()
    restored = _snapshot()
    assert all(restored[k] is before[k] for k in before)
    assert not cc.is_installed() and not cc.is_emulating()


def test_install_off_patches_nothing():
    before = _snapshot()
    assert cc.install("off") is False
    assert all(_snapshot()[k] is before[k] for k in before)


def test_install_rejects_bad_mode_and_size():
    with pytest.raises(ValueError, match="allowed"):
        cc.install("sometimes")
    with pytest.raises(ValueError, match=">= 0"):
        cc.install("on", max_staged_bytes=-1)
    with pytest.raises(TypeError, match="int"):
        cc.install("on", max_staged_bytes=1.5)


def test_cpu_copies_pass_through_and_are_counted():
    cc.install("emulate")
    x = torch.randn(64)
    dst = torch.full((64,), float("nan"))
    y = x.to("cpu", non_blocking=True)
    dst.copy_(x, non_blocking=True)
    assert y is x  # torch's own .to: no copy needed
    assert torch.equal(dst, x)
    z = x.to(torch.float16, non_blocking=True)
    assert torch.equal(z, x.half())
    assert cc.stats().left_alone == {"no_cuda": 2}
    assert cc.stats().staged == cc.stats().offloaded == cc.stats().emulated_waits == 0


@pytest.mark.parametrize("cc_first", [True, False])
def test_composes_with_a_detector_layer_in_either_order(cc_first):
    before = _snapshot()
    seen = []

    def detector(next_fn):
        def to(self, *args, **kwargs):
            seen.append("detector")
            return next_fn(self, *args, **kwargs)

        return to

    if cc_first:
        cc.install("emulate")
    patching.add_layer(torch.Tensor, "to", "test.detector", patching.RANK_SYNC_DETECTOR, detector)
    if not cc_first:
        cc.install("emulate")
    torch.randn(3).to(torch.float64)
    assert seen == ["detector"]
    # Above the shim: the shim's layer is beneath the detector's.
    assert patching.beneath(torch.Tensor, "to", "test.detector") is not patching.original(torch.Tensor, "to")
    if cc_first:
        cc.uninstall()
        assert patching.is_layered(torch.Tensor, "to", "test.detector")
        patching.remove_layer(torch.Tensor, "to", "test.detector")
    else:
        patching.remove_layer(torch.Tensor, "to", "test.detector")
        cc.uninstall()
    restored = _snapshot()
    assert all(restored[k] is before[k] for k in before)


def test_emulate_context_manager_restores():
    before = torch.Tensor.__dict__.get("to", "<absent>")
    with cc.emulate() as handle:
        assert handle.started and cc.is_emulating()
        with cc.emulate() as inner:  # already on: the inner block does not end it
            assert not inner.started
        assert cc.is_emulating()
    assert not cc.is_emulating()
    assert torch.Tensor.__dict__.get("to", "<absent>") is before


def test_torch_event_is_a_subclass_while_installed():
    base = torch.Event
    cc.install("on")
    assert torch.Event is not base and issubclass(torch.Event, base)
    event = torch.Event()
    assert isinstance(event, base)
    cc.uninstall()
    assert torch.Event is base


def test_register_target_rejects_bad_input():
    with pytest.raises(TypeError, match="torch.Tensor"):
        cc.register_inplace_h2d_target([1, 2])
    with pytest.raises(ValueError, match="CUDA tensor"):
        cc.register_inplace_h2d_target(torch.zeros(3))


def test_install_without_cuda_patches_nothing_and_says_so(monkeypatch, caplog):
    from syncless._core import logs

    monkeypatch.setattr(cc, "_cuda_available", lambda: False)
    monkeypatch.setattr(logs, "_seen_keys", set())
    before = _snapshot()
    with caplog.at_level("WARNING", logger="syncless.cc"):
        assert cc.install("emulate") is False
        assert cc.install("on") is False
    assert not cc.is_installed() and not cc.is_emulating()
    assert all(_snapshot()[k] is before[k] for k in before)
    assert "torch.cuda.is_available() is False" in caplog.text


@pytest.mark.parametrize(("version", "ok"), [
    ("12.6.2.post1", False), ("12.9.0", False), ("12.9.1", True), ("12.9.10", True), ("13.0.0", True),
    ("13.3.1", True), ("11.8.7", False),
])
def test_bindings_floor(version, ok):
    from syncless.cc import _streams

    problem = _streams.bindings_problem(version)
    assert (problem is None) is ok
    if not ok:
        assert version in problem and "pip install -U 'cuda-bindings>=12.9.1'" in problem


def test_install_refuses_bindings_that_hold_the_gil(monkeypatch):
    from importlib import metadata

    from syncless._core.errors import MissingDependencyError

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "12.6.0" if name == "cuda-bindings" else real(name))
    with pytest.raises(MissingDependencyError, match=r"cuda-bindings 12\.6\.0 is installed.*GIL"):
        cc.install("on")
    assert not cc.is_installed()


@pytest.mark.parametrize("bad", ["x", None, [1.0], True])
def test_uninstall_refuses_a_timeout_that_is_not_a_number(bad):
    """Issue 28 item 9: ``cc.uninstall("x")`` raised "unsupported operand type(s) for +: 'float' and 'str'"."""
    cc.install("on")
    with pytest.raises(TypeError, match=r"uninstall\(timeout_s=\.\.\.\) must be a number of seconds"):
        cc.uninstall(bad)
    assert cc.is_installed()  # refused before anything was restored


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan")])
def test_uninstall_refuses_a_negative_timeout(bad):
    """Issue 28 item 9: ``cc.uninstall(-1)`` was accepted silently."""
    cc.install("on")
    with pytest.raises(ValueError, match=r"timeout_s=\.\.\.\) must be >= 0"):
        cc.uninstall(bad)
    assert cc.is_installed()
    cc.uninstall(0)  # zero is a valid bound (nothing is queued)
    assert not cc.is_installed()


def test_emulate_without_cuda_patches_nothing_and_says_so(monkeypatch, caplog):
    """Issue 28 item 9: on a CPU, ``cc.emulate()`` patched ``Tensor.to`` without the warning install("emulate") gives."""
    from syncless._core import logs

    monkeypatch.setattr(cc, "_cuda_available", lambda: False)
    monkeypatch.setattr(logs, "_seen_keys", set())
    before = _snapshot()
    with caplog.at_level("WARNING", logger="syncless.cc"):
        handle = cc.emulate()
        with cc.emulate() as inner:
            assert not inner.started
    assert not handle.started and not cc.is_emulating()
    assert all(_snapshot()[k] is before[k] for k in before)
    assert "emulate() needs a CUDA GPU" in caplog.text and "torch.cuda.is_available() is False" in caplog.text
    handle.stop()


def test_install_without_cuda_bindings_says_so_at_install(monkeypatch):
    """docs/cc.md says cuda-bindings is required: without it install() returned True, and the error came from
    inside the first staged Tensor.to."""
    from importlib import metadata

    from syncless._core.errors import MissingDependencyError

    real = metadata.version

    def version(name):
        if name == "cuda-bindings":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", version)
    with pytest.raises(MissingDependencyError, match=r"needs cuda-bindings >= 12\.9\.1.*pip install"):
        cc.install("on")
    assert not cc.is_installed()


def test_install_without_cuda_warns_once_as_a_warning(monkeypatch):
    """Issue 35 item 9: documented to "warn once", it only logged, so ``warnings.catch_warnings`` caught nothing."""
    import warnings

    monkeypatch.setattr(cc, "_cuda_available", lambda: False)
    monkeypatch.setattr(cc, "_warned_no_cuda", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cc.install("emulate") is False
        assert cc.install("emulate") is False  # once per process and form
        cc.emulate()
    texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(texts) == 2 and "mode 'emulate' needs a CUDA GPU" in texts[0] and "emulate() needs" in texts[1]
    assert all(w.filename == __file__ for w in caught)  # at the caller's line
