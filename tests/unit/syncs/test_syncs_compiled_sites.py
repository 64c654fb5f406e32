"""A sync inside a compiled graph is reported at the user's call of the compiled function.

Not at inductor's generated wrapper (``torchinductor_*/...py``) or fx's
``<eval_with_key>.N``, whose names change with every recompile. The sync is
a blocking CUDA call of an operator's kernel, seen through the CUPTI
stand-in (the CPU has no debug mode to warn from a graph).
"""

from __future__ import annotations

import pytest
import torch

from syncless import syncs

from .fake_cupti import ops
from .test_cupti_backend import cupti_env, enabled, here  # noqa: F401 - the fixture


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_sync_in_a_compiled_graph_is_one_site_at_the_callers_line_across_recompiles(cupti_env, backend):
    ops.register()

    def step(x):
        return torch.ops.syncless_fake.blocking_clone(x)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    try:
        compiled(torch.randn(3))  # compiled before the gate opens
        enabled(cupti_env)
        with syncs.checking():
            for size in (3, 5, 7):  # a recompile for each new size
                line = here()
                out = compiled(torch.randn(size))
                assert out.shape == (size,)
    finally:
        torch._dynamo.reset()
    found = syncs.report()
    assert [(s.first.filename, s.first.lineno, s.count) for s in found.sites] == [(__file__, line, 3)], found.format()
