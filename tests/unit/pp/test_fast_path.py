"""The per-step fast paths of the copy-engine transport, on the CPU: dense spans, cheap validation,
the per-thread context binding, the bound driver calls and the metadata ring (fakes stand in for CUDA)."""

from __future__ import annotations

import random
import threading
import types

import pytest
import torch

from syncless._core import cuda
from syncless._core.errors import CudaError
from syncless.pp import _driver as drv
from syncless.pp._layout import (
    SLOT_ALIGN_BYTES,
    Layout,
    StepCheck,
    TensorSpec,
    dense_spans,
    specs_from_persistent,
    validate_step,
)

# -- dense spans ------------------------------------------------------------------------


def test_dense_spans_two_bf16_tensors():
    # hidden + residual, 8192 bf16 per row, 3 rows each: 49152 bytes, already aligned.
    spans, end = dense_spans([16384, 16384], [3, 3])
    assert spans == [(0, 49152), (49152, 49152)] and end == 98304


def test_dense_spans_align_each_tensor_and_skip_empty_ones():
    spans, end = dense_spans([10, 6, 8], [3, 0, 5])
    assert spans == [(0, 30), (256, 0), (256, 40)] and end == 296
    assert dense_spans([10, 6], [0, 0]) == ([(0, 0), (0, 0)], 0)
    assert dense_spans([], []) == ([], 0)


def test_dense_spans_fit_the_fixed_layout_for_random_row_counts():
    rng = random.Random(20261130)
    for _ in range(300):
        count = rng.randint(1, 5)
        specs = {
            f"t{i}": TensorSpec(rng.choice([torch.bfloat16, torch.float32, torch.int64, torch.uint8]),
                                (rng.randint(1, 300),), rng.randint(0, 40))
            for i in range(count)
        }
        layout = Layout.from_specs(specs)
        rows = [rng.randint(0, spec.max_rows) for spec in specs.values()]
        spans, end = dense_spans([spec.row_nbytes for spec in specs.values()], rows)
        previous_end = 0
        for (offset, nbytes), name, r in zip(spans, layout.names, rows):
            assert nbytes == r * specs[name].row_nbytes
            assert offset % SLOT_ALIGN_BYTES == 0
            assert offset <= layout.offsets[name]  # never later than at maximum rows: the step fits
            assert offset >= previous_end  # no overlap
            if nbytes:
                previous_end = offset + nbytes
        assert end == previous_end <= layout.nbytes


# -- StepCheck ----------------------------------------------------------------------------


def _persistent():
    return {"hidden": torch.empty(7, 5, dtype=torch.bfloat16), "stats": torch.empty(7, 3, 2),
            "ids": torch.empty(9, dtype=torch.int64)}


def _step(rows=3):
    return {"hidden": torch.randn(rows, 5).to(torch.bfloat16), "stats": torch.randn(rows, 3, 2),
            "ids": torch.randint(0, 100, (rows,))}


def test_step_check_returns_rows_in_layout_order():
    check = StepCheck(specs_from_persistent(_persistent()), torch.device("cpu"), "stage 1")
    step = _step(2)
    step["ids"] = torch.randint(0, 9, (9,))
    reordered = {"ids": step["ids"], "stats": step["stats"], "hidden": step["hidden"]}
    assert check.rows(reordered) == [2, 2, 9]
    assert check.rows(_step(0)) == [0, 0, 0]


class _Frozen(dict):
    """A mapping that is not a plain dict: takes the slow path, same answer."""


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: (s.pop("ids"), s.update(extra=torch.zeros(1))),
        lambda s: s.update(extra=torch.zeros(1)),
        lambda s: s.update(hidden=torch.randn(3, 5)),
        lambda s: s.update(stats=torch.randn(3, 2, 3)),
        lambda s: s.update(ids=torch.randint(0, 9, (10,))),
        lambda s: s.update(ids=torch.tensor(3)),
        lambda s: s.update(ids=[1, 2]),
        lambda s: s.update(hidden=torch.empty(3, 5, dtype=torch.bfloat16, device="meta")),
    ],
)
def test_step_check_raises_exactly_what_validate_step_raises(mutate):
    specs = specs_from_persistent(_persistent())
    cpu = torch.device("cpu")
    step = _step(3)
    mutate(step)
    with pytest.raises((TypeError, ValueError)) as slow:
        validate_step(specs, step, cpu, "stage 1 (rank 1)")
    with pytest.raises(slow.type) as fast:
        StepCheck(specs, cpu, "stage 1 (rank 1)").rows(step)
    assert str(fast.value) == str(slow.value)


