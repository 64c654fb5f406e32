"""A small decoder-only transformer with random weights, cut into pipeline stages.

Weights are drawn from a seed per layer, so the model is the same however
it is split. Decoding keeps a preallocated KV cache per layer; nothing in
the forward pass reads a GPU value on the host.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from syncless.demo._config import ModelConfig


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP with a KV cache for ``batch`` sequences."""

    def __init__(self, cfg: ModelConfig, batch: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.norm1 = nn.LayerNorm(cfg.hidden, device=device, dtype=dtype)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False, device=device, dtype=dtype)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False, device=device, dtype=dtype)
        self.norm2 = nn.LayerNorm(cfg.hidden, device=device, dtype=dtype)
        self.up = nn.Linear(cfg.hidden, 4 * cfg.hidden, bias=False, device=device, dtype=dtype)
        self.down = nn.Linear(4 * cfg.hidden, cfg.hidden, bias=False, device=device, dtype=dtype)
        shape = (batch, cfg.heads, cfg.max_tokens, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def forward(self, x: torch.Tensor, later: torch.Tensor, position: int, first_row: int) -> torch.Tensor:
        """Run one decode step for ``x`` (rows, hidden) at ``position``, cache rows from ``first_row``.

        ``later`` marks the cache positions after ``position`` (bool, (max_tokens,)), which attention skips.
        """
        batch = x.shape[0]
        rows = slice(first_row, first_row + batch)
        q, k, v = self.qkv(self.norm1(x)).view(batch, 3, self.cfg.heads, self.cfg.head_dim).unbind(1)
        self.k_cache[rows, :, position] = k
        self.v_cache[rows, :, position] = v
        # Attend over the whole cache with later positions masked: the shapes stay the same every
        # step, so no per-shape set-up (cuDNN attention builds a plan per new length) and no sync.
        scores = torch.matmul(q.unsqueeze(2), self.k_cache[rows].transpose(-1, -2)).squeeze(2)
        scores = scores.masked_fill(later, float("-inf")) * self.scale
        weights = torch.softmax(scores.float(), dim=-1).to(x.dtype)
        attended = torch.matmul(weights.unsqueeze(2), self.v_cache[rows]).reshape(batch, self.cfg.hidden)
        x = x + self.proj(attended)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Stage(nn.Module):
    """One pipeline stage: the embedding (first), some layers, the head (last)."""

    def __init__(self, cfg: ModelConfig, layer_ids: range, *, first: bool, last: bool, batch: int,
                 device: torch.device, dtype: torch.dtype, seed: int = 0):
        super().__init__()
        cfg.validate()
        self.cfg, self.first, self.last = cfg, first, last
        self.embed = self.head = None
        if first:
            torch.manual_seed(seed)
            self.embed = nn.Embedding(cfg.vocab, cfg.hidden, device=device, dtype=dtype)
            self.position_embed = nn.Embedding(cfg.max_tokens, cfg.hidden, device=device, dtype=dtype)
        self.register_buffer("cache_positions", torch.arange(cfg.max_tokens, device=device), persistent=False)
        self.layers = nn.ModuleList()
        for index in layer_ids:
            torch.manual_seed(seed + 1 + index)
            self.layers.append(DecoderLayer(cfg, batch, device, dtype))
        if last:
            torch.manual_seed(seed + 1 + cfg.layers)
            self.norm = nn.LayerNorm(cfg.hidden, device=device, dtype=dtype)
            self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False, device=device, dtype=dtype)
        for parameter in self.parameters():
            parameter.requires_grad_(False)
        with torch.no_grad():
            for layer in self.layers:
                for linear in (layer.qkv, layer.proj, layer.up, layer.down):
                    linear.weight.mul_(1.0 / math.sqrt(cfg.layers + 1))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, position: int, first_row: int) -> torch.Tensor:
        """Decode one step of one micro-batch.

        The first stage takes token ids (rows,) and their ``positions`` (a
        device tensor); the others take hidden states (rows, hidden). The
        last stage returns the next token ids (greedy), the others hidden
        states. ``position`` indexes the KV cache; ``first_row`` is the
        micro-batch's first row in it.
        """
        if self.embed is not None:
            x = self.embed(x) + self.position_embed(positions)
        later = self.cache_positions > position  # one mask for every layer
        for layer in self.layers:
            x = layer(x, later, position, first_row)
        if self.head is not None:
            x = self.head(self.norm(x)).argmax(dim=-1)
        return x
