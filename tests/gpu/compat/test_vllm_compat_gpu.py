"""A worker ported from vLLM to syncless.compat.vllm, on a GPU under emulated Confidential Computing.

What vLLM's GPU worker does with its seed modules, name for name: ``install()``
under CC, a compiled model step, ``with_gpu_sync_check`` on the step,
``enable_gpu_sync_check()`` after warm-up, each step's sampled token read
back on a stream from ``new_external_d2h_stream()`` (a ``non_blocking`` D2H
and an event recorded on that stream, synchronized inside
``gpu_sync_allowed()`` one step later), a prompt uploaded in place into a
buffer given to ``register_inplace_h2d_target``, and ``except RuntimeError``
around a step that syncs where it should not. The tokens must equal those
of the same compiled step without syncless.

Run: ``SYNCLESS_REQUIRE_GPU=1 PYTHONPATH=src python3 -m pytest tests/gpu/compat -v``.
"""

from __future__ import annotations

import pytest
import torch

import syncless.compat.vllm as vllm
from support.detector import detector_put_back
from support.tiny_decoder import TinyDecoder, generate
from syncless import cc, syncs
from syncless._core.errors import SyncViolation

pytestmark = pytest.mark.gpu

SEED = 99
PROMPT = [5, 8, 13, 21]
NEW_TOKENS = 10
STEPS = len(PROMPT) - 1 + NEW_TOKENS
PLANT_AT = 7


def test_a_worker_ported_from_vllm_under_emulated_cc(monkeypatch, cuda_device):
    dynamo = pytest.importorskip("torch._dynamo")
    dynamo.reset()
    model = TinyDecoder(cuda_device, seed=SEED)
    step = torch.compile(model.step, fullgraph=True)
    plain = generate(step, torch.tensor(PROMPT, device=cuda_device), NEW_TOKENS).tolist()  # no syncless at all

    monkeypatch.setattr(vllm, "_SYNC_CHECK_MODE", "error")  # as vLLM's tests set the seed's mode
    monkeypatch.setenv("SYNCLESS_CC", "emulate")  # CC's host-synchronous copies on a GPU without CC
    with detector_put_back():
        cc.uninstall()
        cc.reset_stats()
        try:
            assert vllm.install() is True and cc.is_emulating()
            d2h = vllm.new_external_d2h_stream()
            prompt = torch.empty(len(PROMPT), dtype=torch.int64, device=cuda_device)
            vllm.register_inplace_h2d_target(prompt)
            prompt.copy_(torch.tensor(PROMPT).pin_memory(), non_blocking=True)  # lands in place on the staging stream
            got = []

            @vllm.with_gpu_sync_check
            def execute_model(token, pos, previous, plant=False):
                if previous is not None:  # read the previous step's token back, a step late, as vLLM does
                    host, ready = previous
                    with vllm.gpu_sync_allowed():
                        ready.synchronize()
                    got.append(int(host[0]))  # a pinned host tensor: no GPU involved
                next_token = step(token, pos)
                d2h.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(d2h):
                    host = next_token.to("cpu", non_blocking=True)  # offloaded: returns at once
                    ready = torch.cuda.Event()
                    ready.record()
                if plant:
                    ready.synchronize()  # PLANTED: a host wait outside any allow region
                return next_token, (host, ready)

            def run(plant_at=None):
                got.clear()
                pos = torch.zeros(1, dtype=torch.int64, device=cuda_device)
                token, previous, caught = prompt[:1].clone(), None, []
                for i in range(STEPS):
                    try:
                        next_token, previous = execute_model(token, pos, previous, plant=(i == plant_at))
                    except RuntimeError as err:  # how vLLM's code catches the seed's error
                        caught.append(err)
                        # The step again, unplanted; the failed attempt already read the token before it back.
                        next_token, previous = execute_model(token, pos, None)
                    token = prompt[i + 1:i + 2].clone() if i + 1 < len(PROMPT) else next_token
                    pos += 1
                with vllm.gpu_sync_allowed():
                    previous[1].synchronize()
                got.append(int(previous[0][0]))
                return got[len(PROMPT) - 1:], caught

            run()  # warm-up before the gate
            vllm.enable_gpu_sync_check()
            assert syncs.is_enabled() and syncs.mode() == "error"
            tokens, caught = run()
            assert tokens == plain and caught == []
            tokens, caught = run(plant_at=PLANT_AT)
            assert tokens == plain
            assert len(caught) == 1 and isinstance(caught[0], SyncViolation), caught
            assert "torch.cuda.Event.synchronize()" in str(caught[0])
            assert "PLANTED" in open(__file__).read().splitlines()[caught[0].violation.lineno - 1]
            stats = cc.stats()
            # Each readback offloaded, or, from an idle D2H stream (the compiled step has finished), torch's own copy:
            # the transfer alone under CC (docs/porting-from-vllm.md).
            readbacks = stats.offloaded + stats.left_alone.get("idle_stream", 0)
            assert stats.in_place >= 1 and readbacks >= 3 * STEPS, stats
            syncs.disable()
        finally:
            cc.uninstall()
    dynamo.reset()
