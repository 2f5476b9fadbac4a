"""pytest-benchmark suites (not part of the default ``pytest`` run, whose testpaths is ``tests``).

Run them with ``make bench`` or ``python -m pytest bench --benchmark-only``; ``--benchmark-json out.json`` keeps
the numbers. They share the cache shapes of ``kvxfer-bench`` (``kvxfer.bench.models``).
"""

from __future__ import annotations

from kvxfer import KVLayout
from kvxfer.memory import TensorView

MILLION = 1_000_000


def fake_layout(
    num_blocks: int,
    layers: int = 1,
    heads: int = 8,
    block_size: int = 16,
    width: int = 256,
    itemsize: int = 2,
    cross_layer: bool = False,
) -> KVLayout:
    """A layout over address ranges that are never touched: planning is arithmetic only, so a million-block
    cache needs no memory. ``cross_layer``: one tensor whose block holds every layer (one segment)."""
    block = heads * block_size * width * itemsize
    strides = (block, block_size * width * itemsize, width * itemsize, itemsize)
    if cross_layer:
        shape = (num_blocks, layers, heads, block_size, width)
        v = TensorView(1 << 40, shape, (block * layers, block, *strides[1:]), itemsize, "bfloat16")
        return KVLayout.from_tensors([v], dims="BLHND")
    views = [
        TensorView(
            (1 << 40) + i * (num_blocks * block + (1 << 20)),
            (num_blocks, heads, block_size, width),
            strides,
            itemsize,
            "bfloat16",
        )
        for i in range(layers)
    ]
    return KVLayout.from_tensors(views, dims="BHND")