def test_step_check_accepts_any_mapping_and_refuses_non_mappings():
    check = StepCheck(specs_from_persistent(_persistent()), torch.device("cpu"), "stage 1")
    assert check.rows(_Frozen(_step(4))) == [4, 4, 4]
    with pytest.raises(TypeError, match="dict"):
        check.rows([1, 2])


# -- ThreadBinding --------------------------------------------------------------------------


class _FakeThreadState:
    """Per-thread 'current context' and 'current device' as the driver and torch would report them."""

    def __init__(self, contexts_by_device):
        self.local = threading.local()
        self.contexts_by_device = contexts_by_device
        self.calls: list[str] = []

    def ctx(self):
        return getattr(self.local, "ctx", 0)

    def device(self):
        ctx = self.ctx()
        for dev, handle in self.contexts_by_device.items():
            if handle == ctx:
                return dev
        return getattr(self.local, "device", 0)

    def binding(self, ordinal):
        def get_current():
            self.calls.append("get")
            return self.ctx()

        def set_current(handle):
            self.calls.append("set")
            self.local.ctx = handle

        def push(handle):
            self.calls.append("push")
            self.local.stack = [*getattr(self.local, "stack", []), self.ctx()]
            self.local.ctx = handle

        def pop():
            self.calls.append("pop")
            self.local.ctx = self.local.stack.pop()

        return drv.ThreadBinding(ordinal, self.contexts_by_device[ordinal], self.device, get_current, set_current,
                                 push, pop)


def _call(binding, state):
    pushed = binding.enter()
    inside = state.ctx()
    binding.exit(pushed)
    return pushed, inside


def test_binding_asks_the_driver_once_per_thread_when_ours_is_current():
    state = _FakeThreadState({0: 100, 1: 101})
    binding = state.binding(1)
    state.local.ctx = 101
    for _ in range(5):
        assert _call(binding, state) == (False, 101)
    assert state.calls == ["get"]
    results = []

    def other_thread():
        state.local.ctx = 101
        results.append(_call(binding, state))
        results.append(_call(binding, state))

    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    assert results == [(False, 101), (False, 101)]
    assert state.calls == ["get", "get"]  # one more check, for the new thread


def test_binding_pushes_when_the_thread_is_on_another_gpu_and_restores_it():
    state = _FakeThreadState({0: 100, 1: 101})
    binding = state.binding(1)
    state.local.ctx = 100
    assert _call(binding, state) == (True, 101)
    assert state.ctx() == 100 and state.calls == ["push", "pop"]
    # After a switch to our GPU the binding stops pushing; after a switch away it pushes again.
    state.local.ctx = 101
    assert _call(binding, state) == (False, 101)
    state.local.ctx = 100
    assert _call(binding, state) == (True, 101)
    assert state.ctx() == 100


def test_binding_sets_ours_on_a_thread_with_no_context_and_pushes_over_a_foreign_one():
    state = _FakeThreadState({0: 100, 1: 101})
    binding = state.binding(0)
    assert state.ctx() == 0
    assert _call(binding, state) == (False, 100)
    assert state.ctx() == 100 and state.calls == ["get", "set"]
    # A non-primary context of the same GPU (torch still reports device 0): pushed every time, never trusted.
    other = state.binding(0)
    state.local.ctx = 555
    state.local.device = 0
    assert _call(other, state) == (True, 100)
    assert _call(other, state) == (True, 100)
    assert state.ctx() == 555
    assert state.calls[2:] == ["get", "push", "pop", "get", "push", "pop"]


def test_binding_forget_makes_it_ask_again():
    state = _FakeThreadState({0: 100})
    binding = state.binding(0)
    state.local.ctx = 100
    _call(binding, state)
    binding.forget()
    _call(binding, state)
    assert state.calls == ["get", "get"]


# -- Hot ------------------------------------------------------------------------------------


