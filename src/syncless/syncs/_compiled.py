"""Regions written inside code that ``torch.compile`` compiles.

Without ``fullgraph=True``, dynamo runs the code at a graph break as plain
Python in the middle of the compiled call; a region or allow opened in the
compiled function must hold there. The constructs get there so:

* a ``checked`` wrapper's frames are never compiled themselves (dynamo still
  compiles what they call): ``torch.compile(checked(fn))`` runs the wrapper
  eagerly, a real region around the compiled ``fn``; inlined into a compiled
  caller, a graph break in ``fn`` makes dynamo run the whole call at that
  break, which is then the same eager wrapper;
* ``checking()``/``allowed()`` traced where graph breaks are allowed return a
  :class:`TracedRegion` made in the traced code: dynamo traces it away when
  the block has no graph break, and when it has one, dynamo runs the
  enclosing function eagerly (its callees still compiled), where the
  construct is the real one.

Under ``fullgraph=True`` nothing Python runs inside the graph: the
constructs stay a ``nullcontext`` and a straight call. What is traced reads
nothing that ``enable()``/``disable()`` change, so they cause no recompile.
"""

from __future__ import annotations

import logging
import sys
import warnings
from types import CodeType

from syncless._core.logs import log_once

_log = logging.getLogger(__name__)


def graph_breaks_allowed() -> bool:
    """Whether the compile tracing the caller may break the graph (not ``fullgraph=True``).

    dynamo calls this at trace time and folds the result into the traced code
    as a constant (``_dynamo_marked_constant``, what
    ``torch._dynamo.assume_constant_result`` sets), with no guard: each
    compile asks again. Called only after ``is_compiling()`` was True.
    """
    convert = sys.modules.get("torch._dynamo.symbolic_convert")
    translator = getattr(convert, "InstructionTranslator", None)
    current_tx = getattr(translator, "current_tx", None)
    if current_tx is None:
        return False
    try:
        tx = current_tx()
    except AttributeError:  # no trace running on this thread (its thread-local was never set)
        return False
    if tx is None:
        return False
    return not (getattr(tx, "one_graph", True) or getattr(tx, "error_on_graph_break", False))


graph_breaks_allowed._dynamo_marked_constant = True  # type: ignore[attr-defined]


class TracedRegion:
    """What ``checking()``/``allowed()`` return while dynamo traces code that may break the graph.

    Made in the traced code, dynamo traces its ``__enter__``/``__exit__``
    (they do nothing). It cannot resume inside such a block after a graph
    break, so a break there makes dynamo run the enclosing function eagerly,
    where ``checking()``/``allowed()`` return the real region.
    """

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        return None


def say_not_a_region(qualname: str) -> bool:
    """Warn once per function that a ``checked`` call compiled into a ``fullgraph=True`` graph is not a region.

    dynamo calls this at trace time (see :func:`graph_breaks_allowed`), so it
    costs nothing when the graph runs.
    """
    message = (f"syncless.syncs: {qualname} is @syncs.checked but is compiled into a torch.compile(fullgraph=True) "
               "graph, which runs no Python: what the graph does is not checked there. Check the call of the "
               "compiled function instead (put it inside a checked region in eager code)")
    if log_once(_log, logging.DEBUG, f"checked-in-fullgraph-{qualname}", "%s", message):
        warnings.warn(message, UserWarning, stacklevel=2)
    return True


say_not_a_region._dynamo_marked_constant = True  # type: ignore[attr-defined]

_eager_codes: set[CodeType] = set()


def run_frames_eagerly(code: CodeType, recursive: bool = False) -> bool:
    """Tell dynamo never to compile a frame of ``code`` itself (``recursive``: nor what it calls).

    What ``torch._dynamo.skip`` does, through torch's C module, so that
    ``torch._dynamo`` is not imported. dynamo still inlines such a function
    into a frame it compiles. Returns False where this torch cannot be told
    (then a ``checked`` function given to ``torch.compile`` is traced into the
    graph and is no region there).
    """
    if code in _eager_codes:
        return True
    torch = sys.modules.get("torch")
    eval_frame = getattr(getattr(getattr(torch, "_C", None), "_dynamo", None), "eval_frame", None)
    action = getattr(eval_frame, "_FrameAction", None)
    strategy = getattr(eval_frame, "_FrameExecStrategy", None)
    set_strategy = getattr(eval_frame, "set_code_exec_strategy", None)
    if action is None or strategy is None or set_strategy is None:
        return False
    set_strategy(code, strategy(action.SKIP, action.SKIP if recursive else action.DEFAULT))
    _eager_codes.add(code)
    return True


def keep_out_of_dynamo(*functions: object) -> None:
    """Run the region bookkeeping that eager code calls (inside a compiled call) without dynamo looking at it.

    Called from a frame dynamo does not compile (a ``checked`` wrapper, a
    function dynamo fell back to running eagerly), each would otherwise be
    handed to dynamo as a new frame: traced once, found to hold no graph,
    and counted as a compiled frame.
    """
    for function in functions:
        code = getattr(getattr(function, "__func__", function), "__code__", None)
        if code is not None:
            run_frames_eagerly(code, recursive=True)
