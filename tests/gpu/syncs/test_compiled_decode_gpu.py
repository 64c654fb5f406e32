"""The compiled decode loop on a GPU: ``mode="reduce-overhead"`` (CUDA graph trees), the real sync debug mode.

The CPU version is tests/unit/syncs/test_syncs_compile_decode.py; this one
adds what only a GPU has:

- the step is compiled with ``fullgraph=True, mode="reduce-overhead"``, so
  its steady state is a CUDA graph replay; in every mode, compiled before or
  after ``enable()``, dynamo refuses any recompile and no graph is captured
  again after ``enable()``;
- a real ``.item()`` planted in the eager loop is reported at its line;
- a sync planted under a replay is reported: ``force_cudagraph_sync`` makes
  ``CUDAGraphNode.run`` call ``torch.cuda.synchronize()`` right after each
  replay, inside the compiled callable. It is read only there, so every
  report is a replay's. Warm-up and recording synchronize too, by design,
  and must stay unreported.

Run: ``SYNCLESS_REQUIRE_GPU=1 PYTHONPATH=src python3 -m pytest tests/gpu/syncs/test_compiled_decode_gpu.py -v``.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import support.tiny_decoder as tiny
from support.detector import detector_put_back
from support.tiny_decoder import TinyDecoder, generate
from syncless import syncs

pytestmark = pytest.mark.gpu

dynamo = pytest.importorskip("torch._dynamo")

MODES = ("off", "warn", "error", "record")
SEED = 1234
PROMPT = [3, 14, 15, 92, 65]
NEW_TOKENS = 8
STEPS = len(PROMPT) - 1 + NEW_TOKENS
PLANT_AT = 6


def plant_item(i, token):
    """``between`` for :func:`generate`: one real ``.item()`` in the eager loop."""
    if i == PLANT_AT:
        token.item()  # PLANTED


PLANT_LINE = inspect.getsourcelines(plant_item)[1] + next(
    n for n, text in enumerate(inspect.getsourcelines(plant_item)[0]) if "PLANTED" in text)


def _compile(model, checked=False):
    step = syncs.checked(model.step) if checked else model.step  # checked decides in the mode set now
    return torch.compile(step, fullgraph=True, mode="reduce-overhead")


@pytest.fixture
def captures(monkeypatch):
    """A function returning how many CUDA graphs were captured since the fixture started."""
    counted = [0]
    original = torch.cuda.CUDAGraph.capture_begin

    def counting(self, *args, **kwargs):
        counted[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", counting)
    return lambda: counted[0]


@pytest.fixture(scope="module")
def baseline_tokens():
    """The same reduce-overhead loop without syncless: the detector off, nullcontext where the constructs were."""
    device = torch.device("cuda", 0)
    mode_before = syncs.mode()
    syncs.set_mode("off")
    try:
        dynamo.reset()
        step = _compile(TinyDecoder(device, seed=SEED, syncs_inside=False))
        prompt = torch.tensor(PROMPT, device=device)
        first = generate(step, prompt, NEW_TOKENS, mark_steps=True).tolist()  # warm-up, recording, replays
        again = generate(step, prompt, NEW_TOKENS, mark_steps=True).tolist()  # replays only
        assert first == again and len(set(first)) > 1
    finally:
        syncs.set_mode(mode_before)
        dynamo.reset()
    return first


def _sites():
    return [(s.first.filename, s.first.lineno, s.count) for s in syncs.report().sites]


@pytest.mark.parametrize("compiled_first", [True, False], ids=["compiled-before-enable", "compiled-after-enable"])
@pytest.mark.parametrize("mode", MODES)
def test_compiled_decode_loop_reduce_overhead(mode, compiled_first, cuda_device, baseline_tokens, captures):
    prompt = torch.tensor(PROMPT, device=cuda_device)
    with detector_put_back():
        dynamo.reset()
        syncs.set_mode(mode)
        syncs.reset()
        step = _compile(TinyDecoder(cuda_device, seed=SEED), checked=True)  # @checked inside the compiled code
        run = syncs.checked(generate)  # and around it
        graphs_before = dynamo.utils.counters["stats"]["unique_graphs"]
        if compiled_first:
            # warm-up, before the gate
            assert run(step, prompt, NEW_TOKENS, mark_steps=True).tolist() == baseline_tokens
            assert captures() > 0, "no CUDA graph was captured: CUDA graph trees skipped the step (see the log)"
        captured_at_enable = captures()
        assert syncs.enable() is (mode != "off")
        with dynamo.config.patch(error_on_recompile=True):
            assert run(step, prompt, NEW_TOKENS, mark_steps=True).tolist() == baseline_tokens
            # Compiled after enable(), the step was traced, warmed up and recorded inside the checked region: those
            # synchronize by design and are not reported.
            assert _sites() == [], syncs.report().format()
            if compiled_first:
                assert captures() == captured_at_enable, "enable() made CUDA graph trees record the step again"
            assert captures() > 0

            # A real .item() in the eager loop, reported at its line.
            if mode == "error":
                with pytest.raises(RuntimeError, match="hidden GPU sync") as raised:
                    run(step, prompt, NEW_TOKENS, between=plant_item, mark_steps=True)
                assert (raised.value.violation.filename, raised.value.violation.lineno) == (__file__, PLANT_LINE)
            elif mode == "warn":
                with pytest.warns(syncs.SyncWarning, match="hidden GPU sync"):
                    run(step, prompt, NEW_TOKENS, between=plant_item, mark_steps=True)
            else:
                run(step, prompt, NEW_TOKENS, between=plant_item, mark_steps=True)
            assert _sites() == ([] if mode == "off" else [(__file__, PLANT_LINE, 1)]), syncs.report().format()

            syncs.disable()
            assert run(step, prompt, NEW_TOKENS, mark_steps=True).tolist() == baseline_tokens
            syncs.enable()
            with syncs.checking():
                tokens = run(step, prompt, NEW_TOKENS, mark_steps=True)
            assert tokens.tolist() == baseline_tokens  # read back outside the region: .tolist() syncs on a GPU
            syncs.disable()
        assert dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before == 1
        if compiled_first:
            assert captures() == captured_at_enable
    dynamo.reset()


@pytest.mark.parametrize("mode", ["record", "warn", "error"])
def test_a_sync_under_a_cuda_graph_replay_is_reported(mode, cuda_device, baseline_tokens, captures):
    config = pytest.importorskip("torch._inductor.config")
    if not hasattr(config.triton, "force_cudagraph_sync"):
        pytest.fail(f"torch {torch.__version__} has no inductor config triton.force_cudagraph_sync to plant a sync")
    prompt = torch.tensor(PROMPT, device=cuda_device)
    with detector_put_back():
        dynamo.reset()
        syncs.set_mode(mode)
        step = _compile(TinyDecoder(cuda_device, seed=SEED))
        run = syncs.checked(generate)
        assert run(step, prompt, NEW_TOKENS, mark_steps=True).tolist() == baseline_tokens  # warm-up and recording
        recorded = captures()
        assert recorded > 0, "no CUDA graph was captured: CUDA graph trees skipped the step (see the log)"
        assert syncs.enable()
        syncs.reset()  # also lets generate's allowed(first_only=True) allow its first entry once more
        with config.patch({"triton.force_cudagraph_sync": True}):
            if mode == "error":
                with pytest.raises(RuntimeError, match=r"torch\.cuda\.synchronize\(\)"):
                    run(step, prompt, NEW_TOKENS, mark_steps=True)
            elif mode == "warn":
                with pytest.warns(syncs.SyncWarning, match=r"torch\.cuda\.synchronize\(\)"):
                    run(step, prompt, NEW_TOKENS, mark_steps=True)
            else:
                run(step, prompt, NEW_TOKENS, mark_steps=True)
        assert captures() == recorded, "the planted run recorded a graph: its syncs would not be a replay's"
        report = syncs.report()
        assert len(report.sites) == 1, report.format()
        site = report.sites[0]
        # The user's frame nearest the replay: the compiled step's own frame (dynamo runs its graph in it), or the
        # loop line that called it; either way the loop's call of the step is on the recorded stack.
        assert site.first.filename == tiny.__file__ and site.first.function in ("step", "generate"), report.format()
        assert f"line {tiny.STEP_CALL_LINE}, in generate" in site.first.stack, report.format()
        assert "torch.cuda.synchronize()" in site.first.operation
        # Every replay synchronized; the first step's was allowed by allowed(first_only=True), error mode stopped
        # at the second.
        assert site.count == (1 if mode == "error" else STEPS - 1), report.format()
        syncs.disable()
    dynamo.reset()
