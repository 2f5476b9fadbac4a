"""Cache geometry: model presets shaped as real serving stacks shape their paged KV, and custom geometry.

A cache is one numpy array per layer, shaped like vLLM's per-layer view ``[num_blocks, kv_heads, block_size, C]``
(FlashAttention layout: C = 2 * head_dim, K and V concatenated; MLA: one head, C = latent dim). numpy has no
bfloat16, so 2-byte types are stored as uint16 and the layout is told the real dtype name (it only moves bytes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..layout import KVLayout
from ..memory import as_view

# name -> (numpy storage dtype, dtype name in the layout fingerprint)
DTYPES = {
    "bf16": (np.uint16, "bfloat16"),
    "fp16": (np.float16, "float16"),
    "fp32": (np.float32, "float32"),
    "fp8": (np.uint8, "float8_e4m3fn"),
}


@dataclass(frozen=True)
class Geometry:
    """The paged-KV shape of one model (or one tensor-parallel shard of it)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int  # MLA: the latent dimension (kv_lora_rank + rope dim)
    dtype: str = "bf16"
    block_size: int = 16  # tokens per block
    mla: bool = False

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose from {sorted(DTYPES)}")
        for field in ("layers", "kv_heads", "head_dim", "block_size"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.mla and self.kv_heads != 1:
            raise ValueError("an MLA cache has one latent head")

    @property
    def itemsize(self) -> int:
        return np.dtype(DTYPES[self.dtype][0]).itemsize

    @property
    def width(self) -> int:
        """Elements per token per head: K and V side by side, or one MLA latent vector."""
        return self.head_dim if self.mla else 2 * self.head_dim

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block in one layer: the contiguous unit a descriptor moves when nothing coalesces."""
        return self.kv_heads * self.block_size * self.width * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers."""
        return self.layers * self.layer_block_bytes

    def blocks_for(self, tokens: int) -> int:
        return max(1, -(-tokens // self.block_size))

    def shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        return (num_blocks, self.kv_heads, self.block_size, self.width)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Geometry:
        return cls(**d)

    def describe(self) -> str:
        kind = f"MLA latent {self.head_dim}" if self.mla else f"{self.kv_heads} kv heads x {self.head_dim}"
        return (
            f"{self.name}: {self.layers} layers, {kind}, {self.dtype}, block {self.block_size} tokens "
            f"({self.layer_block_bytes} B per layer-block, {self.block_bytes} B per block)"
        )


PRESETS: dict[str, Geometry] = {
    "llama-3-8b": Geometry("llama-3-8b", layers=32, kv_heads=8, head_dim=128),
    # Llama-3-70B has 8 KV heads; tensor-parallel 8 leaves one per shard: this is one shard's cache.
    "llama-3-70b": Geometry("llama-3-70b", layers=80, kv_heads=1, head_dim=128),
    # DeepSeek-V3 MLA: one latent vector per token (kv_lora_rank 512 + rope 64 = 576), 61 layers.
    "deepseek-v3": Geometry("deepseek-v3", layers=61, kv_heads=1, head_dim=576, mla=True),
}


def allocate(geom: Geometry, num_blocks: int) -> list[np.ndarray]:
    """One uninitialised array per layer (the caller fills or poisons it, which also faults the pages in)."""
    storage = DTYPES[geom.dtype][0]
    return [np.empty(geom.shape(num_blocks), dtype=storage) for _ in range(geom.layers)]


def layout_of(geom: Geometry, arrays: list[np.ndarray]) -> KVLayout:
    """The kvxfer layout of per-layer arrays, fingerprinted with the geometry's real dtype name."""
    name = DTYPES[geom.dtype][1]
    views = [dataclasses.replace(as_view(a), dtype=name) for a in arrays]
    return KVLayout.from_tensors(views, dims="BHND")  # [num_blocks, kv_heads, block_size, width]
