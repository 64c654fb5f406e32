"""The demo model's sizes and how its layers split over stages (plain Python: the CLI imports it without torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the demo model."""

    vocab: int = 8192
    hidden: int = 1024
    heads: int = 16
    layers: int = 8
    max_tokens: int = 512

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def validate(self) -> None:
        """Raise ``ValueError`` on sizes that cannot form a model."""
        for name in ("vocab", "hidden", "heads", "layers", "max_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model {name} must be positive, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")


PRESETS = {
    "tiny": ModelConfig(vocab=1024, hidden=256, heads=4, layers=4, max_tokens=256),
    "small": ModelConfig(),
    "medium": ModelConfig(vocab=32768, hidden=4096, heads=32, layers=16, max_tokens=1024),
    # Sized so that on an H200 the GPU, not the host, sets the pace: a layer holds 12 * 8192^2 bf16
    # weights (1.6 GB), which one decode step of a micro-batch reads from HBM once (about 0.4 ms at
    # ~4 TB/s), against some 15 kernel launches (well under 0.1 ms of host time). 16 GB in all.
    "large": ModelConfig(vocab=32768, hidden=8192, heads=64, layers=8, max_tokens=512),
}

#: The preset the demo picks when --model is not given: GPU-paced on GPUs, quick on the CPU.
DEFAULT_GPU_MODEL = "large"
DEFAULT_CPU_MODEL = "tiny"
DEFAULT_GPU_BATCH = 32
DEFAULT_CPU_BATCH = 8
DEFAULT_GPU_STEPS = 128
DEFAULT_CPU_STEPS = 32


def split_layers(layers: int, stages: int) -> list[range]:
    """Give each stage a contiguous, near-equal range of layer indices."""
    if stages <= 0 or stages > layers:
        raise ValueError(f"stages must be between 1 and the layer count ({layers}), got {stages}")
    base, extra = divmod(layers, stages)
    ranges, start = [], 0
    for stage in range(stages):
        count = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + count))
        start += count
    return ranges


def stage_nbytes(cfg: ModelConfig, layers: int, *, first: bool, last: bool, rows: int, element_nbytes: int) -> int:
    """Bytes of one stage's weights and KV caches (what ``_model.Stage`` allocates; activations are small beside it).

    Per layer: attention's qkv and proj and the MLP's up and down (12 hidden^2 weights), and a K and a V
    cache of ``rows`` x ``max_tokens`` x hidden. The first stage adds the token and position embeddings,
    the last the output head.
    """
    per_layer = 12 * cfg.hidden * cfg.hidden + 2 * rows * cfg.max_tokens * cfg.hidden
    total = layers * per_layer
    if first:
        total += (cfg.vocab + cfg.max_tokens) * cfg.hidden
    if last:
        total += cfg.vocab * cfg.hidden
    return total * element_nbytes
