"""A compiled decode loop under the detector: a small transformer with a static KV cache, on inductor's CPU backend.

The decode step (:meth:`support.tiny_decoder.TinyDecoder.step`) holds
``allowed()``, ``allowed(first_only=True)`` and ``checking()``, is
decorated with ``@checked`` and compiled with ``fullgraph=True``; the eager
loop around it
(:func:`support.tiny_decoder.generate`) is ``@checked`` and calls the step
inside ``allowed(first_only=True)``. In every mode, compiled before or after
``enable()``:

- it compiles once: dynamo refuses any recompile (``error_on_recompile``)
  across ``enable()``/``disable()`` and a ``checking()`` block, and its
  counter says one frame;
- its tokens equal those of the same compiled loop without syncless (the
  detector off, the constructs replaced by ``nullcontext``);
- a planted ``.item()`` in the eager loop is reported at its line (a CPU has
  no CUDA sync debug mode: the planted line issues the warning torch issues
  there on a GPU, and the fake debug-mode switch stands in for the GPU's).

The GPU version, with ``mode="reduce-overhead"`` and a sync planted under a
CUDA graph replay, is tests/gpu/syncs/test_compiled_decode_gpu.py.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from support.tiny_decoder import TinyDecoder, generate
from syncless import syncs
from syncless.syncs import _debugmode

from .conftest import torch_sync_warning

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

MODES = ("off", "warn", "error", "record")
SEED = 1234
PROMPT = [3, 14, 15, 92, 65]
NEW_TOKENS = 8
PLANT_AT = 6  # a generating step, well after the first


def plant_item(i, token):
    """``between`` for :func:`generate`: one ``.item()`` in the eager loop."""
    if i == PLANT_AT:
        token.item(); torch_sync_warning()  # noqa: E702  PLANTED (on a GPU, torch's debug mode warns so for .item())


PLANT_LINE = inspect.getsourcelines(plant_item)[1] + next(
    n for n, text in enumerate(inspect.getsourcelines(plant_item)[0]) if "PLANTED" in text)


@pytest.fixture(scope="module")
def baseline_tokens():
    """The same compiled loop without syncless: the detector off, nullcontext where the constructs were."""
    mode_before = syncs.mode()
    syncs.set_mode("off")
    try:
        dynamo.reset()
        model = TinyDecoder("cpu", seed=SEED, syncs_inside=False)
        step = torch.compile(model.step, fullgraph=True, backend="inductor")
        tokens = generate(step, torch.tensor(PROMPT), NEW_TOKENS).tolist()
        eager = generate(TinyDecoder("cpu", seed=SEED, syncs_inside=False).step, torch.tensor(PROMPT), NEW_TOKENS)
        assert len(tokens) == NEW_TOKENS and len(set(tokens)) > 1
        # Eager and inductor agree here (a sanity check of the model; the contract compares compiled with compiled).
        assert eager.tolist() == tokens
    finally:
        syncs.set_mode(mode_before)
        dynamo.reset()
    return tokens


@pytest.mark.parametrize("compiled_first", [True, False], ids=["compiled-before-enable", "compiled-after-enable"])
@pytest.mark.parametrize("mode", MODES)
def test_compiled_decode_loop(mode, compiled_first, baseline_tokens, restored_globals):
    dynamo.reset()
    prompt = torch.tensor(PROMPT)
    with _debugmode.fake():
        syncs.set_mode(mode)
        syncs.reset()
        model = TinyDecoder("cpu", seed=SEED)
        counter = CompileCounterWithBackend("inductor")
        # @checked inside the compiled code (the step) and around it (the loop), decorated in this mode: checked
        # decides when it decorates.
        step = torch.compile(syncs.checked(model.step), fullgraph=True, backend=counter)
        run = syncs.checked(generate)
        if compiled_first:
            assert run(step, prompt, NEW_TOKENS).tolist() == baseline_tokens  # warm-up, before the gate
        assert syncs.enable() is (mode != "off")
        with dynamo.config.patch(error_on_recompile=True):
            assert run(step, prompt, NEW_TOKENS).tolist() == baseline_tokens  # the first calls after enable()
            assert not syncs.report(), syncs.report().format()

            if mode == "error":
                with pytest.raises(RuntimeError, match="hidden GPU sync") as raised:
                    run(step, prompt, NEW_TOKENS, between=plant_item)
                assert (raised.value.violation.filename, raised.value.violation.lineno) == (__file__, PLANT_LINE)
            elif mode == "warn":
                with pytest.warns(syncs.SyncWarning, match="hidden GPU sync"):
                    run(step, prompt, NEW_TOKENS, between=plant_item)
            elif mode == "off":
                with pytest.warns(UserWarning, match="synchronizing"):  # not ours: it goes its usual way
                    run(step, prompt, NEW_TOKENS, between=plant_item)
            else:
                run(step, prompt, NEW_TOKENS, between=plant_item)
            sites = [(s.first.filename, s.first.lineno, s.count) for s in syncs.report().sites]
            assert sites == ([] if mode == "off" else [(__file__, PLANT_LINE, 1)]), syncs.report().format()

            syncs.disable()
            assert run(step, prompt, NEW_TOKENS).tolist() == baseline_tokens
            syncs.enable()
            with syncs.checking():  # the compiled step inside an eager checked region, too
                assert step(torch.tensor([7]), torch.zeros(1, dtype=torch.int64)).shape == (1,)
            assert run(step, prompt, NEW_TOKENS).tolist() == baseline_tokens
            syncs.disable()
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times"
    dynamo.reset()
