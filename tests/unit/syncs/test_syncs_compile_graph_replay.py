"""A sync under a CUDA graph trees replay is reported; one under its recording or warm-up is not.

``mode="reduce-overhead"`` puts torch/_inductor/cudagraph_trees.py on the
stack of every call of the compiled step: when a graph is warmed up
(``run_eager``), recorded (``record_function``) and replayed
(``execute_node``). The first two synchronize by design; a replay is the hot
loop itself. On the CPU the stacks are built from code objects that carry
torch's file names and function names (the shape of torch 2.11-2.13's call
chain), since no CUDA graph can run here; the GPU test
(tests/gpu/syncs/test_compiled_decode_gpu.py) plants a real one.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

from syncless import syncs
from syncless.syncs import _debugmode, _report

TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _torch_function(relative_path: str, name: str):
    """A function ``name(inner)`` that calls ``inner()``, whose frame says it is torch's ``relative_path``."""
    source = f"def {name}(inner):\n    return inner()\n"
    namespace: dict = {}
    exec(compile(source, os.path.join(TORCH_DIR, *relative_path.split("/")), "exec"), namespace)
    return namespace[name]


def _chain(*links):
    """``bind(seen)``: a call through the (file, function) links, outermost first, the innermost calling ``seen()``.

    Bound with functools.partial, which pushes no frame of its own: the only
    frames between the test and ``seen`` are the torch-named ones.
    """
    functions = [_torch_function(path, name) for path, name in links]

    def bind(seen):
        inner = seen
        for function in reversed(functions):
            inner = functools.partial(function, inner)
        return inner

    return bind


TREES = "_inductor/cudagraph_trees.py"
# What a reduce-overhead call looks like from the caller down: compile_fx's runtime wrapper, then graph trees.
OUTSIDE = [("_inductor/output_code.py", "__call__"), ("_inductor/compile_fx.py", "run"),
           (TREES, "deferred_cudagraphify"), (TREES, "run"), (TREES, "_run")]
REPLAY = _chain(*OUTSIDE, (TREES, "execute_node"), (TREES, "run"))  # CUDAGraphNode.run: replay, then a sync
RECORDING = _chain(*OUTSIDE, (TREES, "record_function"))
WARM_UP = _chain(*OUTSIDE, (TREES, "run_eager"), (TREES, "run"), (TREES, "_use_cuda_memory_pool_manager"))
FIRST_CALL = _chain(("_inductor/output_code.py", "__call__"), ("_inductor/compile_fx.py", "run"),
                    (TREES, "deferred_cudagraphify"), (TREES, "cudagraphify"), (TREES, "add_function"), (TREES, "run"),
                    (TREES, "_run"), (TREES, "run_eager"))

COMPILING = _chain(("_dynamo/convert_frame.py", "_compile"), ("_inductor/compile_fx.py", "compile_fx"))
# A default-mode call on a GPU: compile_fx's `run` (on some torch versions the wrapper that copies misaligned
# inputs) runs at every call, so a sync under it is the user's (seen on the H200, torch 2.11: it was dropped).
RUNTIME_WRAPPER = _chain(("_inductor/output_code.py", "__call__"), ("_inductor/compile_fx.py", "run"))
# cudagraphify without trees: its first call warms the graph up and records it inside cudagraphify_impl.
PLAIN_CUDAGRAPH_RECORDING = _chain(("_inductor/compile_fx.py", "run"), ("_inductor/compile_fx.py", "cudagraphify_impl"))


def _locate_here():
    """What the wait wrapper does for ``torch.cuda.synchronize()`` called by the frame above this one."""
    return _report.locate(_report.KIND_WAIT, "torch.cuda.synchronize() blocks the host until the GPU catches up",
                          _report.FIX_WAIT, sys._getframe(1))


def _handle_here():
    """The wrapper's whole path: locate from the frame above, then record."""
    violation = _report.locate(_report.KIND_WAIT, "torch.cuda.synchronize() blocks the host until the GPU catches up",
                               _report.FIX_WAIT, sys._getframe(1))
    if violation is not None:
        _report.handle(violation)


def _under_compile_here():
    return _report.is_under_compile(sys._getframe(1))


@pytest.mark.parametrize("chain, reported", [(REPLAY, True), (RECORDING, False), (WARM_UP, False), (FIRST_CALL, False),
                                             (COMPILING, False), (RUNTIME_WRAPPER, True),
                                             (PLAIN_CUDAGRAPH_RECORDING, False)],
                         ids=["replay", "recording", "warm-up", "first-call", "compiling", "runtime-wrapper",
                              "plain-cudagraph-recording"])
def test_only_a_replay_is_the_users_sync(chain, reported):
    violation = chain(_locate_here)(); line = sys._getframe().f_lineno  # noqa: E702
    under_compile = chain(_under_compile_here)()
    if reported:
        assert violation is not None, "a sync during a CUDA graph replay was dropped as compile-time work"
        assert (violation.filename, violation.lineno) == (__file__, line)
        assert violation.function == "test_only_a_replay_is_the_users_sync"
        assert not under_compile
    else:
        assert violation is None
        assert under_compile


def test_a_replay_sync_is_recorded_at_the_callers_line(fake_mode):
    with syncs.checking():
        REPLAY(_handle_here)(); line = sys._getframe().f_lineno  # noqa: E702
        RECORDING(_handle_here)()
        WARM_UP(_handle_here)()
    sites = syncs.report().sites
    assert [(s.first.filename, s.first.lineno, s.count) for s in sites] == [(__file__, line, 1)]
    assert "torch.cuda.synchronize()" in sites[0].first.operation


def test_undecided_graph_tree_frames_stay_compile_time():
    lone = _chain((TREES, "_use_cuda_memory_pool_manager"))
    assert lone(_locate_here)() is None
    assert _report.is_graph_replay(None) is False
    assert _debugmode.armer.count == 0