def test_hot_calls_pass_arguments_and_raise_cuda_errors(monkeypatch):
    real = pytest.importorskip("cuda.bindings.driver")
    ok, bad = real.CUresult.CUDA_SUCCESS, real.CUresult.CUDA_ERROR_INVALID_VALUE
    seen = []
    answer = {"code": ok}

    def recorder(name):
        def fn(*args):
            seen.append((name, args))
            return (answer["code"],)

        return fn

    fake = types.SimpleNamespace(
        CUresult=real.CUresult,
        CUstreamWaitValue_flags=real.CUstreamWaitValue_flags,
        CUstreamWriteValue_flags=real.CUstreamWriteValue_flags,
        **{name: recorder(name) for name in ("cuMemcpyAsync", "cuEventRecord", "cuStreamWaitEvent",
                                             "cuStreamWaitValue64", "cuStreamWriteValue64")},
    )
    monkeypatch.setattr(cuda, "ensure_driver", lambda: fake)
    hot = drv.Hot()
    event = types.SimpleNamespace(handle="ev")
    hot.memcpy(1, 2, 3, 4)
    hot.record(event, 5)
    hot.wait_event(event, 6)
    hot.wait_geq(7, 8, 9)
    hot.write(10, 11, 12)
    geq = int(real.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
    default = int(real.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
    assert seen == [
        ("cuMemcpyAsync", (1, 2, 3, 4)),
        ("cuEventRecord", ("ev", 5)),
        ("cuStreamWaitEvent", (6, "ev", 0)),
        ("cuStreamWaitValue64", (7, 8, 9, geq)),
        ("cuStreamWriteValue64", (10, 11, 12, default)),
    ]
    answer["code"] = bad
    for call, name in [(lambda: hot.memcpy(1, 2, 3, 4), "cuMemcpyAsync"), (lambda: hot.write(1, 2, 3), "cuStreamWriteValue64"),
                       (lambda: hot.wait_geq(1, 2, 3), "cuStreamWaitValue64"), (lambda: hot.record(event, 1), "cuEventRecord"),
                       (lambda: hot.wait_event(event, 1), "cuStreamWaitEvent")]:
        with pytest.raises(CudaError) as info:
            call()
        assert info.value.call == name and info.value.name == "CUDA_ERROR_INVALID_VALUE"


# -- depth 0: sharing the persistent tensors ----------------------------------------------------


class _NoContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _fake_allocations(monkeypatch, allocations, failing=()):
    """Pretend ``data_ptr()`` values fall in ``allocations`` (base -> size); IPC export fails for ``failing``."""
    from syncless.pp import _copy_engine_setup

    exported = []

    def allocation_of(ptr):
        for base, size in allocations.items():
            if base <= ptr < base + size:
                return base, size
        raise AssertionError(f"no allocation holds {ptr:#x}")

    def ipc_handle(base):
        if base in failing:
            raise CudaError("cuIpcGetMemHandle", 1, "CUDA_ERROR_INVALID_VALUE", "invalid argument", "")
        exported.append(base)
        return base.to_bytes(8, "little") * 8

    monkeypatch.setattr(_copy_engine_setup.drv, "allocation_of", allocation_of)
    monkeypatch.setattr(_copy_engine_setup.drv, "ipc_handle", ipc_handle)
    return exported


class _FakeTensor:
    def __init__(self, ptr, numel=4, itemsize=4):
        self._ptr, self._numel, self._itemsize = ptr, numel, itemsize

    def data_ptr(self):
        return self._ptr

    def numel(self):
        return self._numel

    def element_size(self):
        return self._itemsize


def test_share_persistent_gives_one_handle_per_allocation_and_each_tensor_its_offset(monkeypatch):
    from syncless.pp import _persistent
    from syncless.pp._copy_engine_setup import _share_persistent

    exported = _fake_allocations(monkeypatch, {0x10000: 0x10000, 0x40000: 0x1000})
    specs = {name: TensorSpec(torch.float32, (4,), 2) for name in ("a", "b", "c", "empty")}
    persistent = {"a": _FakeTensor(0x10200, 8), "b": _FakeTensor(0x40000, 8), "c": _FakeTensor(0x18000, 8),
                  "empty": _FakeTensor(0, numel=0)}
    # Both allocations hold nothing but these tensors (as if alloc_persistent had carved them there).
    carved = {0x10000: [_persistent.Span("a", 0x10200, 0x10220), _persistent.Span("c", 0x18000, 0x18020)],
              0x40000: [_persistent.Span("b", 0x40000, 0x40020)]}
    monkeypatch.setattr(_persistent, "carved_spans", carved.get)
    targets, handles = _share_persistent(_NoContext(), persistent, Layout.from_specs(specs))
    assert exported == [0x10000, 0x40000]  # "a" and "c" share the first allocation's handle
    assert targets == [(0, 0x200), (1, 0), (0, 0x8000), (-1, 0)]
    assert len(handles) == 2 and all(len(h) == 64 for h in handles)


def test_share_persistent_refuses_memory_ipc_cannot_share_and_says_what_to_do(monkeypatch):
    from syncless._core.errors import CopyEngineUnavailable
    from syncless.pp._copy_engine_setup import _share_persistent

    _fake_allocations(monkeypatch, {0x10000: 0x20}, failing={0x10000})  # covered whole by the tensor
    specs = {"hidden": TensorSpec(torch.bfloat16, (8,), 2)}
    with pytest.raises(CopyEngineUnavailable, match=r"persistent\['hidden'\].*expandable_segments.*depth >= 1"):
        _share_persistent(_NoContext(), {"hidden": _FakeTensor(0x10000, 16, 2)}, Layout.from_specs(specs))


# -- batched copies ------------------------------------------------------------------------------


def _batch_fake(monkeypatch, real, codes, shape=lambda code: (code,)):
    """A fake driver module that records every call; ``codes`` maps a call name to its result code.

    ``shape`` turns a result code into what the call returns (cuda-bindings 12.x returns
    ``(code, failIdx)`` from cuMemcpyBatchAsync).
    """
    seen = []

    def recorder(name):
        def fn(*args):
            seen.append((name, args))
            code = codes.get(name, real.CUresult.CUDA_SUCCESS)
            return shape(code) if name == "cuMemcpyBatchAsync" else (code,)

        return fn

    fake = types.SimpleNamespace(
        CUresult=real.CUresult,
        CUstreamWaitValue_flags=real.CUstreamWaitValue_flags,
        CUstreamWriteValue_flags=real.CUstreamWriteValue_flags,
        CUmemcpyAttributes=real.CUmemcpyAttributes,
        CUmemcpySrcAccessOrder=real.CUmemcpySrcAccessOrder,
        CUmemcpyFlags=real.CUmemcpyFlags,
        CUdeviceptr=real.CUdeviceptr,  # the real type: cuda-bindings 13 refuses plain ints in the batch lists
        **{name: recorder(name) for name in ("cuMemcpyAsync", "cuMemcpyBatchAsync", "cuStreamSynchronize",
                                             "cuEventRecord", "cuStreamWaitEvent", "cuStreamWaitValue64",
                                             "cuStreamWriteValue64")},
    )  # fmt: skip
    monkeypatch.setattr(cuda, "ensure_driver", lambda: fake)
    return fake, seen


def _ints(pointers):
    return [int(p) for p in pointers]


@pytest.mark.parametrize("shape", [lambda code: (code,), lambda code: (code, 0), lambda code: code],
                         ids=["bindings-13", "bindings-12-with-failIdx", "bare-result"])  # fmt: skip
def test_memcpy_all_batches_several_copies_and_copies_one_alone(monkeypatch, shape):
    real = pytest.importorskip("cuda.bindings.driver")
    _, seen = _batch_fake(monkeypatch, real, {}, shape)
    hot = drv.Hot(batch=True)
    hot.memcpy_all([(10, 20, 30), (40, 50, 60)], 7)
    hot.memcpy_all([(1, 2, 3)], 7)
    hot.memcpy_all([], 7)
    (name, args), single = seen
    assert name == "cuMemcpyBatchAsync"
    dsts, srcs, sizes, count, attrs, attr_indices, n_attrs, stream = args
    assert all(isinstance(p, real.CUdeviceptr) for p in dsts + srcs)
    assert (_ints(dsts), _ints(srcs), sizes, count, attr_indices, n_attrs, stream) == (
        [10, 40], [20, 50], [30, 60], 2, [0], 1, 7)  # fmt: skip
    (attr,) = attrs
    assert attr.srcAccessOrder == real.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    assert attr.flags == real.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE  # asks to leave SMs to compute
    assert single == ("cuMemcpyAsync", (1, 2, 3, 7))


def test_memcpy_all_copies_one_by_one_without_batching_or_on_the_legacy_stream(monkeypatch):
    real = pytest.importorskip("cuda.bindings.driver")
    _, seen = _batch_fake(monkeypatch, real, {})
    drv.Hot(batch=False).memcpy_all([(10, 20, 30), (40, 50, 60)], 7)
    drv.Hot(batch=True).memcpy_all([(10, 20, 30), (40, 50, 60)], 0)  # the driver refuses batches on stream 0
    assert seen == [("cuMemcpyAsync", (10, 20, 30, 7)), ("cuMemcpyAsync", (40, 50, 60, 7)),
                    ("cuMemcpyAsync", (10, 20, 30, 0)), ("cuMemcpyAsync", (40, 50, 60, 0))]  # fmt: skip


@pytest.mark.parametrize("shape", [lambda code: (code,), lambda code: (code, 1)])
def test_memcpy_all_raises_a_refused_batch(monkeypatch, shape):
    real = pytest.importorskip("cuda.bindings.driver")
    _batch_fake(monkeypatch, real, {"cuMemcpyBatchAsync": real.CUresult.CUDA_ERROR_INVALID_VALUE}, shape)
    with pytest.raises(CudaError) as info:
        drv.Hot(batch=True).memcpy_all([(10, 20, 30), (40, 50, 60)], 7)
    assert info.value.call == "cuMemcpyBatchAsync" and info.value.name == "CUDA_ERROR_INVALID_VALUE"


@pytest.mark.parametrize(
    ("bindings_major", "driver_version", "expect"),
    [(13, 13000, None), (12, 12080, None), (12, 12060, "need 12.8"),
     (13, 12090, "need 13.0"),  # cuda-bindings 13 calls the 13.0 form, which a 12.9 driver lacks
     (0, 12080, None)],  # version unknown: judged as 12.x bindings
)  # fmt: skip
def test_batch_api_problem_matches_bindings_to_driver(monkeypatch, bindings_major, driver_version, expect):
    real = pytest.importorskip("cuda.bindings.driver")
    fake, seen = _batch_fake(monkeypatch, real, {})
    fake.cuDriverGetVersion = lambda: (real.CUresult.CUDA_SUCCESS, driver_version)
    monkeypatch.setattr(drv, "_bindings_major", lambda: bindings_major)
    problem = drv.batch_api_problem()
    assert problem is None if expect is None else expect in problem
    assert seen == []  # no GPU work


def test_batch_copy_problem_tries_one_harmless_batch_then_synchronizes(monkeypatch):
    real = pytest.importorskip("cuda.bindings.driver")
    fake, seen = _batch_fake(monkeypatch, real, {})
    fake.cuDriverGetVersion = lambda: (real.CUresult.CUDA_SUCCESS, 13000)
    monkeypatch.setattr(drv, "_bindings_major", lambda: 13)
    assert drv.batch_copy_problem(1000, 2000, 5) is None
    (batch, sync) = seen
    assert (_ints(batch[1][0]), _ints(batch[1][1]), batch[1][2]) == ([2000, 2008], [1000, 1008], [8, 8])
    assert batch[1][-1] == 5 and sync == ("cuStreamSynchronize", (5,))


def test_batch_copy_problem_reports_a_refusal_and_raises_a_failed_synchronize(monkeypatch):
    real = pytest.importorskip("cuda.bindings.driver")
    fake, seen = _batch_fake(monkeypatch, real, {"cuMemcpyBatchAsync": real.CUresult.CUDA_ERROR_NOT_SUPPORTED})
    fake.cuDriverGetVersion = lambda: (real.CUresult.CUDA_SUCCESS, 13000)
    monkeypatch.setattr(drv, "_bindings_major", lambda: 13)
    assert "refused" in drv.batch_copy_problem(1000, 2000, 5)
    assert [name for name, _ in seen] == ["cuMemcpyBatchAsync"]  # refused when enqueued: no synchronize

    fake2, _ = _batch_fake(monkeypatch, real, {"cuStreamSynchronize": real.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS})
    fake2.cuDriverGetVersion = fake.cuDriverGetVersion
    with pytest.raises(CudaError) as info:  # a broken context is not a reason to copy one by one: it is fatal
        drv.batch_copy_problem(1000, 2000, 5)
    assert info.value.name == "CUDA_ERROR_ILLEGAL_ADDRESS"


def test_batch_copy_problem_names_old_bindings(monkeypatch):
    real = pytest.importorskip("cuda.bindings.driver")
    fake, _ = _batch_fake(monkeypatch, real, {})
    del fake.cuMemcpyBatchAsync
    assert "cuda-bindings 12.8" in drv.batch_copy_problem(1000, 2000, 5)
