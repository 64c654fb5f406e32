"""A small decoder-only transformer with a static KV cache, for tests of compiled decode loops.

Two layers, hidden size 64, four heads, random weights drawn from a seeded
generator. The KV cache is preallocated (poisoned with large random values
where nothing was written yet, which the attention mask must hide) and
updated in place with ``index_copy_`` at a position held in a tensor, so a
decode step has one shape for every position and compiles once, as an
engine's does. :meth:`TinyDecoder.step` is the function to compile.

With ``syncs_inside=True`` the step holds the detector's constructs where
model code would (``allowed(first_only=True)`` around the cache update,
``checking()`` around attention, ``allowed()`` around the head); with False
the same code runs with ``contextlib.nullcontext`` in their place, which is
the loop "without syncless".
"""

from __future__ import annotations

import contextlib
import math

import torch

from syncless import syncs


def _no_construct(*args, **kwargs):
    return contextlib.nullcontext()


class TinyDecoder:
    """Weights, a static KV cache and one decode step (greedy)."""

    def __init__(self, device, *, seed: int = 0, layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 128,
                 max_len: int = 32, syncs_inside: bool = True):
        self.device = torch.device(device)
        self.layers, self.hidden, self.heads, self.vocab, self.max_len = layers, hidden, heads, vocab, max_len
        self.head_dim = hidden // heads
        self.syncs_inside = syncs_inside
        gen = torch.Generator().manual_seed(seed)

        def weight(*shape, scale=None):
            scale = 1.0 / math.sqrt(shape[0]) if scale is None else scale
            return (torch.randn(*shape, generator=gen) * scale).to(self.device)

        self.embed = weight(vocab, hidden, scale=1.0)
        self.wq = [weight(hidden, hidden) for _ in range(layers)]
        self.wk = [weight(hidden, hidden) for _ in range(layers)]
        self.wv = [weight(hidden, hidden) for _ in range(layers)]
        self.wo = [weight(hidden, hidden) for _ in range(layers)]
        self.w_up = [weight(hidden, 4 * hidden) for _ in range(layers)]
        self.w_down = [weight(4 * hidden, hidden) for _ in range(layers)]
        self.unembed = weight(hidden, vocab)
        # Poison: positions not written yet hold large values, which only the mask keeps out of the result.
        shape = (layers, heads, max_len, self.head_dim)
        self.k_cache = (torch.randn(shape, generator=gen) * 1e4).to(self.device)
        self.v_cache = (torch.randn(shape, generator=gen) * 1e4).to(self.device)
        self.positions = torch.arange(max_len, device=self.device)
        # Fixed addresses (the cache is updated in place): CUDA graph trees keep them as static inputs instead of
        # copying them before each replay, and accept the cache's in-place update (a mutated input that is not
        # static makes them skip the graph).
        for t in (self.embed, self.unembed, self.positions, self.k_cache, self.v_cache, *self.wq, *self.wk, *self.wv,
                  *self.wo, *self.w_up, *self.w_down):
            torch._dynamo.mark_static_address(t)

    def _constructs(self):
        if self.syncs_inside:
            return syncs.allowed, syncs.checking
        return _no_construct, _no_construct

    @staticmethod
    def _norm(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def step(self, token, pos):
        """Return the next token (int64, shape [1]) after ``token`` at position ``pos`` (int64 tensors, shape [1]).

        Writes this position's keys and values into the cache in place.
        """
        allowed, checking = self._constructs()
        x = self.embed[token]  # [1, hidden]
        for layer in range(self.layers):
            h = self._norm(x)
            q = (h @ self.wq[layer]).view(self.heads, 1, self.head_dim)
            k = (h @ self.wk[layer]).view(self.heads, 1, self.head_dim)
            v = (h @ self.wv[layer]).view(self.heads, 1, self.head_dim)
            with allowed(first_only=True):
                self.k_cache[layer].index_copy_(1, pos, k)
                self.v_cache[layer].index_copy_(1, pos, v)
            with checking():
                scores = q @ self.k_cache[layer].transpose(-1, -2) / math.sqrt(self.head_dim)  # [heads, 1, max_len]
                visible = self.positions <= pos
                scores = torch.where(visible, scores, torch.full_like(scores, float("-inf")))
                attended = torch.softmax(scores, dim=-1) @ self.v_cache[layer]  # [heads, 1, head_dim]
            x = x + attended.reshape(1, self.hidden) @ self.wo[layer]
            x = x + torch.relu(self._norm(x) @ self.w_up[layer]) @ self.w_down[layer]
        with allowed():
            logits = self._norm(x) @ self.unembed
        return logits.argmax(-1)


def generate(step, prompt, new_tokens: int, *, between=None, mark_steps: bool = False):
    """Feed ``prompt`` through ``step`` one token at a time, then ``new_tokens`` greedy ones; return those.

    The eager loop around a compiled step, as an engine's is: ``step`` is
    called inside ``syncs.allowed(first_only=True)`` (the first call after
    ``enable()`` may sync, later ones may not), and ``between(i, token)``
    runs after each step. ``prompt`` is an int64 tensor on the model's
    device; nothing here reads a value back to the host. With
    ``mark_steps`` every step starts a new CUDA graph trees generation
    (``torch.compiler.cudagraph_mark_step_begin``), and each output is
    cloned before the next replay overwrites it.
    """
    pos = torch.zeros(1, dtype=torch.int64, device=prompt.device)
    inputs = [prompt[i:i + 1].clone() for i in range(prompt.numel())]
    token = inputs[0]
    generated = []
    for i in range(prompt.numel() - 1 + new_tokens):
        if mark_steps:
            torch.compiler.cudagraph_mark_step_begin()
        with syncs.allowed(first_only=True):
            next_token = step(token, pos).clone()  # STEP_CALL: where a sync under the compiled step is reported
        if between is not None:
            between(i, next_token)
        if i + 1 < prompt.numel():
            token = inputs[i + 1]
        else:
            generated.append(next_token)
            token = next_token
        pos += 1
    return torch.cat(generated)


def _step_call_line() -> int:
    import inspect

    lines, first = inspect.getsourcelines(generate)
    return first + next(n for n, text in enumerate(lines) if "# STEP_CALL" in text)


STEP_CALL_LINE = _step_call_line()
